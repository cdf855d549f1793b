"""NSA's three branches (Yuan et al. 2025, eqs. 5, 7-12) evaluated a chunk of queries at a time,
with one hand-written backward, so that time follows the selection and nothing of size M·N, nor
any branch's output, is kept.

For each chunk of queries: the compressed branch as a dense product over the compressed blocks
the chunk has seen (its weights give the block importances, eq. 9, from which the top n blocks
are chosen, eqs. 10-11), then the selected and window branches as attention over (query, key
block) pairs tiled by key block (:mod:`attnkit.sparse_trainable._pairs`), and the gated sum
(eq. 5) written into the context. Kept for the backward: each branch's log-sum-exp (…, M) and
the chosen blocks (…, M, n). The backward recomputes the scores chunk by chunk and takes each
branch's row statistic from them, r = Σ_t p_t (∂L/∂o · v_t), which is also the gradient of that
branch's gate.

Cost per query: (n·l' + w + ⌈w/l'⌉·l')·d for the token branches (a key block of l' is read
whole and masked at its edges) plus (p_t/s)·d for the compressed branch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit.sparse_trainable._pairs import tile_backward, tile_forward, tiles
from attnkit.sparse_trainable._select import top_indices

__all__ = ["Sizes", "importance", "nsa_chunked", "rank_blocks"]

#: (query, key block) pairs per chunk and branch: a chunk's tile scores are PAIRS·l' numbers
PAIRS = 1 << 14
#: pairs per tile
TILE = 32


class Sizes(NamedTuple):
    """NSA's sizes: l, s, l', n, w, the forced initial and local blocks, the GQA group."""

    block: int
    stride: int
    select: int
    selected: int
    window: int
    initial: int
    local: int
    group: int


def importance(p_cmp: Tensor, n: int, sz: Sizes) -> Tensor:
    """Eq. 9 as an overlap sum: selection block j (keys j·l' … (j + 1)·l' − 1) gathers the
    weights (…, M, c) of the compressed blocks i (keys i·s … i·s + l − 1) it overlaps, i < c
    -> (…, M, ⌈N/l'⌉). Each block overlaps a run of at most ⌊(l' + l − 2)/s⌋ + 1 compressed
    blocks, so this reads O(M·N/l'·l/s) numbers, not the O(M·N²/(s·l')) of a dense product."""
    count, c = -(-n // sz.select), p_cmp.shape[-1]
    r, a = sz.select // sz.stride, (sz.block - 1) // sz.stride
    if c and count and sz.select % sz.stride == 0 and a <= r:
        # block j's run is i = j·r − a … j·r + r − 1 (r = l'/s, a = ⌊(l − 1)/s⌋ ≤ r): the sum
        # of its own group of r (i // r = j) plus the last a of the group before
        lead = p_cmp.shape[:-1]
        out = p_cmp.new_zeros(*lead, count)
        whole = min(c // r, count)
        # the group sums as r − 1 additions of strided columns (a reduction over an innermost
        # dim of r = 4 runs at about two thirds of their speed)
        head = out[..., :whole]
        head.copy_(p_cmp[..., 0 : whole * r : r])
        for i in range(1, r):
            head += p_cmp[..., i : whole * r : r]
        if whole < count and whole * r < c:
            out[..., whole] = p_cmp[..., whole * r : (whole + 1) * r].sum(-1)
        for t in range(1, a + 1):
            last = min(count - 1, (c - 1 + t) // r)  # blocks 1 … last reach back to i = jr − t
            if last >= 1:
                out[..., 1 : last + 1] += p_cmp[..., r - t : last * r - t + 1 : r]
        return out
    j = torch.arange(count, device=p_cmp.device)
    lo = (-((sz.block - 1 - j * sz.select) // sz.stride)).clamp_min(0)  # ceil, at least 0
    hi = ((j + 1) * sz.select - 1) // sz.stride
    if c == 0 or count == 0:
        return p_cmp.new_zeros(*p_cmp.shape[:-1], count)
    width = (sz.select + sz.block - 2) // sz.stride + 1
    index = lo[:, None] + torch.arange(width, device=p_cmp.device)  # (count, width)
    valid = (index <= hi[:, None]) & (index < c)
    picked = p_cmp[..., index.clamp_max(c - 1)]  # (…, M, count, width)
    return picked.where(valid, 0.0).sum(-1)


def rank_blocks(
    score: Tensor, pos: Tensor, has_key: Tensor | None, sz: Sizes
) -> tuple[Tensor, Tensor]:
    """Eq. 11: the top n blocks (…, M, n') by ``score`` (…, M, count), the forced ones (the
    first ``initial`` and the ``local`` ending at the query's own) first, only blocks with a key
    the query may read (causal, and ``has_key`` (…, M', count) where given); ties in block
    order. Returns (blocks, available)."""
    j = torch.arange(score.shape[-1], device=score.device)
    current = (pos // sz.select)[:, None]  # (M, 1)
    forced = (j < sz.initial) | ((j <= current) & (j > current - sz.local))
    has = (j * sz.select)[None, :] <= pos[:, None]  # the block's first key is not after p_t
    if has_key is not None:
        has = has & has_key
    inf = torch.tensor(float("inf"), dtype=score.dtype, device=score.device)
    return top_indices(torch.where(forced, inf, score).where(has, -inf), sz.selected)


class _Chunk(NamedTuple):
    """One chunk's queries [a, b): positions, row mask, compressed sizes, pair tiles."""

    a: int
    b: int
    cm: int
    seen: Tensor
    rows: object
    window: object


def _rows_lookup(rows: Tensor | None, q: int, n: int):
    """The mask of a chunk's rows (count, Q', N) as a function of (query rows, key
    positions) for the tiles (query row c·Q + m; the empty row reads row 0)."""
    if rows is None:
        return None
    count, per = rows.shape[0], rows.shape[1]
    flat = rows.reshape(-1)

    def lookup(query: Tensor, pos: Tensor) -> Tensor:
        query = query.clamp_max(count * q - 1)
        row = query if per == q else query // q
        return flat[row[..., None] * n + pos[:, None, :]]

    return lookup


def _window_pairs(pos: Tensor, count: int, n: int, sz: Sizes):
    """The window's pairs: query at p reads blocks ⌊(p − w + 1)/l'⌋ … ⌊p/l'⌋ (clipped)."""
    lb = sz.select
    first = (pos - sz.window + 1).clamp_min(0) // lb
    last = pos.clamp_max(n - 1) // lb
    slots = -(-sz.window // lb) + 1
    block = first[:, None] + torch.arange(slots, device=pos.device)  # (Q, slots)
    ok = (block <= last[:, None]).expand(count, -1, -1)
    lo = (pos - sz.window + 1)[:, None].expand_as(block)
    return block.expand(count, -1, -1), ok, lo


def _pairs(block: Tensor, ok: Tensor, lo: Tensor, pos: Tensor, n: int, blocks: int, sz: Sizes):
    """Tiles of the pairs (count, Q, slots) where ``ok``."""
    count, q = ok.shape[:2]
    item = torch.arange(count, device=ok.device)[:, None, None].expand_as(ok)
    row = item * q + torch.arange(q, device=ok.device)[:, None]
    hi = pos.clamp_max(n - 1)[:, None].expand(q, ok.shape[-1])
    pick = ok.reshape(-1)
    return tiles(
        item.reshape(-1)[pick],
        block.broadcast_to(ok.shape).reshape(-1)[pick],
        row.reshape(-1)[pick],
        lo.broadcast_to(ok.shape).reshape(-1)[pick],
        hi.broadcast_to(ok.shape).reshape(-1)[pick],
        items=count,
        blocks=blocks,
        block_size=sz.select,
        empty=count * q,
        size=TILE,
    )


def _flat(x: Tensor) -> Tensor:
    """(count, Q, f) -> (count·Q + 1, f): the rows, then a row of zeros."""
    flat = x.reshape(-1, x.shape[-1])
    return torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])


class _NSA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kc, vc, gates, rows, q_offset, sz, scale):
        count, m, _ = q.shape
        n, lb = k.shape[1], sz.select
        blocks = -(-n // lb)
        kf, vf = k.reshape(count * n, -1), v.reshape(count * n, -1)
        context = q.new_empty(count, m, v.shape[-1])
        lse = q.new_empty(3, count, m)
        chosen = torch.empty(count, m, min(sz.selected, blocks), dtype=torch.long, device=q.device)
        available = torch.empty(chosen.shape, dtype=torch.bool, device=q.device)
        for chunk in _chunks(q, rows, q_offset, n, sz):
            a, b = chunk.a, chunk.b
            qc = q[:, a:b]
            pos = torch.arange(a, b, device=q.device) + q_offset
            # compressed (eqs. 7-8)
            if chunk.cm:
                e = torch.matmul(qc, kc[:, : chunk.cm].transpose(1, 2)).mul_(scale)
                e = e.masked_fill_(~chunk.seen, float("-inf"))
                top = e.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
                p = e.sub_(top).exp_()
                total = p.sum(-1, keepdim=True)
                has = total > 0
                p = p.div_(total.where(has, 1.0))
                lse[0, :, a:b] = torch.where(has, top + total.where(has, 1.0).log(), 0.0)[..., 0]
                out = torch.matmul(p, vc[:, : chunk.cm]).mul_(gates[:, a:b, 0:1])
            else:
                p = q.new_zeros(count, b - a, 0)
                lse[0, :, a:b] = 0.0
                out = q.new_zeros(count, b - a, v.shape[-1])
            # selection (eqs. 9-11)
            score = importance(p, n, sz)
            if sz.group > 1:  # eq. 10
                grouped = score.unflatten(0, (-1, sz.group)).sum(1, keepdim=True)
                score = grouped.expand(-1, sz.group, -1, -1).flatten(0, 1)
            has_key = None
            if rows is not None:
                part = rows[:, a:b] if rows.shape[1] == m else rows
                part = torch.nn.functional.pad(part, (0, blocks * lb - n), value=False)
                has_key = part.unflatten(-1, (blocks, lb)).any(-1)
            sel, ok = rank_blocks(score, pos, has_key, sz)
            chosen[:, a:b], available[:, a:b] = sel, ok
            qf = _flat(qc)
            zero = pos.new_zeros(())
            for branch, t in ((1, _pairs(sel, ok, zero, pos, n, blocks, sz)), (2, chunk.window)):
                o, branch_lse = tile_forward(
                    qf, kf, vf, t, n=n, block_size=lb, scale=scale, rows=chunk.rows
                )
                lse[branch, :, a:b] = branch_lse.view(count, b - a)
                out += o.view(count, b - a, -1) * gates[:, a:b, branch : branch + 1]
            context[:, a:b] = out
        ctx.save_for_backward(q, k, v, kc, vc, gates, rows, lse, chosen, available)
        ctx.q_offset, ctx.sz, ctx.scale = q_offset, sz, scale
        return context

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, kc, vc, gates, rows, lse, chosen, available = ctx.saved_tensors
        sz, scale, q_offset = ctx.sz, ctx.scale, ctx.q_offset
        count = q.shape[0]
        n, lb = k.shape[1], sz.select
        blocks = -(-n // lb)
        kf, vf = k.reshape(count * n, -1), v.reshape(count * n, -1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kf), torch.zeros_like(vf)
        dkc, dvc, dgates = torch.zeros_like(kc), torch.zeros_like(vc), torch.zeros_like(gates)
        grad = grad.contiguous()
        for chunk in _chunks(q, rows, q_offset, n, sz):
            a, b = chunk.a, chunk.b
            qc, go, g = q[:, a:b], grad[:, a:b], gates[:, a:b]
            pos = torch.arange(a, b, device=q.device) + q_offset
            if chunk.cm:
                kcs, vcs = kc[:, : chunk.cm], vc[:, : chunk.cm]
                e = torch.matmul(qc, kcs.transpose(1, 2)).mul_(scale)
                e = e.sub_(lse[0, :, a:b, None]).masked_fill_(~chunk.seen, float("-inf"))
                p = e.exp_()
                dp = torch.matmul(go, vcs.transpose(1, 2))
                r = (p * dp).sum(-1, keepdim=True)
                dgates[:, a:b, 0] = r[..., 0]
                ds = dp.sub_(r).mul_(p).mul_(g[..., 0:1] * scale)
                dq[:, a:b] += torch.matmul(ds, kcs)
                dkc[:, : chunk.cm] += torch.matmul(ds.transpose(1, 2), qc)
                dvc[:, : chunk.cm] += torch.matmul(p.mul_(g[..., 0:1]).transpose(1, 2), go)
            qf, gf, dqf = _flat(qc), _flat(go), q.new_zeros(count * (b - a) + 1, q.shape[-1])
            zero = pos.new_zeros(())
            sel = _pairs(chosen[:, a:b], available[:, a:b], zero, pos, n, blocks, sz)
            for branch, t in ((1, sel), (2, chunk.window)):
                lse_f = torch.cat([lse[branch, :, a:b].reshape(-1), lse.new_zeros(1)])
                gate_f = torch.cat([g[..., branch].reshape(-1), g.new_zeros(1)])
                r = tile_backward(
                    qf, kf, vf, gf, lse_f, gate_f, t, dqf, dk, dv,
                    n=n, block_size=lb, scale=scale, rows=chunk.rows,
                )  # fmt: skip
                dgates[:, a:b, branch] = r[:-1].view(count, b - a)
            dq[:, a:b] += dqf[:-1].view(count, b - a, -1)
        return dq, dk.view_as(k), dv.view_as(v), dkc, dvc, dgates, None, None, None, None


def _chunks(q: Tensor, rows: Tensor | None, q_offset: int, n: int, sz: Sizes):
    """The chunks of queries, with what both passes need of them."""
    count, m = q.shape[:2]
    slots = sz.selected + -(-sz.window // sz.select) + 1
    step = max(1, min(m, PAIRS // max(1, count * slots)))
    cc = max(0, (n - sz.block) // sz.stride + 1)
    for a in range(0, m, step):
        b = min(m, a + step)
        pos = torch.arange(a, b, device=q.device) + q_offset
        cm = min(cc, max(0, (q_offset + b - 1 - sz.block + 1) // sz.stride + 1))
        starts = torch.arange(cm, device=q.device) * sz.stride
        seen = (starts + sz.block - 1)[None, :] <= pos[:, None]  # (Q, cm) causal
        part = None
        if rows is not None:
            part = rows[:, a:b] if rows.shape[1] == m else rows
            if cm:  # every key of the block may be attended by the row
                covered = part[..., : (cm - 1) * sz.stride + sz.block]
                seen = seen & covered.unfold(-1, sz.block, sz.stride).all(-1)
        block, ok, lo = _window_pairs(pos, count, n, sz)
        window = _pairs(block, ok, lo, pos, n, -(-n // sz.select), sz)
        yield _Chunk(a, b, cm, seen, _rows_lookup(part, b - a, n), window)


def nsa_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kc: Tensor,
    vc: Tensor,
    gates: Tensor,
    rows: Tensor | None,
    q_offset: int,
    sz: Sizes,
    scale: float,
) -> Tensor:
    """The gated NSA context (count, M, d_v) (module docstring).

    Args:
        q: (count, M, d); k, v: (count, N, d), (count, N, d_v), zero where no query reads.
        kc, vc: (count, C, d), (count, C, d_v) the compressed keys and values.
        gates: (count, M, 3) g^cmp, g^slc, g^win.
        rows: (count, M', N) bool (M' = M or 1), the keys each row may read, or None.
        q_offset: the position of the first query (key j sits at j).
        sz: the sizes; ``group`` consecutive items share their selection.
        scale: the factor of the dot products.
    """
    q, k, v = (x.contiguous() for x in (q, k, v))
    return _NSA.apply(q, k, v, kc, vc, gates, rows, q_offset, sz, scale)
