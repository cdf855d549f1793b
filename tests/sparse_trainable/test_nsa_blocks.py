"""NSA through the fused kernel's pieces (the forward's path for an unmasked causal call whose
queries are the last keys) against the branch-by-branch evaluation
(``NativeSparseAttention.branches``, itself checked against a loop from the paper's equations
in test_nsa.py), in float64: forward, gradients of the inputs and parameters, partial blocks,
query offsets, groups, windows shorter and longer than a block multiple, several chunks, spans
and tile batches."""

from __future__ import annotations

import pytest
import torch

from attnkit.sparse_trainable import NativeSparseAttention, _nsa_blocks

D = torch.float64

SMALL = dict(compress_block=4, compress_stride=2, select_block=4, num_selected=5, window=12)
CASES = [
    # sizes, group, q_offset, m
    (SMALL, 1, 0, 40),
    (SMALL, 1, 0, 43),  # a partial last block
    (SMALL, 2, 8, 37),  # queries after a prefix, a selection group
    (dict(SMALL, window=5), 1, 0, 41),  # the window: a block and an edge
    (dict(SMALL, window=4, num_local=1), 1, 4, 30),  # one block; block 0 from block 1 on
    (dict(SMALL, window=9, num_initial=2, num_local=3, num_selected=6), 1, 0, 50),
    (dict(compress_block=6, compress_stride=4, select_block=8, num_selected=4, window=20),
     2, 0, 77),  # l not a multiple of s, two edge blocks
    (SMALL, 1, 0, 3),  # shorter than a compression block
]  # fmt: skip


def _inputs(b, h, m, n, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, h, length, d, generator=g, dtype=D).requires_grad_() for length in (m, n, n)
    ]


@pytest.mark.parametrize("sizes, group, q_offset, m", CASES)
def test_pieces_match_the_branches(monkeypatch, sizes, group, q_offset, m):
    _check(monkeypatch, sizes, group, q_offset, m)


@pytest.mark.parametrize("sizes, group, q_offset, m", [CASES[1], CASES[6]])
def test_pieces_with_rising_references(monkeypatch, sizes, group, q_offset, m):
    """Every merge of gathered tiles takes the path where the rows' references rise to the
    running maximum (SLACK −inf), as when a block's scores lie far above the others'."""
    monkeypatch.setattr(_nsa_blocks, "SLACK", float("-inf"))
    _check(monkeypatch, sizes, group, q_offset, m)


def _check(monkeypatch, sizes, group, q_offset, m):
    monkeypatch.setattr(_nsa_blocks, "TILE", 3)  # several tiles per block
    monkeypatch.setattr(_nsa_blocks, "BATCH", 12)  # several batches of tiles
    monkeypatch.setattr(_nsa_blocks, "CHUNK", 400)  # several chunks of queries
    monkeypatch.setattr(_nsa_blocks, "PIECES", 12)  # several chunks of the pieces' calls
    monkeypatch.setattr(_nsa_blocks, "SPAN", 16)  # the forward over several spans of queries
    torch.manual_seed(4)
    module = NativeSparseAttention(4, **sizes, group_size=group).double()
    n = q_offset + m
    q, k, v = _inputs(1, 2 * group, m, n)
    assert _nsa_blocks.applies(q, n, q_offset, None, module._sizes())
    out = module(q, k, v, q_offset=q_offset).context
    ref = module.branches(q, k, v, q_offset=q_offset).context
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    with torch.no_grad():
        torch.testing.assert_close(module(q, k, v, q_offset=q_offset).context, out)
    g = torch.Generator().manual_seed(1)
    r = torch.randn(out.shape, dtype=D, generator=g)
    leaves = [q, k, v, *module.parameters()]
    got = torch.autograd.grad((out * r).sum(), leaves, allow_unused=True)
    want = torch.autograd.grad((ref * r).sum(), leaves, allow_unused=True)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_the_papers_block_sizes_in_float32():
    """l = 32, s = 16, l' = 64, w = 512 (n = 5) at N = 600 (10 blocks, a partial last one):
    float32 through the pieces against the branches in float64."""
    torch.manual_seed(0)
    module = NativeSparseAttention(8, num_selected=5)
    q, k, v = (x.detach().float().requires_grad_() for x in _inputs(1, 1, 600, 600, d=8))
    assert _nsa_blocks.applies(q, 600, 0, None, module._sizes())
    out = module(q, k, v).context
    ref = module.double().branches(*(x.double() for x in (q, k, v))).context
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    module.float()
    (out.square().sum()).backward()
    got = [x.grad for x in (q, k, v)]
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    module.double()
    want = torch.autograd.grad(module.branches(*leaves).context.square().sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=1e-3, rtol=1e-3)


def test_other_calls_take_the_chunked_path():
    """A mask, queries that do not end at the last key, an offset off the block grid, a
    window shorter than a block, too few selected blocks for the forced ones: not served."""
    module = NativeSparseAttention(4, **SMALL)
    sz = module._sizes()
    q = torch.zeros(1, 8, 4)
    assert _nsa_blocks.applies(q, 16, 8, None, sz)
    assert not _nsa_blocks.applies(q, 16, 8, torch.ones(1, 1, 16, dtype=torch.bool), sz)
    assert not _nsa_blocks.applies(q, 17, 8, None, sz)
    assert not _nsa_blocks.applies(q[:, :6], 16, 10, None, sz)
    assert not _nsa_blocks.applies(q, 16, 8, None, sz._replace(window=3))
    assert not _nsa_blocks.applies(q, 16, 8, None, sz._replace(selected=2))
    assert not _nsa_blocks.applies(q.half(), 16, 8, None, sz)
