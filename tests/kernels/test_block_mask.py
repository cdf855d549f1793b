"""Block-sparse evaluation equals the dense masked computation for every score × streaming
alignment, forward and gradients, for block sizes that do and do not divide the lengths; the
kernel visits only the tiles the pattern needs; score_mod is differentiable."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from registered_parts import ALIGNMENTS, SCORES, Dims
from torch import nn

import attnkit as ak
from attnkit import patterns as pt
from attnkit.kernels import BlockMask, chunked, dense

DIMS = Dims(max_len=40)
STREAMING = [a for a in ALIGNMENTS if chunked.supports(ALIGNMENTS[a](DIMS))]
PATTERN = pt.or_masks(pt.sliding_window(3), pt.longformer(0, [5]))


def _grads(out, wrt, r):
    g = torch.autograd.grad((out * r).sum(), wrt, allow_unused=True)
    return [torch.zeros_like(w) if x is None else x for x, w in zip(g, wrt, strict=True)]


# Blocks that leave ragged last blocks of the 33 × 37 scores (8 × 8, 5 × 7) and one query block
# larger than M (40 × 3); one size for the multi-dimensional layout keeps the suite quick.
# A score that mixes neighbouring keys takes the mask itself, densely: the chunked kernel
# refuses it under a block mask.
CASES = [
    (s, a, blocks)
    for s, a in itertools.product(SCORES, STREAMING)
    if not SCORES[s](DIMS).mixes_keys
    for blocks in ([(8, 8)] if SCORES[s](DIMS).multi_dimensional else [(8, 8), (5, 7), (40, 3)])
]


@pytest.mark.parametrize(("score", "align", "blocks"), CASES)
def test_block_sparse_equals_dense_masked(score, align, blocks):
    torch.manual_seed(0)
    s, a = SCORES[score](DIMS).double(), ALIGNMENTS[align](DIMS).double()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 33, DIMS.d_q, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 37, DIMS.d_k, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 37, DIMS.d_v, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(33, 37, generator=g, dtype=torch.float64, requires_grad=True)
    padding = ak.masks.from_lengths(torch.tensor([37, 30]), 37)
    bm = pt.block_mask(PATTERN, 33, 37, block_q=blocks[0], block_k=blocks[1])
    mask = padding & pt.dense(PATTERN, 33, 37)
    ref = dense.attend(q, k, v, s, a, mask=mask, bias=bias, need_weights=True)
    out = chunked.attend(q, k, v, s, a, mask=padding, bias=bias, block_mask=bm, need_weights=True)
    torch.testing.assert_close(out.context, ref.context, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out.weights, ref.weights.detach(), atol=1e-10, rtol=1e-10)
    wrt = [q, k, v, bias, *s.parameters(), *a.parameters()]
    r = torch.randn_like(ref.context)
    for g1, g2 in zip(_grads(out.context, wrt, r), _grads(ref.context, wrt, r), strict=True):
        torch.testing.assert_close(g1, g2, atol=1e-9, rtol=1e-9)


def test_everything_allowed_equals_dense_attention():
    q, k, v = (torch.randn(2, 3, 21, 8, dtype=torch.float64) for _ in range(3))
    bm = pt.block_mask(lambda b, h, i, j: i >= 0, 21, block_q=4, block_k=6)
    assert bm.all_allowed.all()
    for align in ("softmax", "entmax15"):
        out = ak.attention(q, k, v, align=align, block_mask=bm)
        torch.testing.assert_close(
            out.context, ak.attention(q, k, v, align=align, kernel="dense").context
        )


def test_only_the_needed_tiles_are_visited():
    n, block = 64, 8
    bm = pt.block_mask(pt.sliding_window(2), n, block_q=block, block_k=block)
    assert bm.any_allowed.sum() == 8 + 2 * 7  # the diagonal tiles and their neighbours
    assert bm.all_allowed.sum() == 0
    score = ak.scores.ScaledDot()
    areas = []

    def pairwise(qp, kp, key_offset=0):
        areas.append(qp.shape[-2] * kp.shape[-2])
        return ak.scores.ScaledDot.pairwise(score, qp, kp, key_offset)

    q = torch.randn(1, n, 4, requires_grad=True)
    with (
        mock.patch.object(chunked.fused, "FLASH_BACKWARD", None),  # the tiled path
        mock.patch.object(score, "pairwise", side_effect=pairwise),
    ):
        out = ak.attention(q, q, score=score, block_mask=bm)
        forward = sum(areas)
        out.context.sum().backward()
    visited = int(bm.any_allowed.sum()) * block * block
    # softmax: one sweep over the visited tiles; query blocks evaluated together may add at most
    # a quarter of that
    assert visited <= forward <= 1.25 * visited
    assert sum(areas) == 2 * forward  # backward recomputes the same tiles
    assert forward < n * n / 2


def test_full_tiles_skip_the_mask_work():
    calls = []

    def blocky(b, h, i, j):
        calls.append(1)
        return (i // 8 == j // 8) | (j < 8)  # every tile is full or empty

    bm = pt.block_mask(blocky, 32, block_q=8, block_k=8)
    assert torch.equal(bm.any_allowed, bm.all_allowed)
    built = len(calls)
    q = torch.randn(1, 32, 4, dtype=torch.float64)
    out = ak.attention(q, q, block_mask=bm)
    assert len(calls) == built  # no tile needed the mask function
    ref = ak.attention(q, q, mask=pt.dense(blocky, 32, 32), kernel="dense")
    torch.testing.assert_close(out.context, ref.context)


def test_mask_mod_over_batch_and_heads():
    lengths = torch.tensor([10, 6])

    def padded_causal(b, h, i, j):
        return (j <= i) & (j < lengths[b]) & ((h == 0) | (j >= i - 1))

    bm = pt.block_mask(padded_causal, 10, batch=2, num_heads=3, block_q=4, block_k=4)
    q, k, v = (torch.randn(2, 3, 10, 8, dtype=torch.float64) for _ in range(3))
    i, j = torch.arange(10)[:, None], torch.arange(10)[None]
    b = torch.arange(2)[:, None, None, None]
    h = torch.arange(3)[None, :, None, None]
    mask = (j <= i) & (j < lengths[b]) & ((h == 0) | (j >= i - 1))
    out = ak.attention(q, k, v, align="sparsemax", block_mask=bm)
    ref = ak.attention(q, k, v, align="sparsemax", mask=mask, kernel="dense")
    torch.testing.assert_close(out.context, ref.context)


def test_from_dense_equals_from_mask_mod():
    mask = pt.dense(pt.strided(5), 30, 30)
    a = BlockMask.from_dense(mask, block_q=7, block_k=4)
    b = pt.block_mask(pt.strided(5), 30, block_q=7, block_k=4)
    assert torch.equal(a.any_allowed, b.any_allowed) and torch.equal(a.all_allowed, b.all_allowed)
    q = torch.randn(1, 30, 8, dtype=torch.float64)
    torch.testing.assert_close(
        ak.attention(q, q, block_mask=a).context, ak.attention(q, q, block_mask=b).context
    )


def test_rows_with_no_allowed_key_give_zero():
    bm = pt.block_mask(lambda b, h, i, j: (i >= 8) & (j <= i), 16, block_q=4, block_k=4)
    q = torch.randn(1, 16, 4, requires_grad=True)
    for align in ("softmax", "sparsemax", "sigmoid"):
        out = ak.attention(q, q, align=align, block_mask=bm, need_weights=True)
        assert (out.context[0, :8] == 0).all() and (out.weights[0, :8] == 0).all()
        out.context.sum().backward()
        assert torch.isfinite(q.grad).all()


class RelativeBias(nn.Module):
    """score_mod with a learned bias per clipped distance (a T5-like table)."""

    def __init__(self, span):
        super().__init__()
        self.span = span
        self.table = nn.Parameter(torch.randn(2 * span + 1, dtype=torch.float64))

    def forward(self, e, b, h, i, j):
        return e + self.table[(i - j).clamp(-self.span, self.span) + self.span]


def test_score_mod_is_differentiable_and_equals_a_bias():
    torch.manual_seed(0)
    mod = RelativeBias(3)
    q, k, v = (torch.randn(2, 19, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bm = pt.block_mask(pt.causal(), 19, block_q=5, block_k=5)
    out = ak.attention(q, k, v, align="entmax15", block_mask=bm, score_mod=mod)
    i, j = torch.arange(19)[:, None], torch.arange(19)[None]
    table = mod.table.detach().clone().requires_grad_()
    bias = table[(i - j).clamp(-3, 3) + 3]
    ref = ak.attention(q, k, v, align="entmax15", mask=j <= i, bias=bias, kernel="dense")
    torch.testing.assert_close(out.context, ref.context)
    r = torch.randn_like(ref.context)
    (out.context * r).sum().backward()
    (ref.context * r).sum().backward()
    torch.testing.assert_close(mod.table.grad, table.grad)
    dense_out = ak.attention(q, k, v, align="entmax15", mask=j <= i, score_mod=mod, kernel="dense")
    torch.testing.assert_close(dense_out.context, ref.context)


def test_bad_block_masks_and_score_mods():
    q = torch.randn(1, 10, 4)
    bm = pt.block_mask(pt.causal(), 12)
    with pytest.raises(
        ValueError, match=r"block_mask is for M = 12, N = 12 but the scores are \(1, 10, 10\)"
    ):
        ak.attention(q, q, block_mask=bm)
    with pytest.raises(TypeError, match=r"block_mask must be an attnkit\.kernels\.BlockMask"):
        ak.attention(q, q, block_mask=torch.ones(10, 10, dtype=torch.bool))
    with pytest.raises(TypeError, match="score_mod must be callable"):
        ak.attention(q, q, score_mod=3)
    with pytest.raises(ValueError, match="score_mod must return the scores' shape"):
        ak.attention(q, q, score_mod=lambda e, b, h, i, j: e.sum(-1), kernel="dense")
    with pytest.raises(TypeError, match="mask_mod must return a boolean tensor"):
        pt.block_mask(lambda b, h, i, j: i - j, 10)
    with pytest.raises(ValueError, match="block masks and score_mod run on the chunked"):
        ak.attention(q, q, block_mask=pt.block_mask(pt.causal(), 10), kernel="sdpa")
    with pytest.raises(ValueError, match="chunk_size=3 differs from the block mask"):
        ak.attention(q, q, block_mask=pt.block_mask(pt.causal(), 10, block_k=4), chunk_size=3)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("score", ["scaled_dot", "additive", "location"])
def test_kept_and_recomputed_partial_tiles_agree(keep, score):
    """A block mask keeps its partial tiles while they fit a budget, else the kernel evaluates
    the mask function again; both give the dense masked result."""
    torch.manual_seed(0)
    s = SCORES[score](DIMS).double()
    q, k, v = (torch.randn(2, 37, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pattern = pt.bigbird(2, 37, global_positions=[3], random_blocks=1, block=8, seed=1)
    budget = 1 << 28 if keep else 0
    with mock.patch("attnkit.kernels.block_mask._CACHE_ELEMENTS", budget):
        bm = pt.block_mask(pattern, 37, block_q=8, block_k=8)
    assert (bm.partial is not None) == keep
    out = ak.attention(q, k, v, score=s, align="sparsemax", block_mask=bm)
    ref = ak.attention(
        q, k, v, score=s, align="sparsemax", mask=pt.dense(pattern, 37, 37), kernel="dense"
    )
    torch.testing.assert_close(out.context, ref.context)
    r = torch.randn_like(ref.context)
    for g1, g2 in zip(
        _grads(out.context, [q, k, v], r), _grads(ref.context, [q, k, v], r), strict=True
    ):
        torch.testing.assert_close(g1, g2)


def test_batch_without_heads_is_refused_on_scores_with_head_dims():
    """A (B,) pattern would line up with the heads of (B, H, M, N) scores: refused, and with
    num_heads=1 the batch index reaches the first dim on both kernels."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=g, dtype=torch.float64) for _ in range(3))
    lengths = torch.tensor([3, 8])
    mask_mod = lambda b, h, i, j: j < lengths[b]  # noqa: E731
    loose = BlockMask.from_mask_mod(mask_mod, 8, 8, batch=2, block_q=4, block_k=4)
    with pytest.raises(ValueError, match="heads="):
        ak.attention(q, k, v, block_mask=loose)
    ok = BlockMask.from_mask_mod(mask_mod, 8, 8, batch=2, num_heads=1, block_q=4, block_k=4)
    padding = (torch.arange(8) < lengths[:, None])[:, None, None, :]
    expected = ak.attention(q, k, v, mask=padding, kernel="dense").context
    for kernel in ("dense", "chunked"):
        got = ak.attention(q, k, v, block_mask=ok, kernel=kernel).context
        torch.testing.assert_close(got, expected)
    # Without head dims the (B,) pattern is what it says.
    got = ak.attention(q[:, 0], k[:, 0], v[:, 0], block_mask=loose, kernel="chunked").context
    expected = ak.attention(q[:, 0], k[:, 0], v[:, 0], mask=padding[:, 0]).context
    torch.testing.assert_close(got, expected)


def test_tiles_of_grouped_query_blocks_stay_within_the_tile_budget():
    """Consecutive query blocks evaluated together hold proportionally fewer keys per tile, so a
    group's tile is no larger than one block's; the result stays the dense masked one."""
    n, block, budget = 64, 8, 128  # one query block: 16 keys per tile
    bm = pt.block_mask(pt.causal(), n, block_q=block, block_k=block)
    score = ak.scores.ScaledDot()
    shapes = []

    def pairwise(qp, kp, key_offset=0):
        shapes.append((qp.shape[-2], kp.shape[-2]))
        return ak.scores.ScaledDot.pairwise(score, qp, kp, key_offset)

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, n, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    with (
        mock.patch.object(chunked.fused, "FLASH_BACKWARD", None),  # the tiled path
        mock.patch.object(chunked.evaluate, "TILE_ELEMENTS", budget),
        mock.patch.object(score, "pairwise", side_effect=pairwise),
    ):
        out = ak.attention(q, k, v, score=score, block_mask=bm)
    assert any(rows > block for rows, _ in shapes)  # query blocks were grouped
    for rows, keys in shapes:
        assert keys <= max(block, budget // rows)
    ref = ak.attention(q, k, v, mask=pt.dense(pt.causal(), n, n), kernel="dense")
    torch.testing.assert_close(out.context, ref.context, atol=1e-12, rtol=1e-12)
    r = torch.randn(ref.context.shape, generator=g, dtype=torch.float64)
    grads = _grads(out.context, [q, k, v], r), _grads(ref.context, [q, k, v], r)
    for g1, g2 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g2, atol=1e-10, rtol=1e-10)


def _q():
    return torch.randn(1, 10, 4)


BAD_SCORE_MODS = [
    (
        "integer scores",
        lambda e, b, h, i, j: (e * 10).long(),
        TypeError,
        r"score_mod must return scores of the dtype it was given \(torch.float32\).*torch.int64",
    ),
    (
        "boolean scores",
        lambda e, b, h, i, j: i >= j,
        TypeError,
        r"got torch.bool.*block_mask= or mask=",
    ),
    (
        "another float dtype",
        lambda e, b, h, i, j: e.double(),
        TypeError,
        r"got torch.float64.*\.to\(e.dtype\)",
    ),
    (
        "not a tensor",
        lambda e, b, h, i, j: 0.0,
        TypeError,
        r"score_mod must return a tensor of scores.*got float",
    ),
    (
        "another shape",
        lambda e, b, h, i, j: e.sum(-1),
        ValueError,
        r"score_mod must return the scores' shape",
    ),
]


@pytest.mark.parametrize("kernel", ["dense", "chunked"])
@pytest.mark.parametrize(
    ("mod", "error", "message"), [c[1:] for c in BAD_SCORE_MODS], ids=[c[0] for c in BAD_SCORE_MODS]
)
def test_bad_score_mods_name_what_they_returned(kernel, mod, error, message):
    q = _q()
    with pytest.raises(error, match=message):
        ak.attention(q, q, score_mod=mod, kernel=kernel)


# ---- a dense mask turned into a block mask ---------------------------------------------------


def _flags_by_loop(mask: torch.Tensor, bq: int, bk: int):
    """Per tile: any / all allowed over every batch entry, one tile at a time."""
    m, n = mask.shape[-2:]
    nq, nk = -(-m // bq), -(-n // bk)
    any_allowed = torch.zeros(nq, nk, dtype=torch.bool)
    all_allowed = torch.zeros(nq, nk, dtype=torch.bool)
    for i, j in itertools.product(range(nq), range(nk)):
        tile = mask[..., i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
        any_allowed[i, j], all_allowed[i, j] = bool(tile.any()), bool(tile.all())
    return any_allowed, all_allowed


@pytest.mark.parametrize("shape", [(33, 37), (2, 1, 40, 24), (3, 16, 16)])
@pytest.mark.parametrize("blocks", [(8, 8), (5, 7), (40, 3)])
def test_from_dense_flags_match_a_loop_over_tiles(shape, blocks):
    g = torch.Generator().manual_seed(len(shape))
    mask = torch.rand(shape, generator=g) < 0.1
    mask[..., :4, :] = True  # some full tiles
    mask[..., 8:16, :] = False  # and some empty ones
    bm = BlockMask.from_dense(mask, block_q=blocks[0], block_k=blocks[1])
    any_allowed, all_allowed = _flags_by_loop(mask, *blocks)
    assert torch.equal(bm.any_allowed, any_allowed)
    assert torch.equal(bm.all_allowed, all_allowed)
    assert torch.equal(bm.has_key, mask.any(-1, keepdim=True))
    assert bm.lead == tuple(shape[:-2])


def test_auto_block_mask_only_when_most_tiles_are_empty():
    from attnkit.kernels.block_mask import AUTO_MAX_DENSITY, from_dense_auto

    n = 1100  # 9 blocks of 128 a side, the last one ragged
    shape = torch.Size((2, n, n))
    window = ak.masks.window(n, n, 40)
    bm = from_dense_auto(window, shape)
    any_allowed, all_allowed = _flags_by_loop(window, 128, 128)
    assert bm is not None and bm.dense is window
    assert torch.equal(bm.any_allowed, any_allowed) and torch.equal(bm.all_allowed, all_allowed)
    assert bm.density <= AUTO_MAX_DENSITY
    assert from_dense_auto(torch.ones(n, n, dtype=torch.bool), shape) is None  # nothing empty
    padding = ak.masks.from_lengths(torch.tensor([n, 3]), n)  # (B, 1, N): not per query
    assert from_dense_auto(padding, shape) is None
    small = ak.masks.window(512, 512, 8)  # 4 blocks a side: too few tiles to pay
    assert from_dense_auto(small, torch.Size((512, 512))) is None


def test_auto_block_mask_is_cached_by_contents():
    from attnkit.kernels import block_mask as bmm

    n = 1024
    window = ak.masks.window(n, n, 16)
    shape = torch.Size((n, n))
    with mock.patch.object(BlockMask, "_from_flags", wraps=BlockMask._from_flags) as spy:
        first = bmm.from_dense_auto(window, shape)
        again = bmm.from_dense_auto(window, shape)
        assert spy.call_count == 1  # read once for the same values
        assert torch.equal(first.any_allowed, again.any_allowed)
        same_values = ak.masks.window(n, n, 16)  # another tensor, the same values: one entry
        assert bmm.from_dense_auto(same_values, shape).dense is same_values
        assert spy.call_count == 1
        window[:, :] = True  # an in-place change: read again, now dense
        assert bmm.from_dense_auto(window, shape) is None
        assert spy.call_count == 2
        window.numpy()[:, :] = ak.masks.window(n, n, 16).numpy()  # unseen by _version: back
        assert torch.equal(bmm.from_dense_auto(window, shape).any_allowed, first.any_allowed)
        assert spy.call_count == 2
    for size in range(bmm._AUTO_CACHE_SIZE + 3):  # new values at each step: the cache is bounded
        bmm.from_dense_auto(ak.masks.window(n, n, size), shape)
    assert len(bmm._AUTO_CACHE) <= bmm._AUTO_CACHE_SIZE


def test_a_block_mask_from_a_dense_mask_is_what_the_mask_was_when_built():
    mask = ak.patterns.dense(ak.patterns.sliding_window(3), 32, 32)
    bm = BlockMask.from_dense(mask, block_q=8, block_k=8)
    mask.numpy()[0, 31] = True  # a later change does not reach it
    assert not bm.to_dense()[0, 31]
    assert not bm.any_allowed[0, 3]
