"""Coverage attention against a loop from See et al. (2017) eqs. 10-12, and the doubly
stochastic penalty of Xu et al. (2015) eq. 14."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.memory import CoverageAttention, coverage_loss, doubly_stochastic_penalty


def _reference(model, queries, keys, values, lengths):
    """e_i^t = vᵀ tanh(W_h h_i + W_s s_t + w_c c_i^t + b), a^t = softmax(e^t), c^{t+1} = c^t + a^t,
    loss = Σ_t Σ_i min(a_i^t, c_i^t); one item, one step, one key at a time."""
    wh, ws, b = model.W_h.weight, model.W_s.weight, model.W_s.bias
    wc, v = model.w_c, model.v.weight[0]
    out_ctx, out_w, out_loss = [], [], []
    for bi in range(queries.shape[0]):
        n = lengths[bi]
        c = [0.0] * n
        ctx, ws_all, loss = [], [], 0.0
        for t in range(queries.shape[1]):
            e = []
            for i in range(n):
                hidden = wh @ keys[bi, i] + ws @ queries[bi, t] + wc * c[i] + b
                e.append(float(v @ torch.tanh(hidden)))
            z = sum(math.exp(x - max(e)) for x in e)
            a = [math.exp(x - max(e)) / z for x in e]
            loss += sum(min(ai, ci) for ai, ci in zip(a, c, strict=True))
            ctx.append(sum(a[i] * values[bi, i] for i in range(n)))
            ws_all.append(a + [0.0] * (keys.shape[1] - n))
            c = [ci + ai for ci, ai in zip(c, a, strict=True)]
        out_ctx.append(torch.stack(ctx))
        out_w.append(torch.tensor(ws_all, dtype=torch.float64))
        out_loss.append(loss)
    return torch.stack(out_ctx), torch.stack(out_w), torch.tensor(out_loss, dtype=torch.float64)


def test_matches_the_paper_loop():
    torch.manual_seed(0)
    model = CoverageAttention(3, 4, 5).double()
    queries, keys = torch.randn(2, 4, 3).double(), torch.randn(2, 5, 4).double()
    values = torch.randn(2, 5, 2).double()
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    out = model(queries, keys, values, mask=mask)
    with torch.no_grad():
        ctx, w, loss = _reference(model, queries, keys, values, [5, 3])
    torch.testing.assert_close(out.contexts, ctx)
    torch.testing.assert_close(out.weights, w)
    torch.testing.assert_close(out.loss, loss)
    # the coverage before each step is the sum of the earlier weights
    torch.testing.assert_close(out.coverage[:, 1:], out.weights.cumsum(1)[:, :-1])
    assert (out.coverage[:, 0] == 0).all()


def test_coverage_steers_attention_away_from_covered_keys():
    """Same query at every step: without the coverage feature the attention repeats itself;
    a negative w_c moves it to keys not yet covered and lowers the coverage loss."""
    torch.manual_seed(0)
    model = CoverageAttention(3, 4, 6).double()
    queries = torch.randn(1, 1, 3).double().expand(1, 4, 3)
    keys = torch.randn(1, 4, 4).double()
    with torch.no_grad():
        model.w_c.zero_()
        plain = model(queries, keys)
        model.v.weight.copy_(model.v.weight.sign())
        model.w_c.copy_(-20 * model.v.weight[0].sign())  # vᵀ tanh(… − 20 c) falls with c
        steered = model(queries, keys)
    assert (plain.weights == plain.weights[:, :1]).all()  # no coverage: the same every step
    assert steered.loss < plain.loss
    assert len(set(steered.weights[0].argmax(-1).tolist())) > 1


def test_coverage_loss_and_doubly_stochastic_penalty_formulas():
    w = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]]])
    c = torch.tensor([[[0.0, 0.0, 0.0], [0.5, 0.5, 0.0]]])
    assert coverage_loss(w, c).item() == pytest.approx(0.4)  # min(.2,.5)+min(.2,.5)+min(.6,0)
    # Σ_i (1 − Σ_t α_ti)²: totals 0.7, 0.7, 0.6
    assert doubly_stochastic_penalty(w).item() == pytest.approx(0.09 + 0.09 + 0.16)
    mask = torch.tensor([[True, True, False]])
    assert doubly_stochastic_penalty(w, mask).item() == pytest.approx(0.18)
    with pytest.raises(ValueError, match=r"weights must be \(B, T, n\)"):
        doubly_stochastic_penalty(w[0])


def test_errors_name_the_argument():
    model = CoverageAttention(3, 4, 5)
    with pytest.raises(ValueError, match=r"queries has 2 features.*d_q = 3"):
        model(torch.randn(1, 2, 2), torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="values has 4 rows"):
        model(torch.randn(1, 2, 3), torch.randn(1, 5, 4), torch.randn(1, 4, 2))


def _w(*shape):
    return torch.rand(*shape).softmax(-1)


BAD_CALLS = [
    (
        "coverage of another width",
        lambda: coverage_loss(_w(2, 3, 5), _w(2, 3, 4)),
        ValueError,
        r"coverage has shape \(2, 3, 4\) but weights has \(2, 3, 5\)",
    ),
    (
        "coverage broadcasting over the batch",
        lambda: coverage_loss(_w(2, 3, 5), _w(1, 3, 5)),
        ValueError,
        r"coverage has shape \(1, 3, 5\) but weights has \(2, 3, 5\)",
    ),
    (
        "weights of rank 2",
        lambda: coverage_loss(_w(3, 5), _w(3, 5)),
        ValueError,
        r"weights must be \(B, T, n\), got shape \(3, 5\)",
    ),
    (
        "integer coverage",
        lambda: coverage_loss(_w(2, 3, 5), torch.zeros(2, 3, 5, dtype=torch.long)),
        TypeError,
        r"coverage must be a floating-point tensor \(B, T, n\)",
    ),
    (
        "penalty: mask of another width",
        lambda: doubly_stochastic_penalty(_w(2, 3, 5), torch.ones(2, 4, dtype=torch.bool)),
        ValueError,
        r"mask must be \(2, 5\) or \(2, 1, 5\).*got shape \(2, 4\)",
    ),
    (
        "penalty: float mask",
        lambda: doubly_stochastic_penalty(_w(2, 3, 5), torch.full((2, 5), 0.5)),
        TypeError,
        r"mask must be a boolean tensor \(True = a real location\), got torch.float32",
    ),
    (
        "penalty: weights of rank 2",
        lambda: doubly_stochastic_penalty(_w(3, 5)),
        ValueError,
        r"weights must be \(B, T, n\)",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_coverage_loss_refuses_mixed_dtypes():
    w = torch.rand(1, 2, 3)
    with pytest.raises(TypeError, match=r"coverage has dtype torch.float64 but weights has"):
        coverage_loss(w, w.double())
