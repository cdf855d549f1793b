"""Adaptive attention span (Sukhbaatar et al. 2019): the soft mask is the paper's eq. 4, the
weights are eq. 5, and a learned span shrinks when only local context is needed and stays wide
when it is not."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.efficient import AdaptiveSpanAttention
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
    with pytest.raises(ValueError, match=r"n_heads=2\) needs q"):
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
    assert (built.n_heads, built.max_span) == (4, 33)


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
