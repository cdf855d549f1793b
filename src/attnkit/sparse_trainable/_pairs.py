"""Softmax attention of queries over key blocks each of them chose, tiled by key block so that
every score comes from a batched matrix product and no key is copied once per query.

A *pair* (query m, key block j of item c) says that query m reads keys j·b … j·b + b − 1 of
item c, those at positions in [lo_m, hi_m] (and allowed by a row mask); a query's keys are the
union of its pairs' blocks (one query's pairs name distinct blocks). Gathering each query's
keys, (M, T, d), moves M·T·d numbers and multiplies them as vectors; here the pairs are sorted
by key block and cut into tiles of ``size`` pairs that read one block, so that a tile is one
(size × d)·(d × b) product and a key block is read once per tile (about M·T/size·d numbers
moved):

    e_{m,t} = scale · q_m · k_t,  lse_m = log Σ_t exp(e_{m,t}),  o_m = Σ_t exp(e_{m,t} − lse_m) v_t

The backward is FlashAttention's, per tile, with the row statistic taken from the scores
themselves, r_m = Σ_t p_{m,t} (∂L/∂o_m · v_t) (= ∂L/∂o_m · o_m), so that neither the weights nor
the output are kept: ∂L/∂e = g · p (dP − r), dP = ∂L/∂o · vᵀ, where g scales the incoming
gradient (the branch gate of NSA) and r, per query, is also the gradient of g.

These are chunk-level helpers without autograd: the caller holds a chunk of queries (all of
their pairs) and the whole keys.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Tiles", "tile_backward", "tile_forward", "tile_weights", "tiles"]


class Tiles(NamedTuple):
    """Pairs grouped into tiles that read one key block each.

    Attributes:
        query: (T, P) flat query rows of the chunk, the empty row where a slot is unused.
        lo, hi: (T, P) the first and last key position the slot's query may read (hi < lo for
            an unused slot).
        item: (T,) the item (flattened leading index) of each tile.
        start: (T,) the position of the tile's block's first key.
        edges: the first ``edges`` tiles hold the pairs that may not read all of their block
            (the others read it whole, unless a row mask says otherwise). Their unused slots
            are not masked: they read the empty row (zeros, gradient 0, gate 0) and add only
            to its statistics, which are dropped.
    """

    query: Tensor
    lo: Tensor
    hi: Tensor
    item: Tensor
    start: Tensor
    edges: int


def tiles(
    item: Tensor,
    block: Tensor,
    query: Tensor,
    lo: Tensor,
    hi: Tensor,
    *,
    items: int,
    blocks: int,
    block_size: int,
    empty: int,
    size: int,
) -> Tiles:
    """Tiles of ``size`` pairs from the pairs (item, block, query row, lo, hi) (each (L,)),
    ``items`` items of ``blocks`` key blocks; pairs of one (item, block) fill its tiles in their
    order."""
    start = block * block_size
    # tiles whose pairs read part of their block come first, so that only they are masked
    edge = (lo > start) | (hi < start + block_size - 1)
    key, order = torch.sort(edge.logical_not() * (items * blocks) + item * blocks + block)
    query, lo, hi = query[order], lo[order], hi[order]
    counts = torch.bincount(key, minlength=2 * items * blocks)
    per = (counts + size - 1) // size
    first_tile = per.cumsum(0) - per
    first_pair = counts.cumsum(0) - counts
    rank = torch.arange(len(key), device=key.device) - first_pair[key]
    slot = (first_tile[key] + rank // size) * size + rank % size
    total = int(per.sum()) * size
    q_at = torch.full((total,), empty, dtype=torch.long, device=key.device)
    lo_at = torch.zeros(total, dtype=torch.long, device=key.device)
    hi_at = torch.full((total,), -1, dtype=torch.long, device=key.device)
    q_at[slot], lo_at[slot], hi_at[slot] = query, lo, hi
    tile_key = torch.repeat_interleave(torch.arange(len(per), device=key.device), per)
    return Tiles(
        q_at.view(-1, size),
        lo_at.view(-1, size),
        hi_at.view(-1, size),
        tile_key // blocks % items,
        tile_key % blocks * block_size,
        int(per[: items * blocks].sum()),
    )


def _scores(qf, kf, t: Tiles, n: int, block_size: int, scale: float, rows):
    """Tile scores (T, P, b), −inf where a slot may not read a key, and the keys' flat rows."""
    pos = t.start[:, None] + torch.arange(block_size, device=qf.device)  # (T, b)
    krow = (t.item[:, None] * n + pos.clamp_max(n - 1)).reshape(-1)
    kt = kf.index_select(0, krow).view(*pos.shape, kf.shape[-1])
    qt = qf.index_select(0, t.query.reshape(-1)).view(*t.query.shape, qf.shape[-1])
    s = torch.bmm(qt, kt.transpose(1, 2)).mul_(scale)
    e = t.edges
    if e:
        near = pos[:e, None, :]
        ok = (near >= t.lo[:e, :, None]) & (near <= t.hi[:e, :, None])
        s[:e].masked_fill_(~ok, float("-inf"))
    if rows is not None:  # rows(query rows (T, P), positions (T, b)) -> (T, P, b)
        s.masked_fill_(~rows(t.query, pos.clamp_max(n - 1)), float("-inf"))
    return s, qt, kt, krow


def tile_forward(
    qf: Tensor,
    kf: Tensor,
    vf: Tensor,
    t: Tiles,
    *,
    n: int,
    block_size: int,
    scale: float,
    rows=None,
) -> tuple[Tensor, Tensor]:
    """Context (R, d_v) and log-sum-exp (R,) of the chunk's R queries (module docstring).

    Args:
        qf: (R + 1, d) the chunk's queries, flat, then a row of zeros (the empty row).
        kf, vf: (count·N, d) and (count·N, d_v) every item's keys and values, flat.
        t: the chunk's tiles.
        n: N.
        rows: None, or a function (query rows (T, P), key positions (T, b)) -> (T, P, b) bool
            of the keys a row mask allows.

    A query without a key gets context 0 and log-sum-exp 0.
    """
    s, _, _, krow = _scores(qf, kf, t, n, block_size, scale, rows)
    r = qf.shape[0]
    flat = t.query.reshape(-1)
    top = torch.full((r,), float("-inf"), dtype=s.dtype, device=s.device)
    top.scatter_reduce_(0, flat, s.amax(-1).reshape(-1), "amax")
    top = top.nan_to_num(0.0, 0.0, 0.0)  # rows without a key: no finite score
    s.sub_(top[t.query][..., None]).exp_()
    total = s.new_zeros(r).index_add_(0, flat, s.sum(-1).reshape(-1))
    vt = vf.index_select(0, krow).view(*s.shape[::2], vf.shape[-1])
    out = s.new_zeros(r, vf.shape[-1]).index_add_(0, flat, torch.bmm(s, vt).flatten(0, 1))
    has = total > 0
    out = out.div_(total.where(has, 1.0)[:, None])
    lse = torch.where(has, top + total.where(has, 1.0).log(), 0.0)
    return out[:-1], lse[:-1]


def tile_backward(
    qf: Tensor,
    kf: Tensor,
    vf: Tensor,
    grad: Tensor,
    lse: Tensor,
    gate: Tensor,
    t: Tiles,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    *,
    n: int,
    block_size: int,
    scale: float,
    rows=None,
) -> Tensor:
    """Accumulate the gradients of :func:`tile_forward` (module docstring) and return r (R,).

    Args:
        qf, kf, vf, t, n, block_size, scale, rows: as :func:`tile_forward`.
        grad: (R + 1, d_v) ∂L/∂(gated context), flat, then a row of zeros.
        lse: (R + 1,) the forward's log-sum-exp (any value at the empty row).
        gate: (R + 1,) g, the factor of the context in the loss.
        dq: (R + 1, d) accumulates ∂L/∂q; dk, dv: (count·N, ·) accumulate ∂L/∂k, ∂L/∂v.
    """
    s, qt, kt, krow = _scores(qf, kf, t, n, block_size, scale, rows)
    flat = t.query.reshape(-1)
    p = s.sub_(lse[t.query][..., None]).exp_()  # masked: exp(−inf) = 0
    vt = vf.index_select(0, krow).view(*p.shape[::2], vf.shape[-1])
    gt = grad.index_select(0, flat).view(*t.query.shape, grad.shape[-1])
    dp = torch.bmm(gt, vt.transpose(1, 2))
    r = p.new_zeros(qf.shape[0]).index_add_(0, flat, (p * dp).sum(-1).reshape(-1))
    g = gate[t.query][..., None]
    ds = dp.sub_(r[t.query][..., None]).mul_(p).mul_(g * scale)
    dq.index_add_(0, flat, torch.bmm(ds, kt).flatten(0, 1))
    dk.index_add_(0, krow, torch.bmm(ds.transpose(1, 2), qt).flatten(0, 1))
    dv.index_add_(0, krow, torch.bmm(p.mul_(g).transpose(1, 2), gt).flatten(0, 1))
    return r


def tile_weights(
    qf: Tensor,
    kf: Tensor,
    lse: Tensor,
    t: Tiles,
    *,
    n: int,
    block_size: int,
    scale: float,
    rows=None,
) -> Tensor:
    """The weights exp(e − lse) as dense rows (R + 1, N) (0 where a query reads no key), from
    the forward's log-sum-exp ``lse`` (R + 1,); arguments as :func:`tile_forward`."""
    s, _, _, _ = _scores(qf, kf, t, n, block_size, scale, rows)
    p = s.sub_(lse[t.query][..., None]).exp_()
    pos = (t.start[:, None] + torch.arange(block_size, device=qf.device)).clamp_max(n - 1)
    dense = p.new_zeros(qf.shape[0], n)
    # accumulate: a block's positions past N are clamped onto N − 1 with weight 0
    dense.index_put_((t.query[..., None], pos[:, None, :]), p, accumulate=True)
    return dense
