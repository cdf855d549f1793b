"""The fused path's schedule: for each group of query blocks of a block mask, the pieces of
keys one fused call evaluates (full tiles unmasked, partial ones masked, triangular tiles
causally, narrow bands row by row)."""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.kernels.block_mask import BlockMask
from attnkit.kernels.chunked.plan import Plan, TileKeys, block_ranges

__all__ = [
    "ADDITIVE_CACHE_ELEMENTS",
    "BAND_ROWS",
    "DENSE_SCHEDULES",
    "NARROW_KEYS",
    "SCHEDULES",
    "Piece",
    "schedule_of",
]


@dataclass
class Piece:
    """Keys that one fused call of a group of query blocks attends: the block mask's full tiles
    (no mask), its partial ones (their mask), or a square region whose allowed pairs are exactly
    key ≤ query or key ≥ query in its own coordinates (evaluated causally, no mask: the
    kernel then skips the keys above the diagonal)."""

    keys: TileKeys
    allowed: Tensor | None = None  # bool (*block-mask lead, rows, keys)
    causal: bool = False
    flip: bool = False  # key ≥ query: evaluated causally on reversed queries and keys
    rows_any: Tensor | None = None  # bool (*lead, rows): rows with an allowed key here
    additive: dict = dataclasses.field(default_factory=dict)  # dtype -> 0 / −inf mask


# Query rows per fused call of a narrow band (:func:`_band_rows`): the kernel's work follows
# each call's key range, which narrows with the rows (measured against 128 and 32 at N = 4096,
# window 256: 64 is the fastest).
BAND_ROWS = 64
# A group's key tiles form a narrow band (:func:`_narrow`) when they span at most this many
# keys with at most NARROW full tiles per partial one (measured, N = 8192, d = 64: windows of
# 256 and 512 keys are 10-20 % faster as one masked range; a window of 2048, 4608 keys per
# group of four query blocks, is 25 % slower).
NARROW_KEYS = 1536
NARROW = 4
# id(block mask) -> (weak reference, its schedule): the pieces of every query block.
SCHEDULES: dict[int, tuple[weakref.ref, list]] = {}
# The contents of a dense mask (BlockMask.contents) -> (weak reference to their tile flags, the
# schedule).
DENSE_SCHEDULES: dict[tuple, tuple[weakref.ref, list]] = {}
# Partial-tile elements whose additive (0 / −inf) masks a schedule keeps.
ADDITIVE_CACHE_ELEMENTS = 1 << 24


def schedule_of(plan: Plan) -> list[tuple[int, int, list[Piece]]]:
    """For each group of query blocks of the plan's block mask: its rows and its pieces (built
    once per block mask; the groups depend on the block mask alone)."""
    bm = plan.block_mask
    assert bm is not None
    hit = SCHEDULES.get(id(bm))
    if hit is not None and hit[0]() is bm:
        return hit[1]
    # A block mask of a dense mask is made again on each call that passes the mask (the tile
    # flags are shared, :func:`attnkit.kernels.block_mask.from_dense_auto`): its schedule is
    # kept by the mask's contents (read on that call) while their flags live, and holds copies
    # of the mask's tiles, not views, so that it neither keeps the mask alive nor sees later
    # changes to it.
    dense_key = bm.contents if bm.dense is not None else None
    if dense_key is not None:
        hit = DENSE_SCHEDULES.get(dense_key)
        if hit is not None and hit[0]() is bm.any_allowed:
            return hit[1]
    out = []
    for q0, (q1, visit, full) in plan.groups.items():
        cols = [j for j, seen in enumerate(visit) if seen]
        whole = [j for j in cols if full[j]]
        # A square diagonal region whose allowed pairs are exactly key ≤ query: causal.
        diag = [j for j in cols if not full[j] and q0 <= j * bm.block_k < q1]
        causal = (
            bool(diag)
            and diag[0] * bm.block_k == q0
            and block_ranges(bm.block_k, bm.n)[diag[-1]][1] == q1
            and diag[-1] - diag[0] + 1 == len(diag)
        )
        if causal:
            tile = bm.tile(q0, q1, q0, q1)
            tril = torch.ones(q1 - q0, q1 - q0, dtype=torch.bool, device=tile.device).tril_()
            causal = bool((tile == tril).all())
        part = [j for j in cols if not full[j] and not (causal and j in diag)]
        pieces = []
        if whole:
            pieces.append(Piece(key_columns(bm, whole)))
        for j in list(part):  # a square tile whose pattern is key ≤ query or key ≥ query
            k0, k1 = block_ranges(bm.block_k, bm.n)[j]
            if k1 - k0 != q1 - q0:
                continue
            tile = bm.tile(q0, q1, k0, k1)
            ones = torch.ones(q1 - q0, q1 - q0, dtype=torch.bool, device=tile.device)
            for flip, shape in ((False, ones.tril()), (True, ones.triu())):
                if bool((tile == shape).all()):
                    pieces.append(Piece(TileKeys(k0, k1), causal=True, flip=flip))
                    part.remove(j)
                    break
        if part:
            keys = key_columns(bm, part)
            if keys.idx is None:
                allowed = bm.tile(q0, q1, keys.k0, keys.k1)
            else:
                allowed = bm.tile_at(q0, q1, keys.idx, part)
            rows_any = allowed.any(-1)
            empty_rows = None if bool(rows_any.all()) else rows_any
            pieces.append(Piece(keys, allowed, rows_any=empty_rows))
        if causal:
            pieces.append(Piece(TileKeys(q0, q1), causal=True))
        cut = len(pieces) > 1 or (len(pieces) == 1 and pieces[0].allowed is not None)
        if cut and _narrow(cols, whole, bm.block_k):
            out.extend(_band_rows(bm, q0, q1, cols))
            continue
        out.append((q0, q1, pieces))
    if dense_key is not None:
        for _, _, pieces in out:
            for piece in pieces:
                if piece.allowed is not None:
                    piece.allowed = piece.allowed.clone()
        DENSE_SCHEDULES[dense_key] = (weakref.ref(bm.any_allowed), out)
        weakref.finalize(bm.any_allowed, DENSE_SCHEDULES.pop, dense_key, None)
        return out
    SCHEDULES[id(bm)] = (weakref.ref(bm), out)
    weakref.finalize(bm, SCHEDULES.pop, id(bm), None)
    return out


def _narrow(cols: list[int], whole: list[int], block_k: int) -> bool:
    """Whether a group's visited key tiles ``cols`` (``whole`` of them full) are better
    evaluated as one masked range, :func:`_band_rows`: adjacent, at most NARROW_KEYS keys, and
    at most NARROW full tiles per partial one (a band's few tiles, where the fixed cost of
    each call and merge outweighs the mask; a long run of full tiles is cheaper unmasked)."""
    adjacent = cols[-1] - cols[0] + 1 == len(cols)
    short = len(cols) * block_k <= NARROW_KEYS
    return adjacent and short and len(whole) <= NARROW * (len(cols) - len(whole))


def _band_rows(bm: BlockMask, q0: int, q1: int, cols: list[int]) -> list:
    """Rows [q0, q1) against the adjacent key tiles ``cols`` in calls of BAND_ROWS rows, each
    with its keys cut to the first and last it may attend (a band's rows need fewer keys than
    the tiles hold) and its mask: (r0, r1, [piece]) per call."""
    keys = key_columns(bm, cols)
    allowed = bm.tile(q0, q1, keys.k0, keys.k1)
    out = []
    for r0 in range(q0, q1, BAND_ROWS):
        r1 = min(r0 + BAND_ROWS, q1)
        rows = allowed[..., r0 - q0 : r1 - q0, :]
        seen = rows.reshape(-1, rows.shape[-1]).any(0).nonzero()
        if seen.numel() == 0:  # no allowed key: the rows' empty result
            out.append((r0, r1, []))
            continue
        c0, c1 = int(seen[0]), int(seen[-1]) + 1
        rows = rows[..., c0:c1]
        rows_any = rows.any(-1)
        empty = None if bool(rows_any.all()) else rows_any
        piece = Piece(TileKeys(keys.k0 + c0, keys.k0 + c1), rows, rows_any=empty)
        out.append((r0, r1, [piece]))
    return out


def key_columns(bm: BlockMask, columns: list[int]) -> TileKeys:
    """The keys of the key tiles ``columns`` (a range when they are adjacent)."""
    runs = [(j * bm.block_k, min((j + 1) * bm.block_k, bm.n)) for j in columns]
    if columns[-1] - columns[0] + 1 == len(columns):
        return TileKeys(runs[0][0], runs[-1][1])
    return TileKeys(runs[0][0], runs[-1][1], torch.cat([torch.arange(a, b) for a, b in runs]))
