"""NSA evaluated a chunk of queries at a time (the forward's path) against the branch-by-branch
evaluation (``NativeSparseAttention.branches``, itself checked against a loop from the paper's
equations in test_nsa.py), in float64, forward and gradients of the inputs and parameters, with
many chunks and small tiles; eq. 9's overlap sum against the dense overlap product."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward

from attnkit.sparse_trainable import MeanCompression, NativeSparseAttention, _nsa_chunks
from attnkit.sparse_trainable._nsa_chunks import Sizes, importance

D = torch.float64


def _inputs(b, h, m, n, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, h, length, d, generator=g, dtype=D).requires_grad_() for length in (m, n, n)
    ]


CASES = [
    # sizes, group, q_offset, m, mask ("pad", "rows" varies over queries, None)
    (dict(compress_block=4, compress_stride=2, select_block=4, num_selected=3, window=5),
     1, 0, 23, "pad"),
    (dict(compress_block=4, compress_stride=2, select_block=4, num_selected=3, window=5),
     2, 0, 23, "rows"),
    (dict(compress_block=6, compress_stride=4, select_block=8, num_selected=2, window=9),
     1, 7, 13, None),  # l not a multiple of s: the blocks are unfolded
    (dict(compress_block=4, compress_stride=4, select_block=4, num_selected=4, window=3,
          num_initial=0, num_local=1), 2, 3, 17, "pad"),
]  # fmt: skip


@pytest.mark.parametrize("sizes, group, q_offset, m, mask", CASES)
def test_chunked_forward_matches_the_branches(monkeypatch, sizes, group, q_offset, m, mask):
    monkeypatch.setattr(_nsa_chunks, "PAIRS", 7)  # a few queries per chunk
    monkeypatch.setattr(_nsa_chunks, "TILE", 2)  # several tiles per block
    torch.manual_seed(4)
    module = NativeSparseAttention(4, **sizes, group_size=group).double()
    n = q_offset + m
    q, k, v = _inputs(2, 2, m, n)
    g = torch.Generator().manual_seed(1)
    keep = None
    if mask == "pad":
        keep = (torch.arange(n) < torch.tensor([n, n - 5])[:, None])[:, None, None, :]
    elif mask == "rows":
        keep = torch.rand(2, 2, m, n, generator=g) < 0.85
    out = module(q, k, v, mask=keep, q_offset=q_offset).context
    ref = module.branches(q, k, v, mask=keep, q_offset=q_offset).context
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    leaves = [q, k, v, *module.parameters()]
    assert_same_forward_backward(lambda: out, lambda: ref, leaves, atol=1e-12, rtol=1e-10)


def test_mean_compression_and_a_temperature(monkeypatch):
    import attnkit as ak

    monkeypatch.setattr(_nsa_chunks, "PAIRS", 11)
    module = NativeSparseAttention(
        4, compress_block=4, compress_stride=2, select_block=4, num_selected=2, window=6,
        compress_key=MeanCompression(), compress_value=MeanCompression(),
    ).double()  # fmt: skip
    module.align = ak.alignments.Softmax(temperature=0.5)
    q, k, v = _inputs(1, 2, 19, 19, seed=2)
    out = module(q, k, v).context
    ref = module.branches(q, k, v).context
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize(
    "l, s, lb, n",
    [(32, 16, 64, 1000), (4, 2, 4, 23), (6, 4, 8, 50), (48, 16, 64, 700), (6, 2, 4, 31),
     (4, 4, 4, 30), (6, 4, 6, 40), (12, 2, 4, 33)],
)  # fmt: skip
def test_importance_is_the_overlap_sum(l, s, lb, n):
    """Eq. 9 (as NSA's docstring reads it): block j gathers the weights of the compressed
    blocks that share a key with it, against the dense product with the overlap matrix."""
    c = (n - l) // s + 1
    sz = Sizes(l, s, lb, 1, 1, 0, 0, 1)
    p = torch.rand(3, 5, c, dtype=D)
    starts = torch.arange(c) * s
    j = torch.arange(-(-n // lb))
    overlap = (starts[:, None] <= (j + 1) * lb - 1) & (starts[:, None] + l - 1 >= j * lb)
    torch.testing.assert_close(importance(p, n, sz), p @ overlap.to(D))
    visible = c // 2  # a chunk that has seen only the first blocks
    want = p[..., :visible] @ overlap[:visible].to(D)
    torch.testing.assert_close(importance(p[..., :visible], n, sz), want)
