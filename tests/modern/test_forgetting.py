"""Forgetting attention (FoX, Lin et al. 2025): equal in float64 to a loop over the paper's
equations (weights F_ij exp(q_i·k_j/√d) normalised, F_ij a product of forget gates), forward
and gradients; ordinary causal softmax attention when every gate is 1; key padding (left, right,
holes) equal to truncation; cached decoding equal to the causal pass; and, without any position
scheme, it learns which of two flagged tokens came last, which softmax attention cannot."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit as ak
from attnkit.kv_cache import LayerCache
from attnkit.modern import ForgettingAttention, forgetting_bias

F64 = torch.float64


def _part(h=3, d=4, seed=0):
    torch.manual_seed(seed)
    part = ForgettingAttention(d, h, bias_init=1.0).to(F64)
    with torch.no_grad():
        part.forget_weight.mul_(2)  # gates spread over (0, 1)
        part.forget_bias.normal_(1.0, 0.5)
    return part


def _loop(part, q, k, v, lengths=None):
    """Lin et al. eqs. 3-5 position by position: f_l = σ(w_f · v_l + b_f) per head, and
    o_i = Σ_{j ≤ i} F_ij exp(q_i·k_j/√d) v_j / Σ_{j ≤ i} F_ij exp(q_i·k_j/√d) with
    F_ij = Π_{l=j+1}^{i} f_l, over the first ``lengths[b]`` positions of item b."""
    b_size, heads, n, d = q.shape
    context = torch.zeros_like(v)
    weights = torch.zeros(b_size, heads, n, n, dtype=q.dtype)
    for b in range(b_size):
        length = n if lengths is None else lengths[b]
        for h in range(heads):
            w, bias = part.forget_weight[h], part.forget_bias[h]
            f = [torch.sigmoid(torch.dot(w, v[b, h, t]) + bias) for t in range(length)]
            for i in range(length):
                terms = []
                for j in range(i + 1):
                    decay = torch.ones((), dtype=q.dtype)
                    for t in range(j + 1, i + 1):
                        decay = decay * f[t]
                    terms.append(
                        decay * torch.exp(torch.dot(q[b, h, i], k[b, h, j]) / math.sqrt(d))
                    )
                total = sum(terms)
                for j, term in enumerate(terms):
                    weights[b, h, i, j] = term / total
                    context[b, h, i] = context[b, h, i] + term / total * v[b, h, j]
    return context, weights


def _inputs(seed, b=2, h=3, n=6, d=4):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=F64) for _ in range(3)]


def test_equals_the_loop_from_the_paper_with_gradients():
    part = _part()
    q, k, v = (t.requires_grad_() for t in _inputs(1))
    out = part(q, k, v, need_weights=True)
    loop_part = _part()  # the same parameters, its own autograd graph
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    context, weights = _loop(loop_part, q2, k2, v2)
    torch.testing.assert_close(out.context, context, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out.weights, weights, rtol=1e-12, atol=1e-13)
    probe = torch.randn(context.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    (out.context * probe).sum().backward()
    (context * probe).sum().backward()
    for ours, ref, what in ((q, q2, "q"), (k, k2, "k"), (v, v2, "v")):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-11, atol=1e-12, msg=what)
    for name in ("forget_weight", "forget_bias"):
        torch.testing.assert_close(
            getattr(part, name).grad, getattr(loop_part, name).grad, rtol=1e-11, atol=1e-12
        )


def test_the_bias_is_the_sum_of_log_gates_and_gradcheck():
    g = torch.Generator().manual_seed(3)
    log_f = torch.nn.functional.logsigmoid(torch.randn(2, 5, generator=g, dtype=F64))
    bias = forgetting_bias(log_f, 3)  # the last 3 of 5 positions as queries
    for i in range(3):
        for j in range(5):
            expected = log_f[:, j + 1 : 2 + i + 1].sum(-1) if j <= 2 + i else torch.zeros(2)
            torch.testing.assert_close(bias[:, i, j], expected.to(F64), rtol=1e-13, atol=1e-14)
    part = _part(h=2, d=3, seed=4)
    q, k, v = (t.requires_grad_() for t in _inputs(5, b=1, h=2, n=4, d=3))
    torch.autograd.gradcheck(lambda *x: part(*x).context, (q, k, v))


def test_with_every_gate_one_it_is_causal_softmax_attention():
    part = ForgettingAttention(4, 3, bias_init=60.0).to(F64)  # σ(60) = 1 - 9e-27
    with torch.no_grad():
        part.forget_weight.zero_()
    q, k, v = _inputs(6)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(part(q, k, v).context, expected, rtol=1e-13, atol=1e-14)
    other = _part()  # gates below 1: another result
    assert (other(q, k, v).context - expected).abs().max() > 1e-2


def _layer(seed=0):
    torch.manual_seed(seed)
    mha = ak.MultiHeadAttention(12, 3, attention=ForgettingAttention(4, 3)).to(F64).eval()
    with torch.no_grad():
        mha.attention.forget_weight.mul_(3)
    return mha


@pytest.mark.parametrize(
    "real",
    [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 1, 1]],
    ids=["right", "left", "holes"],
)
def test_padding_equals_truncation(real):
    mha = _layer()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 7, 12, generator=g, dtype=F64)
    x[1][~torch.tensor(real, dtype=torch.bool)] = float("nan")  # padding reaches nothing
    keep = torch.tensor([[1] * 7, real], dtype=torch.bool)
    with torch.no_grad():
        out = mha(x, mask=ak.masks.causal(7) & keep[:, None]).context
        alone = mha(x[1:, keep[1]], mask=ak.masks.causal(int(keep[1].sum()))).context
        first = mha(x[:1], mask=ak.masks.causal(7)).context
    torch.testing.assert_close(out[1, keep[1]], alone[0], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(out[:1], first, rtol=1e-12, atol=1e-13)
    assert (out[1, ~keep[1]] == 0).all()  # a padded position is padding as a query too


def test_cached_decoding_equals_the_causal_pass():
    mha = _layer(seed=8)
    x = torch.randn(2, 7, 12, generator=torch.Generator().manual_seed(9), dtype=F64)
    keep = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)  # left padding
    with torch.no_grad():
        whole = mha(x, mask=ak.masks.causal(7) & keep[:, None]).context
        cache = LayerCache()
        prompt = ak.masks.causal(3) & keep[:, None, :3]
        steps = [mha(x[:, :3], mask=prompt, cache=cache).context]
        for t in range(3, 7):
            steps.append(mha(x[:, t : t + 1], mask=keep[:, None, : t + 1], cache=cache).context)
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-12, atol=1e-13)


N, VOCAB, EMBED = 16, 8, 32


def _recency_batch(size, g):
    """Tokens x_1 … x_N with two flagged positions; the last position (flagged as the query)
    must output the token at the later flag."""
    x = torch.randint(0, VOCAB, (size, N), generator=g)
    pos = torch.rand(size, N - 1, generator=g).topk(2, -1).indices
    flag = torch.zeros(size, N, dtype=torch.long).scatter_(1, pos, 1)
    flag[:, -1] = 2
    return x, flag, x[torch.arange(size), pos.max(-1).values]


def _recency_accuracy(part, steps=100):
    torch.manual_seed(0)
    tok, flag_emb = nn.Embedding(VOCAB, EMBED), nn.Embedding(3, EMBED)
    mha = ak.MultiHeadAttention(EMBED, 2, **({} if part is None else {"attention": part}))
    out = nn.Linear(EMBED, VOCAB)
    params = [*tok.parameters(), *flag_emb.parameters(), *mha.parameters(), *out.parameters()]
    opt = torch.optim.Adam(params, 1e-2)

    def predict(x, flag):
        h = tok(x) + flag_emb(flag)
        return out(mha(h).context[:, -1])

    g = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend
    try:
        for _ in range(steps):
            x, flag, y = _recency_batch(32, g)
            loss = nn.functional.cross_entropy(predict(x, flag), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    x, flag, y = _recency_batch(1000, torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float((predict(x, flag).argmax(-1) == y).float().mean())


def test_learns_which_flag_came_last_where_softmax_attention_cannot():
    """No position scheme: softmax attention sees the two flagged tokens symmetrically (at
    best 1/2 + 1/16 right); the forget gates can decay everything before a flag."""
    assert _recency_accuracy(ForgettingAttention(EMBED // 2, 2)) > 0.95
    assert _recency_accuracy(None) < 0.65


def test_bad_arguments_name_themselves():
    part = ForgettingAttention(4, 3)
    q, k, v = _inputs(10)
    with pytest.raises(ValueError, match=r"v must be \(B, …, 3, N, 4\)"):
        part(q[:, :2], k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match="N >= M"):
        part(q, k[..., :3, :], v[..., :3, :])
    with pytest.raises(ValueError, match="num_heads"):
        ForgettingAttention(4, 0)
    with pytest.raises((TypeError, ValueError), match="bias_init"):
        ForgettingAttention(4, 2, bias_init=float("nan"))


def _dense_reference(part, q, k, v, mask, bias):
    """The dense computation written out: softmax(q kᵀ/√d_k + D + bias) v over the keys that
    ``mask`` (…, M, N) and causality allow, D = c_i − c_j built whole (forgetting_bias), padded
    positions neither decaying nor attending; rows with no key give 0."""
    m, n = q.shape[-2], k.shape[-2]
    real = mask.any(-2)
    log_f = torch.nn.functional.logsigmoid(
        torch.einsum("bhnd,hd->bhn", v, part.forget_weight) + part.forget_bias[:, None]
    )
    log_f = torch.where(real, log_f, torch.zeros((), dtype=log_f.dtype))
    allowed = mask & ak.masks.causal(m, n) & real[..., n - m :, None]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + forgetting_bias(log_f, m) + bias
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1)
    weights = torch.where(allowed.any(-1, keepdim=True), weights, torch.zeros((), dtype=F64))
    return weights @ v, weights


@pytest.mark.parametrize("m", [11, 7])  # a prefill, and the last 7 queries after 4 cached keys
def test_blocks_equal_the_dense_computation_with_large_row_offsets(m):
    """Blocks of 3 rows that do not divide M; a bias with per-row offsets of ±1e4 (softmax is
    blind to them, an unstable sum is not); d_k = 5 queries and keys, d_v = 3 values."""
    torch.manual_seed(11)
    part = ForgettingAttention(3, 2, bias_init=1.0, block_size=3).to(F64)
    with torch.no_grad():
        part.forget_weight.mul_(2)
    g = torch.Generator().manual_seed(12)
    n = 11
    q = torch.randn(2, 2, m, 5, generator=g, dtype=F64).requires_grad_()
    k = torch.randn(2, 2, n, 5, generator=g, dtype=F64).requires_grad_()
    v = torch.randn(2, 2, n, 3, generator=g, dtype=F64).requires_grad_()
    offsets = 1e4 * torch.tensor([1.0, -1.0])[torch.arange(m) % 2].to(F64)[:, None]
    bias = (torch.randn(2, 1, m, n, generator=g, dtype=F64) + offsets).requires_grad_()
    real = torch.ones(2, n, dtype=torch.bool)
    real[1, [0, 5, 6]] = False  # holes, one of them a query
    mask = real[:, None, None, :].expand(2, 2, m, n)
    out = part(q, k, v, mask=mask, bias=bias, need_weights=True)
    ref_part = ForgettingAttention(3, 2, block_size=3).to(F64)
    ref_part.load_state_dict(part.state_dict())
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    context, weights = _dense_reference(ref_part, *leaves[:3], mask, leaves[3])
    torch.testing.assert_close(out.context, context, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.weights, weights, rtol=1e-12, atol=1e-12)
    assert out.weights[..., 0, n - m + 1 :].abs().max() == 0  # causal in the first block too
    probe = torch.randn(context.shape, dtype=F64, generator=torch.Generator().manual_seed(13))
    (out.context * probe).sum().backward()
    (context * probe).sum().backward()
    for ours, ref, what in zip((q, k, v, bias), leaves, "qkvb", strict=True):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-10, atol=1e-10, msg=what)
    for name in ("forget_weight", "forget_bias"):
        ours, ref = getattr(part, name).grad, getattr(ref_part, name).grad
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10, msg=name)
    assert part.forget_weight.grad.abs().max() > 1e-3  # the gates do get a gradient
    # the same part with all rows in one block: the same result
    whole = ForgettingAttention(3, 2, block_size=None).to(F64)
    whole.load_state_dict(part.state_dict())
    torch.testing.assert_close(
        whole(q, k, v, mask=mask, bias=bias).context, out.context, rtol=1e-12, atol=1e-12
    )


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an operation makes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("block", [8, None])
def test_memory_is_a_block_of_rows_not_the_whole_bias(block):
    """No tensor made in the forward pass, and none kept for the backward pass, has the
    (B, H, N, N) size of the dense bias: at most (B, H, block, N) (counted, not timed)."""
    part = ForgettingAttention(4, 2, block_size=block)
    b, h, n, d = 1, 2, 64, 4
    q, k, v = (torch.randn(b, h, n, d) for _ in range(3))
    with torch.no_grad(), _Largest() as made:
        part(q, k, v)
    kept = []

    def pack(t):
        kept.append(t.numel())
        return t

    q.requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = part(q, k, v).context
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().max() > 0
    if block is None:  # the dense computation: the whole bias exists and is kept
        assert made.largest >= b * h * n * n and max(kept) >= b * h * n * n
    else:
        assert made.largest <= b * h * block * n
        assert max(kept) <= b * h * block * n


def test_block_size_is_checked():
    with pytest.raises(ValueError, match="block_size"):
        ForgettingAttention(4, 2, block_size=0)


def test_the_callers_facts_reach_the_blocks_calls():
    """Called by a layer (checked), the blocks' attention calls are not validated again; called
    directly, they are. Without a mask and unstated, a NaN in a later key is looked for and
    reaches only the rows that attend it; stated finite (wrongly here), nothing is looked for."""
    from unittest import mock

    from attnkit import checks
    from attnkit.kernels import prepare

    part = _part()
    q, k, v = _inputs(7)
    k = k.clone()
    k[:, :, 4] = float("nan")  # attended by queries 4 and 5 only
    want, _ = _loop(part, q, k.nan_to_num(), v)
    with (
        mock.patch.object(checks, "validate", wraps=checks.validate) as validated,
        mock.patch.object(prepare, "_all_finite", wraps=prepare._all_finite) as scanned,
    ):
        out = part(q, k, v).context
        assert validated.call_count > 0 and scanned.call_count > 0
        validated.reset_mock()
        scanned.reset_mock()
        checked = part(q, k, v, checked=True).context
        assert validated.call_count == 0 and scanned.call_count > 0
        scanned.reset_mock()
        part(q, k.nan_to_num(), v, checked=True, finite=True)
        assert validated.call_count == 0 and scanned.call_count == 0
    for got in (out, checked):
        torch.testing.assert_close(got[:, :, :4], want[:, :, :4])
        assert not torch.isfinite(got[:, :, 4:]).any()
