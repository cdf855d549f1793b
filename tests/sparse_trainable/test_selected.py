"""Attention over each query's selected keys on key-block tiles and through the fused kernel
with a selection mask against the per-query gather
(gathered_softmax, itself checked against a loop in test_gathered.py) and, through DSA, against
the loop from the V3.2 equations in test_dsa.py: float64, forward, weights and gradients."""

from __future__ import annotations

import pytest
import torch

from attnkit.sparse_trainable import _selected
from attnkit.sparse_trainable._gathered import gathered_softmax
from attnkit.sparse_trainable._select import top_indices
from attnkit.sparse_trainable._selected import selected_softmax

D = torch.float64


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("pairs, block, tile, q_offset", [(5, 3, 2, 0), (1 << 14, 4, 32, 6)])
def test_selected_softmax_matches_the_gather(monkeypatch, pairs, block, tile, q_offset, fused):
    """The key-block tiles (any device) and the fused kernel with a selection mask (CPU;
    ``MASK`` small: several chunks of rows)."""
    monkeypatch.setattr(_selected, "PAIRS", pairs)
    monkeypatch.setattr(_selected, "BLOCK", block)
    monkeypatch.setattr(_selected, "TILE", tile)
    monkeypatch.setattr(_selected, "MASK", 3 * pairs)
    if not fused:
        monkeypatch.setattr(_selected, "fused_applies", lambda q, v: False)
    g = torch.Generator().manual_seed(pairs)
    count, m, d, t = 3, 9, 4, 5
    n = m + q_offset
    q, k, v = (torch.randn(count, x, d, generator=g, dtype=D) for x in (m, n, n))
    pos = torch.arange(m) + q_offset
    score = torch.rand(count, m, n, generator=g, dtype=D)
    allowed = (torch.arange(n) <= pos[:, None]) & (torch.rand(count, m, n, generator=g) < 0.8)
    keys, ok = top_indices(score.masked_fill(~allowed, float("-inf")), t)
    ok = ok & torch.gather(allowed, -1, keys)
    ok[1, 2] = False  # a row without a key
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, w = selected_softmax(q, k, v, keys, ok, q_offset, 0.6, want_weights=True)
    ref, ref_w = gathered_softmax(q, k, v, keys, ok, 0.6)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w, ref_w.detach(), atol=1e-12, rtol=1e-10)
    assert not out[1, 2].any()
    r = torch.randn(out.shape, generator=g, dtype=D)
    got = torch.autograd.grad((out * r).sum(), (q, k, v))
    want = torch.autograd.grad((ref * r).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_values_of_another_size_than_the_keys():
    """d_v ≠ d: the fused kernel takes only d_v = d, so the tiles serve the call (it crashed
    on the CPU before); equal to the gather, forward and backward."""
    g = torch.Generator().manual_seed(4)
    count, m, d, d_v, t = 2, 7, 4, 3, 3
    q, k = (torch.randn(count, m, d, generator=g, dtype=D) for _ in range(2))
    v = torch.randn(count, m, d_v, generator=g, dtype=D)
    allowed = torch.arange(m) <= torch.arange(m)[:, None]
    score = torch.rand(count, m, m, generator=g, dtype=D)
    keys, ok = top_indices(score.masked_fill(~allowed, float("-inf")), t)
    ok = ok & torch.gather(allowed.expand(count, m, m), -1, keys)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, _ = selected_softmax(q, k, v, keys, ok, 0, 0.5)
    ref, _ = gathered_softmax(q, k, v, keys, ok, 0.5)
    assert out.shape == (count, m, d_v)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    r = torch.randn(out.shape, generator=g, dtype=D)
    got = torch.autograd.grad((out * r).sum(), (q, k, v))
    want = torch.autograd.grad((ref * r).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
