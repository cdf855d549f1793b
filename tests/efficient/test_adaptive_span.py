"""Adaptive attention span (Sukhbaatar et al. 2019): the soft mask is the paper's eq. 4, the
weights are eq. 5, and a learned span shrinks when only local context is needed and stays wide
when it is not."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.efficient import AdaptiveSpanAttention, DynamicSpanAttention
from attnkit.efficient.adaptive_span import span_mask
from attnkit.tasks.parts import build_slot_attention

D = torch.float64


def test_the_mask_is_the_formula():
    # R = 4, z = 3: 1 up to distance 3, then (R + z − x)/R down to 0 at distance 7
    x = torch.tensor([0.0, 1, 3, 4, 5, 6, 7, 8, 20])
    got = span_mask(x, torch.tensor(3.0), 4.0)
    expected = torch.tensor([1.0, 1, 1, 0.75, 0.5, 0.25, 0, 0, 0])
    torch.testing.assert_close(got, expected)
    for z in (0.0, 2.5, 10.0):
        for xi in range(15):
            m = min(max((4.0 + z - xi) / 4.0, 0.0), 1.0)
            assert math.isclose(float(span_mask(torch.tensor(float(xi)), torch.tensor(z), 4.0)), m)


def test_weights_are_the_soft_masked_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 4, generator=g, dtype=D) for _ in range(3))
    part = AdaptiveSpanAttention(3, 8, ramp=2.0).to(D)
    with torch.no_grad():
        part.span_fraction.copy_(torch.tensor([0.0, 0.3, 1.0]))
    out = part(q, k, v, need_weights=True)
    for h, z in enumerate((0.0, 2.4, 8.0)):
        for i in range(9):
            m = torch.tensor(
                [min(max((2.0 + z - abs(i - j)) / 2.0, 0.0), 1.0) for j in range(9)], dtype=D
            )
            e = torch.einsum("bd,bjd->bj", q[:, h, i], k[:, h]) / 2.0
            a = m * e.exp() / (m * e.exp()).sum(-1, keepdim=True)
            torch.testing.assert_close(out.weights[:, h, i], a)
    # keys beyond z + R are not attended at all
    assert (
        out.weights[:, 0][(torch.arange(9)[:, None] - torch.arange(9)).abs().expand(2, 9, 9) >= 2]
        == 0
    ).all()


def _train(target, steps=100):
    """One head, scores from learned projections, causal; the target at t is a mean of the
    inputs either over the last 3 steps (local) or over the whole past (wide)."""
    torch.manual_seed(0)
    n = 24
    part = AdaptiveSpanAttention(1, n, ramp=2.0, init=0.5)
    proj = torch.nn.Linear(1, 8)
    opt = torch.optim.Adam([*part.parameters(), *proj.parameters()], lr=0.03)
    causal = ak.masks.causal(n)
    for _ in range(steps):
        x = torch.randn(16, n, 1)
        y = target(x)
        h = proj(x)[:, None]  # (B, H=1, N, 8)
        out = part(h, h, x[:, None], mask=causal).context[:, 0]
        loss = (out - y).square().mean() + 1e-3 * part.span_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(part.spans[0].detach())


def _local(x):
    padded = torch.nn.functional.pad(x, (0, 0, 2, 0))
    return (padded[:, 2:] + padded[:, 1:-1] + padded[:, :-2]) / torch.tensor(
        [1.0, 2.0] + [3.0] * (x.shape[1] - 2)
    )[:, None]


def _wide(x):
    return x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]


def test_span_shrinks_for_local_context_and_stays_wide_otherwise():
    local, wide = _train(_local), _train(_wide)
    # both start at 12 (half of 24): the local one shrinks to about the 3 steps it needs, the
    # wide one does not shrink (it grows towards the whole past)
    assert local < 5.0, local
    assert wide > 14.0, wide


def test_in_multi_head_attention_and_errors():
    part = AdaptiveSpanAttention(2, 6)
    mha = ak.MultiHeadAttention(8, 2, attention=part)
    assert mha(torch.randn(2, 7, 8), need_weights=True).weights.shape == (2, 2, 7, 7)
    with pytest.raises(ValueError, match=r"num_heads=2\) needs q"):
        part(*(torch.randn(2, 3, 5, 4) for _ in range(3)))
    with pytest.raises(ValueError, match="ramp must be > 0"):
        AdaptiveSpanAttention(2, 6, ramp=0.0)
    with pytest.raises(ValueError, match="init"):
        AdaptiveSpanAttention(2, 6, init=1.5)
    with pytest.raises(ValueError, match="span_penalty must be >= 0"):
        AdaptiveSpanAttention(2, 6, span_penalty=-1.0)


def test_auxiliary_loss_is_the_weighted_sum_of_spans_and_joins_the_slot_from_a_run():
    part = AdaptiveSpanAttention(3, 40, span_penalty=0.5)
    with torch.no_grad():
        part.span_fraction.copy_(torch.tensor([0.25, 1.5, -0.2]))  # clamped to [0, 1]
    assert part.auxiliary_loss().item() == pytest.approx(0.5 * (10.0 + 40.0 + 0.0))
    assert AdaptiveSpanAttention(2, 8).span_penalty == 2e-6  # the paper's lambda
    # attnkit run fills S from the task's longest input
    built = build_slot_attention("adaptive_span", head_dim=8, num_heads=4, max_len=33)
    assert (built.num_heads, built.max_span) == (4, 33)


def test_step_by_step_decoding_with_a_kv_cache_equals_the_causal_sequence():
    torch.manual_seed(0)
    part = AdaptiveSpanAttention(2, 4, init=0.3)
    mha = ak.MultiHeadAttention(8, 2, attention=part).double().eval()
    x = torch.randn(2, 9, 8, dtype=D)
    whole = mha(x, x, x, mask=ak.masks.causal(9)).context
    cache = ak.kv_cache.LayerCache()
    steps = [
        mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache).context
        for t in range(9)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), whole)
    # the span matters here: without the queries' positions the steps would differ
    assert not torch.allclose(steps[-1], mha(x[:, -1:], x, x).context)


def _span_loop(q, k, v, z, ramp, q_offset=0, mask=None, bias=None):
    """Eq. 4–5 by loops: query i (at position i + q_offset) with span z[..., i] weighs key j by
    m_z(|i − j|) exp(e_ij) over the keys it may attend."""
    b, h, m, d = q.shape
    n = k.shape[-2]
    out = torch.zeros(b, h, m, v.shape[-1], dtype=q.dtype)
    weights = torch.zeros(b, h, m, n, dtype=q.dtype)
    for bi in range(b):
        for hi in range(h):
            for i in range(m):
                num = []
                for j in range(n):
                    x = abs(i + q_offset - j)
                    soft = ((ramp + z[bi, hi, i] - x) / ramp).clamp(0.0, 1.0)
                    ok = bool(soft > 0) and (mask is None or bool(mask[bi, hi, i, j]))
                    e = q[bi, hi, i] @ k[bi, hi, j] / math.sqrt(d)
                    if bias is not None:
                        e = e + bias[bi, hi, i, j]
                    num.append(soft * e.exp() if ok else torch.zeros((), dtype=q.dtype))
                total = sum(num)
                if float(total.detach()) == 0:
                    continue
                for j in range(n):
                    weights[bi, hi, i, j] = num[j] / total
                    out[bi, hi, i] += num[j] / total * v[bi, hi, j]
    return out, weights


def test_dynamic_span_is_eq_4_and_5_with_the_span_from_the_query_forward_and_gradients():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 9, 4, generator=g, dtype=D) for _ in range(3))
    mask = torch.rand(2, 2, 9, 9, generator=g) > 0.2
    bias = torch.randn(2, 2, 9, 9, generator=g, dtype=D)
    part = DynamicSpanAttention(2, 4, 6, ramp=1.5, block=2).to(D)
    with torch.no_grad():
        part.span_weight.copy_(torch.randn(2, 4, generator=g, dtype=D))
    out = part(q, k, v, mask=mask, bias=bias, need_weights=True, q_offset=1)
    # z_t = S·σ(v_hᵀ q_t + b_h), eq. of the paper's dynamic span
    z = torch.zeros(2, 2, 9, dtype=D)
    for b in range(2):
        for h in range(2):
            for t in range(9):
                z[b, h, t] = 6 * torch.sigmoid(part.span_weight[h] @ q[b, h, t] + part.span_bias[h])
    torch.testing.assert_close(part.spans(q), z)
    ref, ref_w = _span_loop(q, k, v, z, 1.5, 1, mask, bias)
    torch.testing.assert_close(out.context, ref)
    torch.testing.assert_close(out.weights, ref_w)
    # gradients of the span parameters (through m_z) and of the inputs match the loop's
    params = [part.span_weight, part.span_bias]
    r = torch.randn(ref.shape, generator=g, dtype=D)
    fast = torch.autograd.grad((out.context * r).sum(), params)
    zs = 6 * torch.sigmoid(torch.einsum("bhtd,hd->bht", q, params[0]) + params[1][:, None])
    slow_out, _ = _span_loop(q, k, v, zs, 1.5, 1, mask, bias)
    slow = torch.autograd.grad((slow_out * r).sum(), params)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("block", [1, 3, 64])
def test_the_band_evaluation_equals_the_loop_for_every_block_size(block):
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 5, 4, generator=g, dtype=D)
    k, v = (torch.randn(2, 3, 17, 4, generator=g, dtype=D) for _ in range(2))
    part = AdaptiveSpanAttention(3, 16, ramp=2.0, block=block).to(D)
    with torch.no_grad():
        part.span_fraction.copy_(torch.tensor([0.0, 0.2, 0.6]))
    out = part(q, k, v, need_weights=True, q_offset=12)  # the last 5 of 17 positions
    z = (16 * torch.tensor([0.0, 0.2, 0.6], dtype=D))[:, None].expand(2, 3, 5)
    ref, ref_w = _span_loop(q, k, v, z, 2.0, 12)
    torch.testing.assert_close(out.context, ref)
    torch.testing.assert_close(out.weights, ref_w)


def test_the_band_holds_only_the_keys_within_the_span():
    # the keys gathered per query block are block + 2⌈max z + R⌉, whatever N: cost follows z
    seen = {}

    def spy(t, dim, index):
        seen.setdefault("widths", []).append(index.numel())
        return original(t, dim, index)

    original = torch.Tensor.index_select
    part = AdaptiveSpanAttention(1, 8, ramp=2.0, init=0.5, block=4)
    for n in (64, 256):
        seen.clear()
        x = torch.randn(1, 1, n, 4)
        torch.Tensor.index_select = lambda t, dim, index: spy(t, dim, index)
        try:
            part(x, x, x)
        finally:
            torch.Tensor.index_select = original
        # z = 4, R = 2: reach 6, 16 blocks of 4 queries per 64, each with 4 + 12 keys
        assert seen["widths"] == [n // 4 * 16] * 2


def _mode_task(part, steps=150):
    """Half the sequences need only the current step (target x_t), the others the mean of the
    whole past; a mode bit in every token says which. A dynamic span learns to read the bit."""
    torch.manual_seed(0)
    n = 16
    proj = torch.nn.Linear(2, 8)
    opt = torch.optim.Adam([*part.parameters(), *proj.parameters()], lr=0.03)
    causal = ak.masks.causal(n)
    g = torch.Generator().manual_seed(5)

    def batch(size):
        x = torch.randn(size, n, 1, generator=g)
        local = torch.rand(size, 1, 1, generator=g) < 0.5
        y = torch.where(local, x, x.cumsum(1) / torch.arange(1, n + 1)[:, None])
        return torch.cat([x, local.expand(size, n, 1).float()], -1), x, y, local

    for _ in range(steps):
        inp, x, y, _ = batch(32)
        h = proj(inp)[:, None]
        out = part(h, h, x[:, None], mask=causal)
        loss = (out.context[:, 0] - y).square().mean() + 1e-3 * part.spans(h).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    inp, x, y, local = batch(256)
    with torch.no_grad():
        h = proj(inp)[:, None]
        out = part(h, h, x[:, None], mask=causal)
        spans = part.spans(h)[:, 0].mean(-1)
    error = (out.context[:, 0] - y).square().mean()
    return float(spans[local[:, 0, 0]].mean()), float(spans[~local[:, 0, 0]].mean()), float(error)


def test_dynamic_span_learns_to_follow_the_input():
    local, wide, error = _mode_task(DynamicSpanAttention(1, 8, 16, ramp=2.0))
    # the same head looks back ~nothing for local sequences and far for the others
    assert local < 2.0 and wide > 8.0, (local, wide)
    assert error < 0.1, error
