"""Co-attention against loops from Brauwers eqs. 6-16 and Galassi's nested aggregation."""

from __future__ import annotations

import pytest
import torch
from features.batching import assert_batch_equals_items
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.features import (
    AlternatingCoAttention,
    InteractiveCoAttention,
    MultiGrainedCoAttention,
    NestedCoAttention,
    ParallelCoAttention,
)
from attnkit.features.aggregation import LinearAggregation, NestedPerceptronAggregation


def softmax(xs):
    ex = [torch.exp(x) for x in xs]
    s = sum(ex)
    return [e / s for e in ex]


def weighted(ws, fs):
    return sum(w * f for w, f in zip(ws, fs, strict=True))


def additive(score, q, k):
    """wᵀ tanh(W1 q + W2 k + b) from an attnkit Additive's parameters (eq. 6/7)."""
    h = score.W2.weight @ k + score.W2.bias
    if q is not None:
        h = h + score.W1.weight @ q
    return score.w.weight[0] @ torch.tanh(h)


def _inputs(b=2, n1=5, n2=4, d1=6, d2=3):
    return rand(b, n1, d1, seed=1), rand(b, n2, d2, seed=2)


def _params(m):
    return list(m.parameters())


def test_alternating_eqs_6_to_9():
    torch.manual_seed(0)
    m = AlternatingCoAttention(6, 3, 7, dtype=torch.float64)
    f1, f2 = _inputs()
    s0, s2, s1 = m.att0.score, m.att2.score, m.att1.score

    def loop():
        rows = []
        for b in range(2):
            F1, F2 = list(f1[b]), list(f2[b])
            c0 = weighted(softmax([additive(s0, None, k) for k in F1]), F1)  # eq. 7
            c2 = weighted(softmax([additive(s2, c0, k) for k in F2]), F2)  # eq. 8
            c1 = weighted(softmax([additive(s1, c2, k) for k in F1]), F1)  # eq. 9
            rows.append(torch.cat([c1, c2]))
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: m(f1, f2).concat(), loop, [f1, f2, *_params(m)], atol=1e-12, rtol=1e-12
    )
    assert s1.W2 is s0.W2 and s1.w is s0.w  # eq. 9 reuses eq. 7's weights


def test_interactive_eqs_10_11():
    torch.manual_seed(0)
    m = InteractiveCoAttention(6, 3, 7, dtype=torch.float64)
    f1, f2 = _inputs()

    def loop():
        rows = []
        for b in range(2):
            F1, F2 = list(f1[b]), list(f2[b])
            k1, k2 = sum(F1) / len(F1), sum(F2) / len(F2)  # eq. 10
            c1 = weighted(softmax([additive(m.att1.score, k2, k) for k in F1]), F1)  # eq. 11
            c2 = weighted(softmax([additive(m.att2.score, k1, k) for k in F2]), F2)
            rows.append(torch.cat([c1, c2]))
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: m(f1, f2).concat(), loop, [f1, f2, *_params(m)], atol=1e-12, rtol=1e-12
    )


@pytest.mark.parametrize("affinity", ["bilinear", "concat"])
@pytest.mark.parametrize("score", ["additive", "max"])
def test_parallel_eqs_12_to_16(affinity, score):
    torch.manual_seed(0)
    d2 = 6 if affinity == "concat" else 3
    m = ParallelCoAttention(6, d2, affinity=affinity, score=score, d_w=5, dtype=torch.float64)
    f1, f2 = _inputs(d2=d2)

    def A(k1, k2):
        if affinity == "bilinear":
            return torch.tanh(k1 @ m.W_A @ k2)  # eq. 12
        return m.w_A.weight[0] @ torch.cat([k1, k2, k1 * k2])  # eq. 13

    def loop():
        rows = []
        for b in range(2):
            F1, F2 = list(f1[b]), list(f2[b])
            aff = [[A(x, y) for y in F2] for x in F1]
            if score == "additive":
                e1 = [
                    m.w1.weight[0]
                    @ torch.tanh(
                        sum(aff[i][j] * (m.W2.weight @ F2[j]) for j in range(len(F2)))
                        + m.W1.weight @ F1[i]
                    )
                    for i in range(len(F1))
                ]  # eq. 14
                e2 = [
                    m.w2.weight[0]
                    @ torch.tanh(
                        sum(aff[i][j] * (m.W1.weight @ F1[i]) for i in range(len(F1)))
                        + m.W2.weight @ F2[j]
                    )
                    for j in range(len(F2))
                ]  # eq. 15
            else:
                value = lambda t: float(t.detach())  # noqa: E731
                e1 = [max(row, key=value) for row in aff]  # eq. 16
                e2 = [max((aff[i][j] for i in range(len(F1))), key=value) for j in range(len(F2))]
            rows.append(torch.cat([weighted(softmax(e1), F1), weighted(softmax(e2), F2)]))
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: m(f1, f2).concat(), loop, [f1, f2, *_params(m)], atol=1e-12, rtol=1e-12
    )


def test_nested_attention_over_attention():
    f1, f2 = _inputs(d2=6)  # f1: keys (document), f2: queries (question)

    def loop():
        rows = []
        for b in range(2):
            K, Q = list(f1[b]), list(f2[b])
            E = [[q @ k for k in K] for q in Q]
            M1 = [softmax(row) for row in E]  # each query over keys
            cols = [softmax([E[i][j] for i in range(len(Q))]) for j in range(len(K))]
            a_q = [sum(cols[j][i] for j in range(len(K))) / len(K) for i in range(len(Q))]
            a_k = [sum(M1[i][j] * a_q[i] for i in range(len(Q))) for j in range(len(K))]
            rows.append(torch.cat([weighted(a_k, K), weighted(a_q, Q)]))
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: NestedCoAttention()(f1, f2).concat(), loop, [f1, f2], atol=1e-12, rtol=1e-12
    )


MODULES = {
    "alternating": lambda: AlternatingCoAttention(6, 3, 7),
    "interactive": lambda: InteractiveCoAttention(6, 3, 7),
    "parallel-additive": lambda: ParallelCoAttention(6, 3, d_w=5),
    "parallel-max": lambda: ParallelCoAttention(6, 3, score="max"),
    "parallel-concat": lambda: ParallelCoAttention(6, 6, affinity="concat"),
    "parallel-general-linear": lambda: ParallelCoAttention(
        6, 3, affinity=ak.scores.General(6, 3), score=LinearAggregation(6, 3)
    ),
    "parallel-additive-nested-mlp": lambda: ParallelCoAttention(
        6, 3, affinity=ak.scores.Additive(6, 3, 4), score=NestedPerceptronAggregation(6, 3, 5)
    ),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_masks_equal_truncation_and_batch_equals_items(name):
    torch.manual_seed(0)
    m = MODULES[name]().double()
    d2 = 6 if name == "parallel-concat" else 3
    f1, f2 = _inputs(d2=d2)
    m1 = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    m2 = torch.tensor([[True] * 2 + [False] * 2, [True] * 4])
    out = m(f1, f2, m1, m2)
    for b in range(2):
        n1, n2 = int(m1[b].sum()), int(m2[b].sum())
        alone = m(f1[b : b + 1, :n1], f2[b : b + 1, :n2])
        torch.testing.assert_close(out.concat()[b : b + 1], alone.concat())
        torch.testing.assert_close(out.weights1[b, :n1], alone.weights1[0])
        assert (out.weights1[b, n1:] == 0).all() and (out.weights2[b, n2:] == 0).all()


def test_nested_masks_equal_truncation():
    f1, f2 = _inputs(d2=6)
    m1 = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    m2 = torch.tensor([[True] * 2 + [False] * 2, [True] * 4])
    out = NestedCoAttention()(f1, f2, m1, m2)
    for b in range(2):
        n1, n2 = int(m1[b].sum()), int(m2[b].sum())
        alone = NestedCoAttention()(f1[b : b + 1, :n1], f2[b : b + 1, :n2])
        torch.testing.assert_close(out.concat()[b : b + 1], alone.concat())


def test_multi_grained_gives_four_contexts():
    torch.manual_seed(0)
    m = MultiGrainedCoAttention(6, 3, 5).double()
    f1, f2 = _inputs()
    outs = m(f1, f2)
    assert m.concat(outs).shape == (2, 6 + 3 + 6 + 3)
    torch.testing.assert_close(m.concat(outs)[:, :9], m.coarse(f1, f2).concat())
    torch.testing.assert_close(m.concat(outs)[:, 9:], m.fine(f1, f2).concat())


@pytest.mark.parametrize("name", list(MODULES))
def test_gradients_reach_every_parameter(name):
    m = MODULES[name]()
    f1 = torch.randn(2, 5, 6)
    f2 = torch.randn(2, 4, 6 if name == "parallel-concat" else 3)
    m(f1, f2).concat().sum().backward()
    for pname, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


def test_bad_arguments():
    with pytest.raises(ValueError, match="d1 == d2"):
        ParallelCoAttention(6, 3, affinity="concat")
    with pytest.raises(ValueError, match="affinity"):
        ParallelCoAttention(6, 3, affinity="dot")
    with pytest.raises(ValueError, match="score"):
        ParallelCoAttention(6, 3, score="mean")


@pytest.mark.parametrize("name", [*MODULES, "nested"])
def test_contract_simplex_and_permutations(name):
    """Weights lie on the simplex; permuting either input's features permutes its weights and
    leaves both context vectors unchanged (content-based mechanisms, SPEC 8)."""
    torch.manual_seed(0)
    m = NestedCoAttention() if name == "nested" else MODULES[name]().double()
    d2 = 6 if name in ("parallel-concat", "nested") else 3
    f1, f2 = _inputs(d2=d2)
    out = m(f1, f2)
    for w in (out.weights1, out.weights2):
        assert (w >= 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(2, dtype=w.dtype))
    p1, p2 = torch.randperm(5), torch.randperm(4)
    permuted = m(f1[:, p1], f2[:, p2])
    torch.testing.assert_close(permuted.concat(), out.concat())
    torch.testing.assert_close(permuted.weights1, out.weights1[:, p1])
    torch.testing.assert_close(permuted.weights2, out.weights2[:, p2])


CO_ALL = {**MODULES, "nested": NestedCoAttention, "multi-grained": lambda: MultiGrained()}


class MultiGrained(MultiGrainedCoAttention):
    """The multi-grained output as one tensor, for the batch test."""

    def __init__(self):
        super().__init__(6, 3, 5)

    def forward(self, *args):
        return self.concat(super().forward(*args))


def _concat(out):
    return out if isinstance(out, torch.Tensor) else out.concat()


@pytest.mark.parametrize("name", list(CO_ALL))
def test_batch_equals_items_with_masks_from_lengths(name):
    """Issue 8.9: (B, 1, n) masks from ak.masks.from_lengths must not mix the batch (B = 3)."""
    torch.manual_seed(0)
    m = CO_ALL[name]().double()
    d2 = 6 if name in ("parallel-concat", "nested") else 3
    f1, f2 = rand(3, 5, 6, seed=1, grad=False), rand(3, 4, d2, seed=2, grad=False)
    assert_batch_equals_items(
        lambda xs, ms: _concat(m(xs[0], xs[1], ms[0], ms[1])),
        [f1, f2],
        [[5, 3, 1], [2, 4, 3]],
    )


@pytest.mark.parametrize("name", list(CO_ALL))
def test_two_and_three_dim_masks_agree(name):
    torch.manual_seed(0)
    m = CO_ALL[name]().double()
    d2 = 6 if name in ("parallel-concat", "nested") else 3
    f1, f2 = rand(3, 5, 6, seed=1, grad=False), rand(3, 4, d2, seed=2, grad=False)
    m1 = ak.masks.from_lengths(torch.tensor([5, 3, 1]), 5)
    m2 = ak.masks.from_lengths(torch.tensor([2, 4, 3]), 4)
    torch.testing.assert_close(
        _concat(m(f1, f2, m1, m2)), _concat(m(f1, f2, m1.squeeze(1), m2.squeeze(1)))
    )


@pytest.mark.parametrize("name", list(CO_ALL))
@pytest.mark.parametrize(
    ("mask", "error", "match"),
    [
        (torch.ones(5, dtype=torch.bool), ValueError, r"mask1 of shape \(5,\) does not fit f1"),
        (torch.ones(1, 5, dtype=torch.bool), ValueError, r"mask1 of shape \(1, 5\).*\(3, 5\)"),
        (torch.ones(3, 3, 5, dtype=torch.bool), ValueError, r"mask1 of shape \(3, 3, 5\)"),
        (torch.ones(3, 6, dtype=torch.bool), ValueError, r"expected \(3, 5\) or \(3, 1, 5\)"),
        (torch.ones(3, 5), TypeError, r"mask1 must be boolean.*float32"),
    ],
)
def test_masks_that_do_not_fit_are_refused(name, mask, error, match):
    m = CO_ALL[name]()
    d2 = 6 if name in ("parallel-concat", "nested") else 3
    with pytest.raises(error, match=match):
        m(torch.randn(3, 5, 6), torch.randn(3, 4, d2), mask)


@pytest.mark.parametrize("name", list(CO_ALL))
def test_bad_inputs_are_named(name):
    m = CO_ALL[name]()
    d2 = 6 if name in ("parallel-concat", "nested") else 3
    with pytest.raises(ValueError, match=r"f2 has batch size 2 .* f1 has 3"):
        m(torch.randn(3, 5, 6), torch.randn(2, 4, d2))
    with pytest.raises(ValueError, match=r"f1 must be \(B, n, d\), got shape \(5, 6\)"):
        m(torch.randn(5, 6), torch.randn(3, 4, d2))
    with pytest.raises(TypeError, match=r"f2 has dtype torch.float64 but f1 has torch.float32"):
        m(torch.randn(3, 5, 6), torch.randn(3, 4, d2, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"f1 must be a floating-point tensor"):
        m(torch.ones(3, 5, 6, dtype=torch.long), torch.randn(3, 4, d2))
    if name != "nested":
        with pytest.raises(ValueError, match=r"f1 has 7 features .* d1 = 6"):
            m(torch.randn(3, 5, 7), torch.randn(3, 4, d2))
