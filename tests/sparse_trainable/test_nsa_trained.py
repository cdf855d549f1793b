"""NSA's fused path under autograd with the gates and the block compression inside its autograd
function, against the branch-by-branch evaluation (``NativeSparseAttention.branches``, itself
checked against a loop from the paper's equations in test_nsa.py) in float64: the output and the
gradients of q, k, v and of every parameter (φ's position embedding, weight and bias for keys
and values, the gates' weight and bias)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward

from attnkit.sparse_trainable import (
    MeanCompression,
    NativeSparseAttention,
    _nsa_blocks,
    _nsa_trained,
)

D = torch.float64

SMALL = dict(compress_block=4, compress_stride=2, select_block=4, num_selected=5, window=12)
CASES = [
    # sizes, group, q_offset, m (N = q_offset + m a multiple of s)
    (SMALL, 1, 0, 40),
    (SMALL, 2, 8, 38),  # queries after a prefix, a selection group
    (dict(SMALL, window=5), 1, 0, 42),  # a partial last selection block
    (dict(compress_block=8, compress_stride=4, select_block=8, num_selected=4, window=20),
     1, 0, 76),  # s = 4, two runs of s per block
    (dict(compress_block=6, compress_stride=2, select_block=8, num_selected=4, window=16),
     1, 0, 64),  # three runs of s per block
]  # fmt: skip


@pytest.mark.parametrize("sizes, group, q_offset, m", CASES)
def test_fused_training_matches_the_branches(monkeypatch, sizes, group, q_offset, m):
    monkeypatch.setattr(_nsa_blocks, "TILE", 3)
    monkeypatch.setattr(_nsa_blocks, "BATCH", 12)
    monkeypatch.setattr(_nsa_blocks, "SPAN", 16)
    torch.manual_seed(5)
    module = NativeSparseAttention(4, **sizes, group_size=group).double()
    with torch.no_grad():  # parameters away from their start, so that every term counts
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    n = q_offset + m
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 2 * group, length, 4, generator=g, dtype=D).requires_grad_()
        for length in (m, n, n)
    )
    sz = module._sizes()
    assert _nsa_blocks.applies(q, n, q_offset, None, sz)
    assert _nsa_trained.fuses(module.compress_key, module.compress_value, module.gate, n, sz)
    out = module(q, k, v, q_offset=q_offset).context
    assert "NSATrained" in type(out.grad_fn.next_functions[0][0]).__name__  # under the view
    ref = module.branches(q, k, v, q_offset=q_offset).context
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    leaves = [q, k, v, *module.parameters()]
    assert_same_forward_backward(lambda: out, lambda: ref, leaves, atol=1e-12, rtol=1e-10)


def test_other_compressions_keep_autograd():
    """A compression that is not the module's own block compression, a stride that does not
    divide N: not fused (the compressed keys go through autograd as before)."""
    module = NativeSparseAttention(4, **SMALL)
    sz = module._sizes()
    assert _nsa_trained.fuses(module.compress_key, module.compress_value, module.gate, 40, sz)
    assert not _nsa_trained.fuses(module.compress_key, module.compress_value, module.gate, 41, sz)
    assert not _nsa_trained.fuses(MeanCompression(), module.compress_value, module.gate, 40, sz)
    odd = NativeSparseAttention(4, **dict(SMALL, compress_block=5))
    assert not _nsa_trained.fuses(odd.compress_key, odd.compress_value, odd.gate, 40, sz)
