"""NSA's three branches (Yuan et al. 2025, eqs. 5, 7-12) as pieces of PyTorch's fused CPU
attention kernel, merged by their log-sum-exps, with one hand-written backward.

The path for a causal call whose queries are the last keys (query i at position q_offset + i,
q_offset a multiple of l', the last query at the last key), without a mask, on the CPU.
Queries and keys are cut into blocks of l' (the selection block); query block b holds the
queries of key block b. Every (query block, key block) piece that all of its queries read
whole, or read under one fixed pattern, is one batched call of the fused kernel on views of q,
k and v (no copy):

- the diagonal block b (causal): selected (the query's own block is always selected,
  ``num_local`` ≥ 1) and window;
- block b − 1: selected (``num_local`` ≥ 2) and window (w ≥ 2l');
- block 0: selected (``num_initial`` ≥ 1) for the queries whose local blocks do not hold it;
- blocks b − F … b − 2, F = ⌊w/l'⌋ − 1, which the window reads whole: one call on overlapping
  views of the keys;
- the window's edge blocks b − F − 1 … (a fixed mask each); the queries of blocks b ≤ F read
  their whole causal prefix as their window, one masked call.

The other selected blocks (n − 3 per query at the defaults) are gathered: the (query, block)
pairs of a head are sorted by block and cut into tiles of ``TILE`` queries that read one block,
a tile's queries gathered into one (TILE × d) matrix; the tiles go through the fused kernel a
batch at a time. Each call returns its pieces' outputs and log-sum-exps; a branch's output is
their merge, o = Σ_i exp(lse_i − lse) o_i, lse = log Σ_i exp(lse_i) (the pieces of a branch are
disjoint key sets of the query). The compressed branch and the selection (eqs. 7-11) run as in
:mod:`attnkit.sparse_trainable._nsa_chunks`, a chunk of queries at a time. The forward takes
SPAN queries at a time through all of this (selection, pieces, tiles), so that the selected
branch's running merge, the chosen blocks and the sorted pairs it holds grow with SPAN, not
with M.

Kept for the backward: the three log-sum-exps per query and the chosen blocks (int16 where the
blocks fit). The backward recomputes the branch outputs, then hands each piece to the fused
kernel's backward with the merged output and log-sum-exp of its branch (FlashAttention's
backward split over key pieces), so each piece contributes its share of ∂L/∂q, ∂L/∂k, ∂L/∂v.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.sparse_trainable._nsa_chunks import Sizes, importance
from attnkit.sparse_trainable._select import top_indices

__all__ = ["applies", "nsa_blocks"]

FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)
#: queries per gathered tile (rows of one fused call's batch entry)
TILE = 128
#: gathered (query, block) pairs per fused call
BATCH = 1 << 12
#: compressed scores per chunk of queries (numbers)
CHUNK = 1 << 18
#: query rows per chunk of the pieces' calls
PIECES = 1 << 11
#: the compressed branch's products run over a multiple of this many compressed blocks
WIDTH = 16
#: query rows the forward takes to its end at a time (what it holds grows with them)
SPAN = 1 << 13


def applies(q: Tensor, n: int, q_offset: int, rows, sz: Sizes) -> bool:
    """Whether the fused path serves the call (module docstring)."""
    return (
        FLASH is not None
        and FLASH_BACKWARD is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and rows is None
        and q_offset % sz.select == 0
        and q_offset + q.shape[-2] == n
        and sz.local >= 1
        and sz.selected >= sz.initial + sz.local
        and sz.window >= sz.select
        and -(-n // sz.select) < 1 << 31
    )


class _Geometry:
    """Sizes of one call: l', the window's whole blocks F and edge blocks, the first query
    block, the query blocks and their rows."""

    def __init__(self, m: int, n: int, q_offset: int, sz: Sizes) -> None:
        lb = sz.select
        self.lb, self.m, self.n, self.sz = lb, m, n, sz
        self.first = q_offset // lb  # the first query block
        self.last = (n - 1) // lb  # the last query block (may be partial)
        self.full = n // lb  # key blocks of l' keys
        self.whole = sz.window // lb - 1  # F: blocks b − 1 … b − F read whole by the window
        self.edge = -(-(sz.window - 1) // lb)  # E: the window's farthest block b − E
        self.init_from = 2 if sz.local >= 2 else 1  # blocks from which block 0 is a piece
        self.masks: dict[tuple[int, torch.dtype], Tensor] = {}

    def rows(self, b: int) -> int:
        """The first row of query block b."""
        return (b - self.first) * self.lb

    def size(self, b: int) -> int:
        """Rows of query block b (l' but for a partial last block)."""
        return min(self.lb, self.n - b * self.lb)

    def edge_mask(self, t: int, dtype, device) -> Tensor:
        """(l', l') additive mask of the window's edge block b − t: key c of the block (at
        l'(b − t) + c) is read by query r of block b iff l'(b − t) + c ≥ l'b + r − w + 1."""
        key = (t, dtype)
        if key not in self.masks:
            r = torch.arange(self.lb, device=device)
            ok = r[None, :] >= r[:, None] - self.sz.window + 1 + self.lb * t
            zero = torch.zeros((), dtype=dtype, device=device)
            self.masks[key] = torch.where(ok, zero, float("-inf"))
        return self.masks[key]


class _Piece:
    """One fused call over query blocks [b0, b1) (all of l' rows, or the one partial last
    block), reading for block b the keys l'(b − t) … l'(b − t) + length − 1; ``causal`` or an
    additive ``mask`` (rows, length); ``fixed`` keys (start, length) read by every query
    instead; ``branches`` ⊂ {"slc", "win"}."""

    def __init__(
        self,
        b0: int,
        b1: int,
        t: int,
        length: int,
        branches: tuple[str, ...],
        *,
        causal: bool = False,
        mask: Tensor | None = None,
        fixed: bool = False,
    ) -> None:
        self.b0, self.b1, self.t, self.length = b0, b1, t, length
        self.branches, self.causal, self.mask, self.fixed = branches, causal, mask, fixed

    def views(self, geo: _Geometry, x: Tensor, keys: Tensor, values: Tensor):
        """q rows (blocks, 1, rows, d) and the keys and values read (blocks or 1, 1, length, ·)."""
        lb, rows = geo.lb, geo.size(self.b0)
        blocks = self.b1 - self.b0
        r0 = geo.rows(self.b0)
        qv = x[r0 : r0 + blocks * rows].view(blocks, 1, rows, x.shape[-1])
        if self.fixed:
            start = self.t
            kv = [y[start : start + self.length][None, None] for y in (keys, values)]
            return qv.reshape(1, 1, blocks * rows, x.shape[-1]), kv[0], kv[1]
        start = lb * (self.b0 - self.t)
        kv = [
            y.as_strided(
                (blocks, 1, self.length, y.shape[-1]),
                (lb * y.shape[-1], 0, y.shape[-1], 1),
                y.storage_offset() + start * y.shape[-1],
            )
            for y in (keys, values)
        ]
        return qv, kv[0], kv[1]

    def span(self, geo: _Geometry) -> tuple[int, int]:
        r0 = geo.rows(self.b0)
        return r0, r0 + (self.b1 - self.b0) * geo.size(self.b0)

    def has_key(self, geo: _Geometry) -> Tensor | None:
        """(rows,) whether each row of a block reads a key (a fully masked edge row does not)."""
        if self.mask is None:
            return None
        return (self.mask > float("-inf")).any(-1)

    def mask4(self, geo: _Geometry) -> Tensor | None:
        if self.mask is None:
            return None
        return self.mask[: geo.size(self.b0), : self.length][None, None]


def _pieces(geo: _Geometry, c0: int, c1: int, dtype, device) -> list[_Piece]:
    """The pieces of query blocks [c0, c1) (module docstring), each over blocks of one size."""
    sz, lb, f = geo.sz, geo.lb, geo.whole
    spans = []  # runs of query blocks of one size
    end = c1 if c1 - 1 < geo.last or geo.size(geo.last) == lb else c1 - 1
    if end > c0:
        spans.append((c0, end))
    if end < c1:
        spans.append((end, c1))
    out: list[_Piece] = []
    for s0, s1 in spans:
        rows = geo.size(s0)
        # diagonal: always selected; the window's own block once the window is not a prefix
        out.append(_Piece(s0, s1, 0, rows, ("slc", "win") if s0 > f else ("slc",), causal=True))
        if s0 <= f and f + 1 < s1:
            out[-1] = _Piece(s0, f + 1, 0, rows, ("slc",), causal=True)
            out.append(_Piece(f + 1, s1, 0, rows, ("slc", "win"), causal=True))
        # block b − 1
        for a, b, late in ((max(s0, 1), min(s1, f + 1), False), (max(s0, f + 1), s1, True)):
            if a >= b:
                continue
            branches = (("slc",) if sz.local >= 2 else ()) + (("win",) if late and f >= 1 else ())
            if branches:
                out.append(_Piece(a, b, 1, lb, branches))
        # block 0 for the blocks whose local blocks do not hold it
        a = max(s0, geo.init_from)
        if sz.initial >= 1 and a < s1:
            out.append(_Piece(a, s1, 0, lb, ("slc",), fixed=True))
        # the window: whole blocks b − F … b − 2, then the edge blocks
        a = max(s0, f + 1)
        if f >= 2 and a < s1:
            out.append(_Piece(a, s1, f, (f - 1) * lb, ("win",)))
        for t in range(f + 1, geo.edge + 1):
            a = max(s0, t, f + 1)
            if a < s1:
                out.append(_Piece(a, s1, t, lb, ("win",), mask=geo.edge_mask(t, dtype, device)))
        # blocks b ≤ F: the window is the causal prefix
        a, b = s0, min(s1, f + 1)
        if a < b:
            length = min(geo.n, b * lb)
            pos = (torch.arange(a * lb, min(geo.n, b * lb), device=device))[:, None]
            zero = torch.zeros((), dtype=dtype, device=device)
            mask = torch.where(torch.arange(length, device=device) <= pos, zero, float("-inf"))
            out.append(_Prefix(a, b, length, mask))
    return out


class _Prefix(_Piece):
    """The causal prefix of query blocks [b0, b1) as one masked call on keys [0, length)."""

    def __init__(self, b0: int, b1: int, length: int, mask: Tensor) -> None:
        super().__init__(b0, b1, 0, length, ("win",), mask=mask, fixed=True)

    def views(self, geo, x, keys, values):
        r0, r1 = self.span(geo)
        qv = x[r0:r1][None, None]
        return qv, keys[: self.length][None, None], values[: self.length][None, None]

    def span(self, geo):
        return geo.rows(self.b0), min(geo.m, geo.rows(self.b1))

    def mask4(self, geo):
        return self.mask[None, None]


def _flash(piece: _Piece, geo: _Geometry, x, keys, values, scale):
    """(out (rows, d_v), lse (rows,)) of one piece, lse −inf where a row reads no key."""
    qv, kv, vv = piece.views(geo, x, keys, values)
    out, lse = FLASH(qv, kv, vv, 0.0, piece.causal, attn_mask=piece.mask4(geo), scale=scale)[:2]
    out, lse = out.reshape(-1, vv.shape[-1]), lse.reshape(-1)
    has = piece.has_key(geo)
    if has is not None and not isinstance(piece, _Prefix):
        has = has[: geo.size(piece.b0)].repeat(piece.b1 - piece.b0)
        lse = lse.masked_fill(~has, float("-inf"))
        out = out.masked_fill(~has[:, None], 0.0)
    return out, lse


def _flash_backward(piece, geo, x, keys, values, grad, out, lse, scale, dq, dk, dv):
    """Accumulate one piece's share of the gradients, given its branch's merged output and
    log-sum-exp at the piece's rows and the gated gradient ``grad``."""
    qv, kv, vv = piece.views(geo, x, keys, values)
    shape = qv.shape
    lse_v = lse.view(*shape[:-1])
    g, o = grad.view(*shape[:-1], -1), out.view(*shape[:-1], -1)
    gq, gk, gv = FLASH_BACKWARD(
        g, qv, kv, vv, o, lse_v, 0.0, piece.causal, attn_mask=piece.mask4(geo), scale=scale
    )
    r0, r1 = piece.span(geo)
    dq[r0:r1] += gq.reshape(r1 - r0, -1)
    if piece.fixed:
        dk[: piece.length] += gk.reshape(piece.length, -1)
        dv[: piece.length] += gv.reshape(piece.length, -1)
        return
    lb, blocks = geo.lb, piece.b1 - piece.b0
    start = lb * (piece.b0 - piece.t)
    for s in range(0, piece.length, lb):
        width = min(lb, piece.length - s)
        rows = slice(start + s, start + s + blocks * lb) if width == lb else None
        if rows is None:  # a partial diagonal block: one block of width keys
            dk[start + s : start + s + width] += gk[0, 0, s : s + width]
            dv[start + s : start + s + width] += gv[0, 0, s : s + width]
            continue
        dk[rows] += gk[:, 0, s : s + lb].reshape(blocks * lb, -1)
        dv[rows] += gv[:, 0, s : s + lb].reshape(blocks * lb, -1)


#: how far above a row's reference a piece's log-sum-exp may lie before the reference rises
#: (exp(SLACK) stays far from overflow in float32)
SLACK = 30.0


class _Merge:
    """A branch's running merge over rows [0, R): Σ_i exp(lse_i − top) o_i, Σ_i exp(lse_i −
    top) and top; row R takes what belongs to no row. The reference ``top`` rises only when a
    piece's log-sum-exp exceeds it by more than SLACK (it is not the running maximum): the
    sums are exact either way, and the weights stay below exp(SLACK)."""

    def __init__(self, rows: int, dim: int, like: Tensor) -> None:
        self.acc = like.new_zeros(rows + 1, dim)
        self.total = like.new_zeros(rows + 1)
        self.top = like.new_full((rows + 1,), float("-inf"))
        self.top[-1] = 0.0  # the spare row: any finite reference

    def dense(self, r0: int, out: Tensor, lse: Tensor) -> None:
        top = self.top[r0 : r0 + len(lse)]
        new = torch.maximum(top, lse)
        safe = new.masked_fill(new == float("-inf"), 0.0)
        old = (top - safe).exp_()
        w = (lse - safe).exp_()
        acc = self.acc[r0 : r0 + len(lse)]
        acc.mul_(old[:, None]).add_(out * w[:, None])
        self.total[r0 : r0 + len(lse)] = self.total[r0 : r0 + len(lse)] * old + w
        top.copy_(new)

    def scattered(self, rows: Tensor, out: Tensor, lse: Tensor) -> None:
        w = lse - self.top[rows]
        if bool((w <= SLACK).all()):  # no row's reference needs to rise: exp(w) ≤ e^SLACK
            w = w.exp_()
            self.total.index_add_(0, rows, w)
            self.acc.index_add_(0, rows, out.mul_(w[:, None]))
            return
        new = self.top.clone().scatter_reduce_(0, rows, lse, "amax")
        rise = (new > self.top).nonzero()[:, 0]
        if len(rise):
            old = (self.top[rise] - new[rise]).exp_()
            self.acc[rise] *= old[:, None]
            self.total[rise] *= old
            self.top[rise] = new[rise]
        top = self.top[rows]
        w = (lse - top.masked_fill(top == float("-inf"), 0.0)).exp_()
        self.total.index_add_(0, rows, w)
        self.acc.index_add_(0, rows, out.mul_(w[:, None]))

    def result(self) -> tuple[Tensor, Tensor]:
        """(o (R, d), lse (R,)); rows without a key 0."""
        total, top = self.total[:-1], self.top[:-1]
        has = total > 0
        o = self.acc[:-1].div_(total.where(has, 1.0)[:, None])
        lse = torch.where(has, top + total.where(has, 1.0).log(), 0.0)
        return o, lse


class _Known:
    """A branch's merge when its log-sum-exp L is known: Σ_i exp(lse_i − L) o_i."""

    def __init__(self, lse: Tensor, dim: int) -> None:
        self.lse = torch.cat([lse, lse.new_zeros(1)])
        self.acc = lse.new_zeros(len(lse) + 1, dim)

    def dense(self, r0: int, out: Tensor, lse: Tensor) -> None:
        w = (lse - self.lse[r0 : r0 + len(lse)]).exp_()
        self.acc[r0 : r0 + len(lse)] += out * w[:, None]

    def scattered(self, rows: Tensor, out: Tensor, lse: Tensor) -> None:
        w = (lse - self.lse[rows]).exp_()
        self.acc.index_add_(0, rows, out.mul_(w[:, None]))

    def result(self) -> Tensor:
        return self.acc[:-1]


class _Tiles:
    """A head's gathered (query, block) pairs of rows [start, start + R), sorted by block, in
    tiles of TILE queries: ``query`` (tiles·TILE,) rows counted from ``start`` (R, the spare
    row, where a slot is unused), ``block`` (tiles,)."""

    def __init__(self, chosen: Tensor, geo: _Geometry, start: int = 0) -> None:
        m, sz = chosen.shape[0], geo.sz
        device = chosen.device
        first = start + geo.first * geo.lb
        cur = ((torch.arange(m, device=device) + first) // geo.lb)[:, None]
        cur = cur.to(chosen.dtype)
        structural = chosen == cur
        if sz.local >= 2:
            structural |= chosen == cur - 1
        if sz.initial >= 1:
            structural |= (chosen == 0) & (cur >= geo.init_from)
        keep = (chosen >= 0) & ~structural
        del structural
        flat = keep.view(-1).nonzero()[:, 0]  # in row order
        del keep
        block, order = torch.sort(chosen.view(-1)[flat], stable=True)  # rows stay in order
        row = flat[order].div_(chosen.shape[1], rounding_mode="floor").int()
        del flat, order
        counts = torch.bincount(block.int(), minlength=geo.full)
        per = (counts + TILE - 1) // TILE
        first_tile = (per.cumsum(0) - per).int()
        first_pair = (counts.cumsum(0) - counts).int()
        pairs = torch.arange(len(block), device=device, dtype=torch.int32)
        rank = pairs.sub_(torch.repeat_interleave(first_pair, counts, output_size=len(block)))
        slot = torch.repeat_interleave(first_tile, counts, output_size=len(block))
        slot = slot.add_(rank // TILE).mul_(TILE).add_(rank % TILE)
        total = int(per.sum())
        self.query = torch.full((total * TILE,), m, dtype=torch.int32, device=device)
        self.query[slot.long()] = row
        self.block = torch.repeat_interleave(torch.arange(len(per), device=device), per)
        self.rows, self.start = m, start

    def batches(self):
        """(rows counted from ``start``, the rows in the call (a real one for an unused
        slot), blocks) per batch of tiles, int64 (the index kernels take a slower path with
        int32)."""
        step = max(1, BATCH // TILE)
        for t0 in range(0, len(self.block), step):
            t1 = min(len(self.block), t0 + step)
            rows = self.query[t0 * TILE : t1 * TILE].long()
            yield rows, rows.clamp_max(self.rows - 1).add_(self.start), self.block[t0:t1]


def _tile_inputs(x: Tensor, keys: Tensor, values: Tensor, geo: _Geometry, idx, block, unused):
    """The tiles' queries (tiles, 1, TILE, d) at rows ``idx`` and their blocks; unused slots
    hold some query (their results go to the spare row), or 0 where ``unused`` (a mask) is
    given."""
    qt = x.index_select(0, idx).view(len(block), 1, TILE, -1)
    if unused is not None:
        qt.masked_fill_(unused.view(len(block), 1, TILE, 1), 0.0)
    lb = geo.lb
    kb = keys[: geo.full * lb].view(geo.full, lb, keys.shape[-1]).index_select(0, block)
    vb = values[: geo.full * lb].view(geo.full, lb, values.shape[-1]).index_select(0, block)
    kb, vb = kb[:, None], vb[:, None]
    return qt, kb, vb


def _compressed(
    x, kc, vc, geo: _Geometry, a: int, b: int, scale: float, lse=None, *, normalize=True
):
    """The compressed branch for rows [a, b): scores → weights p, lse, output; with ``lse``
    given, the weights from it. With ``normalize`` False p is each row's weights times a
    positive number of the row (exp(e − max e)), enough to rank one head's blocks, and the
    output is normalized instead (an (M × d) pass, not an (M × C) one).

    The columns run to a multiple of ``WIDTH`` where the compressed blocks reach (blocks no
    row has seen, weight 0): products of an odd width run at about half speed."""
    sz = geo.sz
    pos = torch.arange(a, b, device=x.device) + geo.first * geo.lb
    cc = kc.shape[0]
    cm = min(cc, max(0, (int(pos[-1]) - sz.block + 1) // sz.stride + 1))
    if cm:
        cm = min(cc, -(-cm // WIDTH) * WIDTH)
    if cm == 0:
        zero = x.new_zeros(b - a, 0)
        return zero, x.new_zeros(b - a), x.new_zeros(b - a, vc.shape[-1]), cm, pos
    e = torch.matmul(x[a:b] * scale, kc[:cm].transpose(0, 1))
    # blocks every row has seen need no mask: those ending at or before the first row
    every = min(cm, max(0, (int(pos[0]) - sz.block + 1) // sz.stride + 1))
    if every < cm:
        starts = torch.arange(every, cm, device=x.device) * sz.stride
        e[:, every:].masked_fill_((starts + sz.block - 1)[None, :] > pos[:, None], float("-inf"))
    if lse is None:
        top = e.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
        p = e.sub_(top).exp_()
        total = p.sum(-1, keepdim=True)
        has = total > 0
        total = total.where(has, 1.0)
        lse = torch.where(has, top + total.log(), 0.0)[..., 0]
        if normalize:
            p = p.div_(total)
            return p, lse, torch.matmul(p, vc[:cm]), cm, pos
        return p, lse, torch.matmul(p, vc[:cm]).div_(total), cm, pos
    # the backward's recomputation: the weights only
    return e.sub_(lse[:, None]).exp_(), lse, None, cm, pos


def _rank(score: Tensor, pos: Tensor, sz: Sizes) -> tuple[Tensor, Tensor]:
    """:func:`rank_blocks` without a mask, in place on ``score`` (Q, count), the set in any
    order: the forced blocks +inf, the blocks after the query's own −inf, then the top n."""
    inf = float("inf")
    cur = pos // sz.select
    score[:, : sz.initial] = inf
    for t in range(sz.local):  # block cur − t, from the first row (positions ascend) with one
        a = max(0, t * sz.select - int(pos[0]))
        if a < len(pos):
            score[a:].scatter_(1, (cur[a:] - t)[:, None], inf)
    c0 = int(cur[0]) + 1  # blocks before it are no row's future
    after = torch.arange(c0, score.shape[-1], device=pos.device)[None, :] > cur[:, None]
    score[:, c0:].masked_fill_(after, -inf)
    return top_indices(score, sz.selected, ordered=False)


def _chunks(geo: _Geometry, cc: int | None, lo: int = 0, hi: int | None = None):
    """Query rows [lo, hi) (``lo`` a multiple of l') in chunks of whole query blocks: ~CHUNK
    compressed scores each (``cc`` compressed blocks), or with ``cc`` None ~PIECES rows (the
    pieces' calls)."""
    hi = geo.m if hi is None else hi
    per = PIECES if cc is None else CHUNK // max(1, cc)
    per = max(1, per // geo.lb) * geo.lb
    for a in range(lo, hi, per):
        yield a, min(hi, a + per)


def _forward_group(items, geo: _Geometry, scale: float) -> None:
    """The heads of one selection group (NSA eq. 10: their block importances summed), each
    an (x, keys, values, kc, vc, gates, out, lse, chosen): writes the context ``out``
    (M, d_v), ``lse`` (3, M) and, where not None, ``chosen`` (M, n') (−1 where unavailable).

    Runs over spans of SPAN query rows, each to its end (compressed branch and selection,
    pieces, gathered tiles), so that what a span holds (the selected branch's running merge,
    the chosen blocks, the sorted pairs) grows with the span, not with M."""
    span = max(1, SPAN // geo.lb) * geo.lb
    for lo in range(0, geo.m, span):
        _forward_span(items, geo, scale, lo, min(geo.m, lo + span))


def _forward_span(items, geo: _Geometry, scale: float, lo: int, hi: int) -> None:
    """:func:`_forward_group` for query rows [lo, hi) (``lo`` a multiple of l')."""
    sz, dv = geo.sz, items[0][2].shape[-1]
    x0 = items[0][0]
    blocks = -(-geo.n // geo.lb)
    merges = [_Merge(hi - lo, dv, x0) for _ in items]
    kind = torch.int16 if blocks < 1 << 15 else torch.int32
    chosen = torch.empty(hi - lo, min(sz.selected, blocks), dtype=kind, device=x0.device)
    for a, b in _chunks(geo, items[0][3].shape[0], lo, hi):
        c1 = geo.first + -(-b // geo.lb)
        seen = min(geo.n, c1 * geo.lb)  # the chunk's queries rank blocks 0 … c1 − 1 only
        score = None
        for x, _, _, kc, vc, gates, out, lse, _ in items:
            # one head ranks by its own weights up to a factor per row; a group sums
            # normalized weights (eq. 10)
            p, lse_c, o_c, _, pos = _compressed(
                x, kc, vc, geo, a, b, scale, normalize=len(items) > 1
            )
            lse[0, a:b] = lse_c
            out[a:b] = o_c.mul_(gates[a:b, 0:1])
            part = importance(p, seen, sz)  # eq. 9
            score = part if score is None else score.add_(part)
            del p, o_c
        sel, ok = _rank(score, pos, sz)  # eqs. 10-11
        del score
        chosen[a - lo : b - lo, : sel.shape[-1]] = sel.masked_fill_(~ok, -1)
        chosen[a - lo : b - lo, sel.shape[-1] :] = -1
    for a, b in _chunks(geo, None, lo, hi):
        c0, c1 = geo.first + a // geo.lb, geo.first + -(-b // geo.lb)
        pieces = _pieces(geo, c0, c1, x0.dtype, x0.device)
        for (x, keys, values, _, _, gates, out, lse, _), slc in zip(items, merges, strict=True):
            win = _Merge(b - a, dv, x)
            for piece in pieces:
                o, s = _flash(piece, geo, x, keys, values, scale)
                r0, _ = piece.span(geo)
                if "slc" in piece.branches:
                    slc.dense(r0 - lo, o, s)
                if "win" in piece.branches:
                    win.dense(r0 - a, o, s)
                del o, s
            o_w, lse[2, a:b] = win.result()
            del win
            out[a:b] += o_w.mul_(gates[a:b, 2:3])
            del o_w
    tiles = _Tiles(chosen, geo, lo)
    for (x, keys, values, _, _, gates, out, lse, kept), slc in zip(items, merges, strict=True):
        for rows, idx, block in tiles.batches():
            qt, kb, vb = _tile_inputs(x, keys, values, geo, idx, block, None)
            o, s = FLASH(qt, kb, vb, 0.0, False, scale=scale)[:2]
            del qt, kb, vb
            slc.scattered(rows, o.reshape(-1, dv), s.reshape(-1))
            del o, s
        o_s, lse[1, lo:hi] = slc.result()
        out[lo:hi] += o_s.mul_(gates[lo:hi, 1:2])
        if kept is not None:
            kept[lo:hi].copy_(chosen)


def _backward_item(x, keys, values, kc, vc, gates, geo, scale, lse, chosen, grad, d):
    """One head's gradients, accumulated into d = (dq, dk, dv, dkc, dvc, dgates)."""
    dq, dk, dv, dkc, dvc, dgates = d
    width = values.shape[-1]
    slc = _Known(lse[1], width)
    for a, b in _chunks(geo, kc.shape[0]):
        g = gates[a:b]
        p, _, _, cm, _ = _compressed(x, kc, vc, geo, a, b, scale, lse[0, a:b])
        if cm:
            go = grad[a:b]
            dp = torch.matmul(go, vc[:cm].transpose(0, 1))
            r = (p * dp).sum(-1, keepdim=True)
            dgates[a:b, 0] = r[:, 0]
            ds = dp.sub_(r).mul_(p).mul_(g[:, 0:1] * scale)
            dq[a:b] += torch.matmul(ds, kc[:cm])
            dkc[:cm] += torch.matmul(ds.transpose(0, 1), x[a:b])
            dvc[:cm] += torch.matmul(p.mul_(g[:, 0:1]).transpose(0, 1), go)
        else:
            dgates[a:b, 0] = 0.0
        del p
    for a, b in _chunks(geo, None):
        g = gates[a:b]
        c0, c1 = geo.first + a // geo.lb, geo.first + -(-b // geo.lb)
        pieces = _pieces(geo, c0, c1, x.dtype, x.device)
        win = _Known(lse[2, a:b], width)
        for piece in pieces:
            o, s = _flash(piece, geo, x, keys, values, scale)
            r0, _ = piece.span(geo)
            if "slc" in piece.branches:
                slc.dense(r0, o, s)
            if "win" in piece.branches:
                win.dense(r0 - a, o, s)
        o_w = win.result()
        dgates[a:b, 2] = (grad[a:b] * o_w).sum(-1)
        gw = grad[a:b] * g[:, 2:3]
        for piece in pieces:
            if "win" in piece.branches:
                r0, r1 = piece.span(geo)
                args = (gw[r0 - a : r1 - a], o_w[r0 - a : r1 - a], lse[2, r0:r1])
                _flash_backward(piece, geo, x, keys, values, *args, scale, dq, dk, dv)
    tiles = _Tiles(chosen, geo)
    for rows, idx, block in tiles.batches():
        qt, kb, vb = _tile_inputs(x, keys, values, geo, idx, block, None)
        o, s = FLASH(qt, kb, vb, 0.0, False, scale=scale)[:2]
        slc.scattered(rows, o.reshape(-1, width), s.reshape(-1))
    o_s = slc.result()
    dgates[:, 1] = (grad * o_s).sum(-1)
    for a, b in _chunks(geo, None):
        c0, c1 = geo.first + a // geo.lb, geo.first + -(-b // geo.lb)
        for piece in _pieces(geo, c0, c1, x.dtype, x.device):
            if "slc" in piece.branches:
                r0, r1 = piece.span(geo)
                gs = grad[r0:r1] * gates[r0:r1, 1:2]
                args = (gs, o_s[r0:r1], lse[1, r0:r1])
                _flash_backward(piece, geo, x, keys, values, *args, scale, dq, dk, dv)
    lb = geo.lb
    dk_blocks = dk[: geo.full * lb].view(geo.full, lb, dk.shape[-1])
    dv_blocks = dv[: geo.full * lb].view(geo.full, lb, dv.shape[-1])
    for rows, idx, block in tiles.batches():
        unused = rows == tiles.rows
        qt, kb, vb = _tile_inputs(x, keys, values, geo, idx, block, unused)
        shape = qt.shape[:-1]
        unused = unused.view(*shape, 1)
        gt = grad.index_select(0, idx).mul_(gates[idx, 1:2]).view(*shape, -1)
        gq, gk, gv = FLASH_BACKWARD(
            gt.masked_fill_(unused, 0.0), qt, kb, vb, o_s.index_select(0, idx).view(*shape, -1),
            lse[1, idx].view(shape), 0.0, False, scale=scale,
        )  # fmt: skip
        dq.index_add_(0, idx, gq.reshape(-1, dq.shape[-1]))
        dk_blocks.index_add_(0, block, gk[:, 0])
        dv_blocks.index_add_(0, block, gv[:, 0])


class _NSABlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kc, vc, gates, q_offset, sz, scale):
        count, m, _ = q.shape
        n = k.shape[1]
        geo = _Geometry(m, n, q_offset, sz)
        out = q.new_empty(count, m, v.shape[-1])
        lse = q.new_empty(count, 3, m)
        blocks = -(-n // sz.select)
        kind = torch.int16 if blocks < 1 << 15 else torch.int32
        chosen = torch.empty(count, m, min(sz.selected, blocks), dtype=kind, device=q.device)
        for c in range(0, count, sz.group):
            items = [
                (q[i], k[i], v[i], kc[i], vc[i], gates[i], out[i], lse[i], chosen[i])
                for i in range(c, c + sz.group)
            ]
            _forward_group(items, geo, scale)
        ctx.save_for_backward(q, k, v, kc, vc, gates, lse, chosen)
        ctx.q_offset, ctx.sz, ctx.scale = q_offset, sz, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, kc, vc, gates, lse, chosen = ctx.saved_tensors
        geo = _Geometry(q.shape[1], k.shape[1], ctx.q_offset, ctx.sz)
        grads = [torch.zeros_like(x) for x in (q, k, v, kc, vc, gates)]
        for c in range(q.shape[0]):
            # one head's gradient at a time: the incoming one may be a broadcast (of a sum)
            _backward_item(
                q[c], k[c], v[c], kc[c], vc[c], gates[c], geo, ctx.scale, lse[c], chosen[c],
                grad[c].contiguous(), [x[c] for x in grads],
            )  # fmt: skip
        return (*grads, None, None, None)


def nsa_blocks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kc: Tensor,
    vc: Tensor,
    gates: Tensor,
    q_offset: int,
    sz: Sizes,
    scale: float,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """The gated NSA context (count, M, d_v) where :func:`applies` (module docstring).

    Args:
        q: (count, M, d); k, v: (count, N, d), (count, N, d_v), N = q_offset + M.
        kc, vc: (count, C, d), (count, C, d_v) the compressed keys and values.
        gates: (count, M, 3) g^cmp, g^slc, g^win.
        q_offset: the position of the first query, a multiple of l'.
        sz: the sizes; ``group`` consecutive items share their selection.
        scale: the factor of the dot products.
        out: where to write the context without autograd (a (count, M, d_v) tensor whose
            rows are contiguous); with autograd it must be None.
    """
    q, k, v, kc, vc, gates = (x.contiguous() for x in (q, k, v, kc, vc, gates))
    record = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, kc, vc, gates))
    if out is not None and (record or out.stride(-1) != 1 or out.stride(-2) != out.shape[-1]):
        raise ValueError(
            "nsa_blocks writes into out only without autograd and with contiguous rows; got "
            f"out of stride {out.stride()} with autograd {'on' if record else 'off'}"
        )
    if not record:
        count, m, _ = q.shape
        geo = _Geometry(m, k.shape[1], q_offset, sz)
        out = q.new_empty(count, m, v.shape[-1]) if out is None else out
        lse = q.new_empty(3, m)
        for c in range(0, count, sz.group):
            items = [
                (q[i], k[i], v[i], kc[i], vc[i], gates[i], out[i], lse, None)
                for i in range(c, c + sz.group)
            ]
            _forward_group(items, geo, scale)
        return out
    return _NSABlocks.apply(q, k, v, kc, vc, gates, q_offset, sz, scale)
