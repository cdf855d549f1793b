"""Sliding-window attention by blocks of queries against softmax attention with the window's
dense (N × N) mask (attnkit.patterns.sliding_window), float64, forward and gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward

import attnkit as ak
from attnkit import patterns as pt
from attnkit.efficient.sliding_window import sliding_window_attention

D = torch.float64


def _inputs(n, d=5, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, e, generator=g, dtype=D, requires_grad=True)
            for e in (d, d, dv)]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n, size",
    [(50, 7), (40, 16), (37, 16), (300, 128), (300, 40), (9, 0), (12, 30)],
)
def test_equals_attention_with_the_dense_window_mask(n, size, causal):
    q, k, v = _inputs(n, seed=n + size)
    mask = pt.dense(pt.sliding_window(size, causal=causal), n, n)
    assert_same_forward_backward(
        lambda: sliding_window_attention(q, k, v, size, causal=causal),
        lambda: ak.attention(q, k, v, mask=mask).context,
        [q, k, v],
    )


def test_key_padding_and_queries_without_keys():
    q, k, v = _inputs(33)
    g = torch.Generator().manual_seed(1)
    keys = torch.rand(2, 1, 33, generator=g) > 0.4
    keys[0, 0, :12] = False  # query 0 of item 0 has no key within its window of 4
    mask = pt.dense(pt.sliding_window(4), 33, 33) & keys[..., None, :]
    out = sliding_window_attention(q, k, v, 4, key_mask=keys)
    assert (out[0, :, 0] == 0).all()
    assert_same_forward_backward(
        lambda: sliding_window_attention(q, k, v, 4, key_mask=keys),
        lambda: ak.attention(q, k, v, mask=mask).context,
        [q, k, v],
    )


def test_bad_arguments_are_refused_and_one_derivative_only():
    q, k, v = _inputs(8)
    with pytest.raises(ValueError, match="size"):
        sliding_window_attention(q, k, v, -1)
    with pytest.raises(ValueError, match="one length N"):
        sliding_window_attention(q, k[..., :7, :], v[..., :7, :], 2)
    with pytest.raises(TypeError, match="key_mask"):
        sliding_window_attention(q, k, v, 2, key_mask=torch.ones(8))
    with pytest.raises(ValueError, match="key_mask"):
        sliding_window_attention(q, k, v, 2, key_mask=torch.ones(5, dtype=torch.bool))
    out = sliding_window_attention(q, k, v, 2)
    (grad,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(grad.sum(), q)


def test_scale_sets_the_scores_factor():
    q, k, v = _inputs(40, seed=7)
    allowed = pt.dense(pt.sliding_window(6), 40, 40)

    def reference():
        e = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
        return torch.softmax(e, -1) @ v

    assert_same_forward_backward(
        lambda: sliding_window_attention(q, k, v, 6, scale=0.3), reference, [q, k, v]
    )
    with pytest.raises(ValueError, match="scale must be finite"):
        sliding_window_attention(q, k, v, 6, scale=float("inf"))
    with pytest.raises(TypeError, match="scale must be a real number"):
        sliding_window_attention(q, k, v, 6, scale="0.3")


@pytest.mark.parametrize("causal", [False, True])
def test_groups_of_query_blocks_give_the_same_forward_and_backward(causal, monkeypatch):
    """Evaluated one query block at a time (a group each), with a ragged last block and key
    padding, forward and gradients equal the dense masked reference."""
    from attnkit.efficient import sliding_window as sw

    monkeypatch.setattr(sw, "_TILE_ELEMENTS", 1)  # one block per group
    n, size = 83, 16  # blocks of 16 rows, the last one 3 rows
    q, k, v = _inputs(n, seed=5)
    keys = torch.rand(2, 1, n, generator=torch.Generator().manual_seed(2)) > 0.3
    mask = pt.dense(pt.sliding_window(size, causal=causal), n, n) & keys[..., None, :]
    assert len(sw._Groups(q.detach().reshape(-1, n, 5), size, causal, None).ranges()) == 6
    assert_same_forward_backward(
        lambda: sliding_window_attention(q, k, v, size, causal=causal, key_mask=keys),
        lambda: ak.attention(q, k, v, mask=mask).context,
        [q, k, v],
    )
