"""Chunked (memory-efficient) exact attention for every score and every streaming alignment.

FlashAttention's idea (Wikipedia, "FlashAttention"), for any score, not only dot products: the
queries and keys are processed in blocks, so no (M, N, d_w) tensor of an additive score and no
(M, N) weight matrix is ever held whole. Peak memory is O(block_q·block_k·d_w + (M + N)·d).

The kernel knows nothing of particular alignments: it reads the streaming protocol
(:mod:`attnkit.alignments.streaming`). A per-row statistic comes from sweeps over the key blocks
(or one sweep with running rescaling, for alignments that offer it, such as online softmax),
then each block's weights from its scores and the statistic. Statistics and sums are kept in
float32 for float16/bfloat16 inputs (float64 for float64).

The backward pass recomputes each block's scores from the saved per-row statistics and returns
gradients for q, k, v, the bias and every parameter of the score and alignment (via
``torch.autograd.grad`` on the block), so training needs no more memory than inference.

The kernel has two paths (:mod:`attnkit.kernels.paths`), and takes the first that serves a call:
:class:`Fused`, for block-sparse dot-product softmax attention with a constant temperature on
float32/float64 CPU tensors with d_v equal to the queries' and keys' features, when only q, k and
v need gradients (or none does): PyTorch's fused CPU kernel evaluates the pieces of each group of
query blocks, merged by their log-sum-exp, and its backward gives each piece's share of the
gradients from the merged context and log-sum-exp (:func:`_sparse_fused`); and :class:`Tiled`,
the general path, for every call the kernel supports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnkit.alignments import Alignment
from attnkit.alignments.streaming import Streaming
from attnkit.kernels import compiled, dense
from attnkit.kernels.base import Call, Kernel, get, guarded_sum, register
from attnkit.kernels.block_mask import BlockMask, ScoreMod, apply_score_mod
from attnkit.kernels.paths import Path
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = [
    "DENSE_LIMIT",
    "Chunked",
    "Fused",
    "Tiled",
    "attend",
    "default_chunk_size",
    "reasons_not_streamable",
    "supports",
    "tile_width",
]

# Automatic selection evaluates in chunks above this many elements in the dense score tensor(s)
# (B·…·M·N·d_w), when the alignment streams: 2^24 float32 elements = 64 MiB.
DENSE_LIMIT = 1 << 24

# Query blocks of a block mask evaluated together, at most, and the most work the union of their
# key tiles may add over what each visits (a larger tile only pays when it wastes little).
_MAX_GROUP = 8
_GROUP_WASTE = 1.1

# Elements per (block_q, block_k, width) score tile: small tiles for cheap scores (memory),
# larger for wide ones (additive: amortise the per-tile Python overhead).
TILE_ELEMENTS = 1 << 19
WIDE_TILE_ELEMENTS = 1 << 21


def tile_width(score: Score) -> int:
    """Elements per (query, key) pair that a dense evaluation of ``score`` materialises."""
    width = getattr(score, "d_w", None) or 1
    return width * (score.d_out or 1)


def default_chunk_size(n: int, score: Score) -> int:
    """Key block size: large enough to amortise Python overhead, small enough for cache."""
    return max(16, min(n, 1024 if tile_width(score) == 1 else 128))


def reasons_not_streamable(align: Alignment) -> list[str]:
    """Why ``align`` cannot be evaluated block by block (empty when it can)."""
    if not isinstance(align, Streaming):
        return [
            f"the {type(align).__name__} alignment does not implement the streaming protocol "
            "(attnkit.alignments.streaming)"
        ]
    return align.stream_reasons()


def supports(align: Alignment) -> bool:
    """Whether the chunked kernel evaluates ``align`` exactly."""
    return not reasons_not_streamable(align)


def _take(x: Tensor | None, dim: int, start: int, stop: int) -> Tensor | None:
    """x[..., start:stop, ...] along ``dim`` unless that dim is broadcast (size 1)."""
    if x is None or x.shape[dim] == 1:
        return x
    return x.narrow(dim, start, stop - start)


def _rows(x: Tensor | None, q0: int, q1: int, keys: _Keys) -> Tensor | None:
    """The (…, q1−q0, keys) block of a mask or bias broadcastable to (…, M, N)."""
    if x is None or x.dim() == 0:
        return x
    if x.dim() >= 2:
        x = _take(x, -2, q0, q1)
    return keys.take(x, -1)


def _ranges(size: int, total: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, total)) for start in range(0, total, size)]


@dataclass(frozen=True)
class _Keys:
    """The keys of one tile: the range [k0, k1), or positions ``idx`` gathered from several
    tiles (only for scores whose value does not depend on where a key sits)."""

    k0: int
    k1: int
    idx: Tensor | None = None

    def take(self, x: Tensor | None, dim: int) -> Tensor | None:
        """These keys of ``x`` along ``dim`` (a broadcast dim of size 1 stays as it is)."""
        if x is None or x.shape[dim] == 1:
            return x
        if self.idx is None:
            return x.narrow(dim, self.k0, self.k1 - self.k0)
        return x.index_select(dim, self.idx.to(x.device))

    def add(self, target: Tensor, g: Tensor, dim: int) -> None:
        """target[these keys] += g along ``dim`` (summed over a broadcast dim of size 1)."""
        if target.shape[dim] == 1:
            target += g.sum_to_size(target.shape)
            return
        g = g.sum_to_size(self.take(target, dim).shape)
        if self.idx is None:
            target.narrow(dim, self.k0, self.k1 - self.k0).add_(g)
        else:
            target.index_add_(dim, self.idx.to(target.device), g)

    def positions(self, device) -> Tensor:
        if self.idx is None:
            return torch.arange(self.k0, self.k1, device=device)
        return self.idx.to(device)

    def tiles(self, block: int) -> list[int]:
        """The block-mask key tiles these keys come from."""
        if self.idx is None:
            return list(range(self.k0 // block, -(-self.k1 // block)))
        return sorted(set((self.idx // block).tolist()))


# (id(any_allowed of a block mask), block_q, M) -> (weak reference, its query-block groups).
_GROUPS: dict[tuple[int, int, int], tuple[weakref.ref, dict]] = {}


@dataclass
class _Plan:
    """Everything the blocks need that is not a tensor to differentiate.

    Tiles are laid out (…, M_b, N_b), or (…, d_v, M_b, N_b) for a multi-dimensional score (each
    feature aligned across keys, eq. 32), so the key axis is always last for the alignment.
    """

    score: Score
    align: Streaming
    mask: Tensor | None
    has_key: Tensor | None  # (…, M, 1): rows that may attend at least one key
    lead: torch.Size  # the output's batch dims
    multi: bool
    m: int
    n: int
    block_q: int
    block_k: int
    work: torch.dtype  # dtype of statistics and sums
    guard: bool  # a masked value may be non-finite
    block_mask: BlockMask | None = None
    score_mod: ScoreMod | None = None
    span_k: int = 0  # the widest merged key range of a block-sparse tile

    def __post_init__(self) -> None:
        self.groups: dict[int, tuple[int, list[bool], list[bool]]] = {}
        self.pieces: dict[int, list[_Keys]] = {}
        bm = self.block_mask
        if bm is None:
            return
        # The groups depend on the tile flags alone: read once per block mask (a dense mask
        # turned into a block mask on each call shares the flags of the first).
        flags = bm.any_allowed
        key = (id(flags), self.block_q, self.m)
        hit = _GROUPS.get(key)
        if hit is not None and hit[0]() is flags:
            self.groups = hit[1]
            return
        self._group(flags.tolist(), bm.all_allowed.tolist())
        _GROUPS[key] = (weakref.ref(flags), self.groups)
        weakref.finalize(flags, _GROUPS.pop, key, None)

    def _group(self, visit: list[list[bool]], full: list[list[bool]]) -> None:
        """Consecutive query blocks of the block mask evaluated together, with the union of the
        key tiles they visit, as long as the union adds at most a tenth to the work (fewer,
        larger tiles: less per-tile overhead). q0 -> (q1, visited tiles, full tiles)."""
        i = 0
        while i < len(visit):
            rows, union, inter, own = 1, list(visit[i]), list(full[i]), sum(visit[i])
            while i + rows < len(visit) and rows < _MAX_GROUP:
                cand = [a or b for a, b in zip(union, visit[i + rows], strict=True)]
                cost = sum(cand) * (rows + 1)
                if cost > _GROUP_WASTE * (own + sum(visit[i + rows])):
                    break
                union, own = cand, own + sum(visit[i + rows])
                inter = [a and b for a, b in zip(inter, full[i + rows], strict=True)]
                rows += 1
            q0, q1 = i * self.block_q, min((i + rows) * self.block_q, self.m)
            self.groups[q0] = (q1, union, [a and b for a, b in zip(inter, union, strict=True)])
            i += rows

    def q_blocks(self) -> list[tuple[int, int]]:
        if self.groups:
            return [(q0, g[0]) for q0, g in self.groups.items()]
        return _ranges(self.block_q, self.m)

    def k_blocks(self, q0: int | None = None) -> list[_Keys]:
        """Key tiles; with a block mask, only the keys the query block starting at ``q0`` needs:
        adjacent visited tiles merged, and for scores that do not depend on key positions, tiles
        apart gathered into one (fewer, larger tiles: less per-tile overhead), ``span_k`` keys
        at most."""
        if self.block_mask is None or q0 is None:
            return [_Keys(k0, k1) for k0, k1 in _ranges(self.block_k, self.n)]
        if q0 not in self.pieces:
            q1, visit, _ = self.groups[q0]
            self.pieces[q0] = self._pieces(visit, q1 - q0)
        return self.pieces[q0]

    def _pieces(self, visit: list[bool], rows: int) -> list[_Keys]:
        gather = self.score.content_based and not self.score.mixes_keys
        # span_k is sized for one query block; a group of several holds proportionally fewer
        # keys per tile, so that its tiles stay within the tile budget.
        span = max(
            self.block_k, (self.span_k * self.block_q // rows) // self.block_k * self.block_k
        )
        pieces: list[list[tuple[int, int]]] = []
        width = 0
        for j, needed in enumerate(visit):
            if not needed:
                continue
            k0, k1 = j * self.block_k, min((j + 1) * self.block_k, self.n)
            last = pieces[-1] if pieces else None
            fits = last is not None and width + (k1 - k0) <= span
            if fits and (gather or last[-1][1] == k0):
                if last[-1][1] == k0:
                    last[-1] = (last[-1][0], k1)
                else:
                    last.append((k0, k1))
                width += k1 - k0
            else:
                pieces.append([(k0, k1)])
                width = k1 - k0
        # A query block with no allowed key still visits one (fully masked) tile, so that its
        # rows get the alignment's empty-row result.
        if not pieces:
            return [_Keys(0, min(self.block_k, self.n))]
        out = []
        for runs in pieces:
            if len(runs) == 1:
                out.append(_Keys(*runs[0]))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in runs])
                out.append(_Keys(runs[0][0], runs[-1][1], idx))
        return out

    def raw(self, qb: Tensor | None, kb: Tensor, bb: Tensor | None, q0: int, q1: int, keys: _Keys):
        """Scores + bias of query rows [q0, q1) × the keys of ``kb``, in the work dtype."""
        e = compiled.pairwise(self.score)(qb, kb, keys.k0)
        if self.multi:
            e = e.movedim(-1, -3)
        e = e.to(self.work)
        if bb is not None:
            e = e + (bb.unsqueeze(-3) if self.multi else bb).to(self.work)
        rows = (q1 - q0, e.shape[-1])
        e = e.expand(*self.lead, *((e.shape[-3],) if self.multi else ()), *rows)
        if self.score_mod is not None:
            e = apply_score_mod(self.score_mod, e, q0, keys.positions(e.device))
        return e

    def tile_mask(self, q0: int, q1: int, keys: _Keys) -> Tensor | None:
        """The mask of a tile (the call's mask and, unless every block mask tile it spans is
        full, the block mask's)."""
        mask = _rows(self.mask, q0, q1, keys)
        bm = self.block_mask
        if bm is not None:
            full = self.groups[q0][2]
            if not all(full[j] for j in keys.tiles(self.block_k)):
                if keys.idx is None:
                    pattern = bm.tile(q0, q1, keys.k0, keys.k1)
                else:
                    pattern = bm.tile_at(q0, q1, keys.idx, keys.tiles(self.block_k))
                mask = pattern if mask is None else mask & pattern
        return mask

    def prepared(self, e: Tensor, q0: int, q1: int, keys: _Keys) -> Tensor:
        """What the alignment reads: its working units, −inf at masked keys."""
        e = self.align.stream_prepare(e)
        mask = self.tile_mask(q0, q1, keys)
        if mask is not None:
            e = e.masked_fill(~(mask.unsqueeze(-3) if self.multi else mask), float("-inf"))
        return e

    def tile(self, qp, kp, bias, q0: int, q1: int, keys: _Keys) -> Tensor:
        qb = None if qp is None else qp[..., q0:q1, :]
        e = self.raw(qb, keys.take(kp, -2), _rows(bias, q0, q1, keys), q0, q1, keys)
        return self.prepared(e, q0, q1, keys)

    def tiles(self, qp, kp, bias, q0: int, q1: int):
        def sweep() -> Iterator[Tensor]:
            for keys in self.k_blocks(q0):
                yield self.tile(qp, kp, bias, q0, q1, keys)

        return sweep

    def weights(self, e: Tensor, stat: Tensor | None, q0: int, q1: int) -> Tensor:
        p = self.align.stream_weights(e, stat)
        if self.has_key is not None:
            hk = _take(self.has_key, -2, q0, q1)
            p = torch.where(
                hk.unsqueeze(-3) if self.multi else hk, p, torch.zeros((), dtype=p.dtype)
            )
        return p

    # ---- layouts: per-row quantities (…, [d,] M_b, 1) and context rows (…, M_b, d_v) --------

    def to_context(self, x: Tensor) -> Tensor:
        return x.squeeze(-1).transpose(-1, -2) if self.multi else x

    def from_context(self, y: Tensor) -> Tensor:
        return y.transpose(-1, -2).unsqueeze(-1) if self.multi else y.sum(-1, keepdim=True)

    def _combine(self, p: Tensor, vb: Tensor) -> Tensor:
        if self.multi:
            return torch.einsum("...dmn,...nd->...md", p, vb)  # eq. 30
        return torch.matmul(p, vb)  # eq. 4

    def combine(self, p: Tensor, vb: Tensor) -> Tensor:
        """Σ_l p_l v_l over the block: (…, M_b, d_v)."""
        vb = vb.to(self.work)
        return guarded_sum(self._combine, p, vb) if self.guard else self._combine(p, vb)

    def d_weights(self, d_out: Tensor, vb: Tensor) -> Tensor:
        """∂loss/∂p for the block, from ∂loss/∂context."""
        vb = vb.to(self.work)
        if self.guard:
            vb = torch.where(torch.isfinite(vb), vb, torch.zeros((), dtype=vb.dtype))
        if self.multi:
            return torch.einsum("...md,...nd->...dmn", d_out, vb)
        return torch.matmul(d_out, vb.transpose(-1, -2))

    def d_values(self, p: Tensor, d_out: Tensor) -> Tensor:
        if self.multi:
            return torch.einsum("...dmn,...md->...nd", p, d_out)
        return torch.matmul(p.transpose(-1, -2), d_out)


def _forward_rows(plan: _Plan, qp, kp, v, bias, q0, q1) -> tuple[Tensor, Tensor | None]:
    """Context (work dtype) and per-row statistic for query rows [q0, q1)."""
    align = plan.align
    if align.stream_online:
        state = acc = None
        for keys in plan.k_blocks(q0):
            p, rescale, state = align.stream_accumulate(
                plan.tile(qp, kp, bias, q0, q1, keys), state
            )
            part = plan.combine(p, keys.take(v, -2))
            acc = part if acc is None else acc * plan.to_context(rescale) + part
        assert acc is not None and state is not None
        norm, stat = align.stream_finish(state)
        context = acc / plan.to_context(norm)
    else:
        stat = align.stream_statistic(plan.tiles(qp, kp, bias, q0, q1))
        context = None
        for keys in plan.k_blocks(q0):
            p = align.stream_weights(plan.tile(qp, kp, bias, q0, q1, keys), stat)
            part = plan.combine(p, keys.take(v, -2))
            context = part if context is None else context + part
        assert context is not None
    if plan.has_key is not None:
        hk = _take(plan.has_key, -2, q0, q1)
        context = torch.where(hk, context, torch.zeros((), dtype=context.dtype))
    return context, stat


def _correction(plan: _Plan, qp, kp, v, bias, d_out, context, st, q0, q1) -> Tensor | None:
    """c = Σ r ∂L/∂p / Σ r per row (None when keys are not coupled)."""
    if plan.align.stream_weights_are_correction:
        return plan.from_context(d_out * context)  # Σ_l p_l ∂L/∂p_l = ∂L/∂c · c
    num = den = None
    for keys in plan.k_blocks(q0):
        p = plan.weights(plan.tile(qp, kp, bias, q0, q1, keys), st, q0, q1)
        _, r = plan.align.stream_slope(p, st)
        if r is None:
            return None
        dp = plan.d_weights(d_out, keys.take(v, -2))
        a, b = (r * dp).sum(-1, keepdim=True), r.sum(-1, keepdim=True)
        num, den = (a, b) if num is None else (num + a, den + b)
    assert num is not None and den is not None
    return num / torch.where(den > 0, den, torch.ones((), dtype=den.dtype))


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, qp, kp, v, bias, *params):
        contexts, stats = [], []
        with torch.no_grad():
            for q0, q1 in plan.q_blocks():
                c, s = _forward_rows(plan, qp, kp, v, bias, q0, q1)
                contexts.append(c)
                stats.append(s)
        context = torch.cat(contexts, dim=-2)
        stat = None if stats[0] is None else torch.cat(stats, dim=-2)
        ctx.plan = plan
        ctx.save_for_backward(qp, kp, v, bias, context, stat, *params)
        return context.to(v.dtype)

    @staticmethod
    def backward(ctx, d_context):
        plan: _Plan = ctx.plan
        qp, kp, v, bias, context, stat, *params = ctx.saved_tensors
        work = plan.work
        g_qp = None if qp is None else torch.zeros(qp.shape, dtype=work)
        g_kp, g_v = torch.zeros(kp.shape, dtype=work), torch.zeros(v.shape, dtype=work)
        want_bias = bias is not None and ctx.needs_input_grad[4]
        g_bias = torch.zeros(bias.shape, dtype=work) if want_bias else None
        g_params = [torch.zeros(p.shape, dtype=work) for p in params]
        for q0, q1 in plan.q_blocks():
            d_out = d_context[..., q0:q1, :].to(work)
            st = None if stat is None else stat.narrow(-2, q0, q1 - q0)
            with torch.no_grad():
                corr = _correction(plan, qp, kp, v, bias, d_out, context[..., q0:q1, :], st, q0, q1)
            for keys in plan.k_blocks(q0):
                with torch.enable_grad():
                    qb = None if qp is None else qp[..., q0:q1, :].detach().requires_grad_()
                    kb = keys.take(kp, -2).detach().requires_grad_()
                    bb = _rows(bias, q0, q1, keys)
                    if want_bias:
                        bb = bb.detach().requires_grad_()
                    e = plan.prepared(plan.raw(qb, kb, bb, q0, q1, keys), q0, q1, keys)
                with torch.no_grad():
                    p = plan.weights(e.detach(), st, q0, q1)
                    vb = keys.take(v, -2)
                    keys.add(g_v, plan.d_values(p, d_out), -2)
                    dp = plan.d_weights(d_out, vb)
                    s, _ = plan.align.stream_slope(p, st)
                    de = s * dp if corr is None else s * (dp - corr)
                    de = torch.where(torch.isinf(e.detach()), torch.zeros((), dtype=de.dtype), de)
                wrt = [t for t in (qb, kb) if t is not None]
                if want_bias:
                    wrt.append(bb)
                grads = list(torch.autograd.grad(e, [*wrt, *params], de, allow_unused=True))
                g = grads.pop(0) if qb is not None else None
                if g is not None:  # None: a score that ignores the query's content
                    g_qp[..., q0:q1, :] += g.sum_to_size(qb.shape)
                g = grads.pop(0)
                if g is not None:  # None: a score that ignores the keys' content
                    keys.add(g_kp, g, -2)
                if want_bias:
                    rows = _take(g_bias, -2, q0, q1) if g_bias.dim() >= 2 else g_bias
                    keys.add(rows, grads.pop(0), -1)
                for target, g in zip(g_params, grads, strict=True):
                    if g is not None:
                        target += g.sum_to_size(target.shape)

        def back(g: Tensor | None, like: Tensor | None) -> Tensor | None:
            return None if g is None or like is None else g.to(like.dtype)

        return (
            None,
            back(g_qp, qp),
            back(g_kp, kp),
            back(g_v, v),
            back(g_bias, bias),
            *(back(g, p) for g, p in zip(g_params, params, strict=True)),
        )


def _weights(plan: _Plan, qp, kp, v, bias) -> tuple[Tensor, Tensor]:
    """Weights and scores (before alignment, as the dense path returns them), recomputed block
    by block (no gradient)."""
    w_rows, e_rows = [], []
    with torch.no_grad():
        for q0, q1 in plan.q_blocks():
            _, stat = _forward_rows(plan, qp, kp, v, bias, q0, q1)
            ws, es = [], []
            for keys in plan.k_blocks():
                qb = None if qp is None else qp[..., q0:q1, :]
                e = plan.raw(qb, keys.take(kp, -2), _rows(bias, q0, q1, keys), q0, q1, keys)
                ws.append(plan.weights(plan.prepared(e, q0, q1, keys), stat, q0, q1))
                es.append(e)
            w_rows.append(torch.cat(ws, dim=-1))
            e_rows.append(torch.cat(es, dim=-1))
    weights, scores = torch.cat(w_rows, dim=-2), torch.cat(e_rows, dim=-2)
    if plan.multi:
        weights, scores = weights.movedim(-3, -1), scores.movedim(-3, -1)
    return weights.to(v.dtype), scores.to(v.dtype)


def _has_key(mask: Tensor, block_mask: BlockMask) -> Tensor:
    """(…, M, 1): rows with a key that both the mask and the block mask allow (visited tiles
    only: the others hold no allowed pair)."""
    rows = []
    for i, (q0, q1) in enumerate(_ranges(block_mask.block_q, block_mask.m)):
        hit = None
        for j, (k0, k1) in enumerate(_ranges(block_mask.block_k, block_mask.n)):
            if not bool(block_mask.any_allowed[i, j]):
                continue
            both = _rows(mask, q0, q1, _Keys(k0, k1)) & block_mask.tile(q0, q1, k0, k1)
            found = both.any(dim=-1, keepdim=True)
            hit = found if hit is None else hit | found
        if hit is None:
            hit = torch.zeros(q1 - q0, 1, dtype=torch.bool, device=mask.device)
        rows.append(hit)
    shapes = torch.broadcast_shapes(*(r.shape[:-2] for r in rows))
    return torch.cat([r.expand(*shapes, *r.shape[-2:]) for r in rows], dim=-2)


# score_mod -> (additive, relative), read from one trace per function (see _form).
_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _additive(score_mod: ScoreMod) -> bool | None:
    """True when ``score_mod(e, …)`` is ``e + f(b, h, q_idx, kv_idx)`` with f independent of e
    (a relative-position bias such as ALiBi), read from its traced graph: then its effect is the
    additive term f = score_mod(0, …) that the fused kernel adds to its scores. None otherwise
    (a score_mod is a pointwise function of its arguments, as in FlexAttention)."""
    return _form(score_mod)[0] or None


def _relative(score_mod: ScoreMod) -> bool:
    """True when ``score_mod`` is additive (:func:`_additive`) and its traced graph reads
    ``q_idx`` and ``kv_idx`` only through their difference (``kv_idx − q_idx`` or
    ``q_idx − kv_idx``): then f(b, h, q_idx, kv_idx) = g(b, h, kv_idx − q_idx), as for ALiBi
    (Press et al.) and relative position biases, and one evaluation per offset gives every
    tile (a Toeplitz matrix per head)."""
    return all(_form(score_mod))


def _form(score_mod: ScoreMod) -> tuple[bool, bool]:
    """(additive, relative) of ``score_mod``, traced once per function and remembered."""
    try:
        known = _FORMS.get(score_mod)
    except TypeError:  # not weakly referable or not hashable: read it each time
        known = None
    if known is None:
        graph = _trace(score_mod)
        additive = graph is not None and _reads_as_additive(graph)
        known = (additive, additive and _reads_as_relative(graph))
        with contextlib.suppress(TypeError):  # not weakly referable: not kept
            _FORMS[score_mod] = known
    return known


def _trace(score_mod: ScoreMod) -> torch.fx.Graph | None:
    """The graph of ``score_mod`` traced on small inputs, or None when it cannot be traced
    (data-dependent control flow, an unsupported op, ...): then nothing is proved about it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    e = torch.zeros(2, 2, 3, 5)
    b, h = _indices_like(e)
    q_idx = torch.arange(3).view(1, 1, 3, 1)
    kv_idx = torch.arange(5).view(1, 1, 1, 5)
    try:
        return make_fx(score_mod, tracing_mode="real")(e, b, h, q_idx, kv_idx).graph
    except Exception:
        return None


def _reads_as_additive(graph: torch.fx.Graph) -> bool:
    nodes = list(graph.nodes)
    scores = next((n for n in nodes if n.op == "placeholder"), None)
    output = next((n for n in nodes if n.op == "output"), None)
    if scores is None or output is None:
        return False
    result = output.args[0]
    if isinstance(result, (tuple, list)):
        if len(result) != 1:
            return False
        result = result[0]
    if not isinstance(result, torch.fx.Node) or result.target != torch.ops.aten.add.Tensor:
        return False
    if result.kwargs.get("alpha", 1) != 1 or len(result.args) != 2:
        return False
    x, y = result.args
    other = y if x is scores else x if y is scores else None
    if other is None or other is scores:
        return False
    if not isinstance(other, torch.fx.Node):
        return True  # e + constant
    seen, stack = set(), [other]
    while stack:  # f must not read e
        node = stack.pop()
        if node is scores:
            return False
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return True


def _reads_as_relative(graph: torch.fx.Graph) -> bool:
    places = [n for n in graph.nodes if n.op == "placeholder"]
    if len(places) != 5:
        return False
    q_node, kv_node = places[3], places[4]
    for node in (q_node, kv_node):
        for user in node.users:
            if user.target != torch.ops.aten.sub.Tensor or user.kwargs.get("alpha", 1) != 1:
                return False
            if set(user.args) != {q_node, kv_node} or len(user.args) != 2:
                return False
    return True


def _indices_like(e: Tensor) -> tuple[Tensor, Tensor]:
    return (
        torch.arange(e.shape[0]).view(-1, 1, 1, 1),
        torch.arange(e.shape[1]).view(1, -1, 1, 1),
    )


@dataclass
class _Piece:
    """Keys that one fused call of a group of query blocks attends: the block mask's full tiles
    (no mask), its partial ones (their mask), or a square region whose allowed pairs are exactly
    key ≤ query or key ≥ query in its own coordinates (evaluated causally, no mask: the
    kernel then skips the keys above the diagonal)."""

    keys: _Keys
    allowed: Tensor | None = None  # bool (*block-mask lead, rows, keys)
    causal: bool = False
    flip: bool = False  # key ≥ query: evaluated causally on reversed queries and keys
    rows_any: Tensor | None = None  # bool (*lead, rows): rows with an allowed key here
    additive: dict = dataclasses.field(default_factory=dict)  # dtype -> 0 / −inf mask


# Query rows per fused call of a narrow band (:func:`_band_rows`): the kernel's work follows
# each call's key range, which narrows with the rows (measured against 128 and 32 at N = 4096,
# window 256: 64 is the fastest).
_BAND_ROWS = 64
# A group's key tiles form a narrow band (:func:`_narrow`) when they span at most this many
# keys with at most _NARROW full tiles per partial one (measured, N = 8192, d = 64: windows of
# 256 and 512 keys are 10-20 % faster as one masked range; a window of 2048, 4608 keys per
# group of four query blocks, is 25 % slower).
_NARROW_KEYS = 1536
_NARROW = 4
# id(block mask) -> (weak reference, its schedule): the pieces of every query block.
_SCHEDULES: dict[int, tuple[weakref.ref, list]] = {}
# The contents of a dense mask (BlockMask.contents) -> (weak reference to their tile flags, the
# schedule).
_DENSE_SCHEDULES: dict[tuple, tuple[weakref.ref, list]] = {}
# Partial-tile elements whose additive (0 / −inf) masks a schedule keeps.
_ADDITIVE_CACHE_ELEMENTS = 1 << 24


def _schedule(plan: _Plan) -> list[tuple[int, int, list[_Piece]]]:
    """For each group of query blocks of the plan's block mask: its rows and its pieces (built
    once per block mask; the groups depend on the block mask alone)."""
    bm = plan.block_mask
    assert bm is not None
    hit = _SCHEDULES.get(id(bm))
    if hit is not None and hit[0]() is bm:
        return hit[1]
    # A block mask of a dense mask is made again on each call that passes the mask (the tile
    # flags are shared, :func:`attnkit.kernels.block_mask.from_dense_auto`): its schedule is
    # kept by the mask's contents (read on that call) while their flags live, and holds copies
    # of the mask's tiles, not views, so that it neither keeps the mask alive nor sees later
    # changes to it.
    dense_key = bm.contents if bm.dense is not None else None
    if dense_key is not None:
        hit = _DENSE_SCHEDULES.get(dense_key)
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
            and _ranges(bm.block_k, bm.n)[diag[-1]][1] == q1
            and diag[-1] - diag[0] + 1 == len(diag)
        )
        if causal:
            tile = bm.tile(q0, q1, q0, q1)
            tril = torch.ones(q1 - q0, q1 - q0, dtype=torch.bool, device=tile.device).tril()
            causal = bool((tile == tril).all())
        part = [j for j in cols if not full[j] and not (causal and j in diag)]
        pieces = []
        if whole:
            pieces.append(_Piece(_columns(bm, whole)))
        for j in list(part):  # a square tile whose pattern is key ≤ query or key ≥ query
            k0, k1 = _ranges(bm.block_k, bm.n)[j]
            if k1 - k0 != q1 - q0:
                continue
            tile = bm.tile(q0, q1, k0, k1)
            ones = torch.ones(q1 - q0, q1 - q0, dtype=torch.bool, device=tile.device)
            for flip, shape in ((False, ones.tril()), (True, ones.triu())):
                if bool((tile == shape).all()):
                    pieces.append(_Piece(_Keys(k0, k1), causal=True, flip=flip))
                    part.remove(j)
                    break
        if part:
            keys = _columns(bm, part)
            if keys.idx is None:
                allowed = bm.tile(q0, q1, keys.k0, keys.k1)
            else:
                allowed = bm.tile_at(q0, q1, keys.idx, part)
            rows_any = allowed.any(-1)
            empty_rows = None if bool(rows_any.all()) else rows_any
            pieces.append(_Piece(keys, allowed, rows_any=empty_rows))
        if causal:
            pieces.append(_Piece(_Keys(q0, q1), causal=True))
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
        _DENSE_SCHEDULES[dense_key] = (weakref.ref(bm.any_allowed), out)
        weakref.finalize(bm.any_allowed, _DENSE_SCHEDULES.pop, dense_key, None)
        return out
    _SCHEDULES[id(bm)] = (weakref.ref(bm), out)
    weakref.finalize(bm, _SCHEDULES.pop, id(bm), None)
    return out


def _narrow(cols: list[int], whole: list[int], block_k: int) -> bool:
    """Whether a group's visited key tiles ``cols`` (``whole`` of them full) are better
    evaluated as one masked range, :func:`_band_rows`: adjacent, at most _NARROW_KEYS keys, and
    at most _NARROW full tiles per partial one (a band's few tiles, where the fixed cost of
    each call and merge outweighs the mask; a long run of full tiles is cheaper unmasked)."""
    adjacent = cols[-1] - cols[0] + 1 == len(cols)
    short = len(cols) * block_k <= _NARROW_KEYS
    return adjacent and short and len(whole) <= _NARROW * (len(cols) - len(whole))


def _band_rows(bm: BlockMask, q0: int, q1: int, cols: list[int]) -> list:
    """Rows [q0, q1) against the adjacent key tiles ``cols`` in calls of _BAND_ROWS rows, each
    with its keys cut to the first and last it may attend (a band's rows need fewer keys than
    the tiles hold) and its mask: (r0, r1, [piece]) per call."""
    keys = _columns(bm, cols)
    allowed = bm.tile(q0, q1, keys.k0, keys.k1)
    out = []
    for r0 in range(q0, q1, _BAND_ROWS):
        r1 = min(r0 + _BAND_ROWS, q1)
        rows = allowed[..., r0 - q0 : r1 - q0, :]
        seen = rows.reshape(-1, rows.shape[-1]).any(0).nonzero()
        if seen.numel() == 0:  # no allowed key: the rows' empty result
            out.append((r0, r1, []))
            continue
        c0, c1 = int(seen[0]), int(seen[-1]) + 1
        rows = rows[..., c0:c1]
        rows_any = rows.any(-1)
        empty = None if bool(rows_any.all()) else rows_any
        piece = _Piece(_Keys(keys.k0 + c0, keys.k0 + c1), rows, rows_any=empty)
        out.append((r0, r1, [piece]))
    return out


def _columns(bm: BlockMask, columns: list[int]) -> _Keys:
    """The keys of the key tiles ``columns`` (a range when they are adjacent)."""
    runs = [(j * bm.block_k, min((j + 1) * bm.block_k, bm.n)) for j in columns]
    if columns[-1] - columns[0] + 1 == len(columns):
        return _Keys(runs[0][0], runs[-1][1])
    return _Keys(runs[0][0], runs[-1][1], torch.cat([torch.arange(a, b) for a, b in runs]))


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)
# Elements of additive tiles of a relative score_mod one call keeps for reuse (tiles that sit
# at the same offset from the diagonal are equal).
_RELATIVE_CACHE_ELEMENTS = 1 << 22


def _flat(x: Tensor, shape: torch.Size) -> Tensor:
    """x (*shape, a, b) as (1, prod(shape), a, b), the fused kernel's layout (a mask of one
    (a, b) for every batch entry stays (1, 1, a, b): the kernel broadcasts it)."""
    if x.dim() == 4 and len(shape) == 2 and shape[0] == 1 and x.shape[:2] == shape:
        return x
    if x.dim() == 2:
        return x.view(1, 1, *x.shape)
    return x.expand(*shape, *x.shape[-2:]).reshape(1, max(1, math.prod(shape)), *x.shape[-2:])


def _fused_piece(qb, kb, vb, attn_mask, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Context and log-sum-exp (…, rows) of one piece, from PyTorch's fused CPU kernel."""
    shape = qb.shape[:-2]
    if attn_mask is not None:
        attn_mask = _flat(attn_mask, shape)
    out, lse = _FLASH(
        _flat(qb, shape),
        _flat(kb, shape),
        _flat(vb, shape),
        0.0,
        causal,
        attn_mask=attn_mask,
        scale=scale,
    )
    if out.shape[:-2] == shape:  # already (1, H, …): no reshape
        return out, lse
    return out.reshape(*shape, *out.shape[-2:]), lse.reshape(*shape, lse.shape[-1])


def _fused_piece_backward(d_out, qb, kb, vb, out, lse, attn_mask, causal: bool, scale: float):
    """Gradients (q, k, v) of one piece, from the fused kernel's backward given the merged
    context ``out`` and log-sum-exp ``lse`` of all pieces: the weights it recomputes,
    exp(s − lse), are then the softmax over every key of the row, and Σ_l p_l ∂L/∂p_l is read
    from the merged context (∂L/∂c · c), so each piece's gradients are its share of the
    whole (FlashAttention's backward, split over key pieces)."""
    shape = qb.shape[:-2]
    if attn_mask is not None:
        attn_mask = _flat(attn_mask, shape)
    grads = _FLASH_BACKWARD(
        _flat(d_out, shape),
        _flat(qb, shape),
        _flat(kb, shape),
        _flat(vb, shape),
        _flat(out, shape),
        lse.expand(*shape, lse.shape[-1]).reshape(1, max(1, math.prod(shape)), lse.shape[-1]),
        0.0,
        causal,
        attn_mask=attn_mask,
        scale=scale,
    )
    return tuple(g.reshape(*shape, *g.shape[-2:]) for g in grads)


@dataclass
class _PieceCall:
    """The arguments of one fused call: its keys, its additive mask, causal or not; ``flip``:
    key ≥ query evaluated causally on reversed queries and keys (the mask given in order);
    ``reverse``: the queries are reversed for the call and ``attn_mask`` is already laid out for
    reversed queries (a view of a relative score_mod's offsets)."""

    keys: _Keys
    attn_mask: Tensor | None
    causal: bool
    flip: bool
    reverse: bool
    rows_any: Tensor | None


@dataclass
class _Fused:
    """What every fused call of one block-sparse evaluation shares."""

    plan: _Plan
    lead: torch.Size
    dtype: torch.dtype
    bias: Tensor | None
    inv_t: float
    scale: float  # the kernel's scale: the score's scale over the temperature
    cache: bool = False  # keep the pieces' 0 / −inf masks on the schedule
    # A score_mod e + f(b, h, kv_idx − q_idx): f · inv_t at every offset, (*lead, 1, M + N − 1),
    # entry M − 1 + (kv_idx − q_idx).
    relative: Tensor | None = None
    tiles: dict = dataclasses.field(default_factory=dict)  # (k0 − q1, rows, keys) -> tile
    kept: int = 0

    def __post_init__(self) -> None:
        plan = self.plan
        self.neg = torch.tensor(float("-inf"), dtype=self.dtype)
        schedule = _schedule(plan)
        kept = sum(p.allowed.numel() for _, _, ps in schedule for p in ps if p.allowed is not None)
        self.cache = (
            plan.mask is None
            and self.bias is None
            and plan.score_mod is None
            and kept <= _ADDITIVE_CACHE_ELEMENTS
        )
        if plan.score_mod is not None and self.bias is None and _relative(plan.score_mod):
            width = plan.m + plan.n - 1
            zeros = torch.zeros((), dtype=self.dtype).expand(*self.lead, 1, width)
            keys = torch.arange(width, device=zeros.device)
            f = apply_score_mod(plan.score_mod, zeros, plan.m - 1, keys)
            self.relative = (f * self.inv_t if self.inv_t != 1.0 else f).contiguous()

    def _relative_reversed(self, q0: int, q1: int, k0: int, k1: int) -> Tensor:
        """f · inv_t of rows [q1 − 1, …, q0] (reversed) and keys [k0, k1): a view, since entry
        (r, c) sits at offset k0 + c − q1 + 1 + r, one step further for each step in r or c."""
        g = self.relative
        assert g is not None
        return g.as_strided(
            (*g.shape[:-2], q1 - q0, k1 - k0),
            (*g.stride()[:-2], 1, 1),
            g.storage_offset() + k0 - q1 + self.plan.m,
        )

    def _relative_tile(self, q0: int, q1: int, keys: _Keys) -> Tensor:
        """f · inv_t of rows [q0, q1) at these keys, rows in order (kept for reuse: tiles at the
        same offset from the diagonal are equal)."""
        g = self.relative
        assert g is not None
        if keys.idx is not None:
            offsets = keys.idx[None, :] - torch.arange(q0, q1)[:, None] + (self.plan.m - 1)
            return g[..., 0, :][..., offsets.to(g.device)]
        key = (keys.k0 - q1, q1 - q0, keys.k1 - keys.k0)
        tile = self.tiles.get(key)
        if tile is None:
            tile = self._relative_reversed(q0, q1, keys.k0, keys.k1).flip(-2)
            if self.kept + tile.numel() <= _RELATIVE_CACHE_ELEMENTS:
                self.tiles[key] = tile
                self.kept += tile.numel()
        return tile

    def call(self, q0: int, q1: int, piece: _Piece) -> _PieceCall:
        """The fused call of one piece of the query rows [q0, q1)."""
        plan, bias, dtype = self.plan, self.bias, self.dtype
        keys, allowed, rows_any = piece.keys, piece.allowed, piece.rows_any
        causal, flip, reverse = piece.causal, piece.flip, False
        if causal and plan.mask is not None:
            # the triangle as a mask, beside the call's own mask (an additive mask alone goes
            # with the causal evaluation)
            base = torch.ones(q1 - q0, q1 - q0, dtype=torch.bool)
            allowed, causal, flip = (base.triu() if flip else base.tril()), False, False
        if plan.mask is not None:  # the call's own mask: every piece is masked
            call = _rows(plan.mask, q0, q1, keys)
            allowed = call if allowed is None else allowed & call
            rows_any = allowed.any(-1)
        attn_mask = None
        neg = self.neg
        if self.relative is not None:
            if allowed is None and not causal and keys.idx is None:
                attn_mask, reverse = self._relative_reversed(q0, q1, keys.k0, keys.k1), True
            else:
                add = self._relative_tile(q0, q1, keys)
                attn_mask = add if allowed is None else torch.where(allowed, add, neg)
        elif bias is not None or plan.score_mod is not None:
            width = keys.k1 - keys.k0 if keys.idx is None else keys.idx.numel()
            rows = (*self.lead, q1 - q0, width)
            base = torch.zeros((), dtype=dtype) if bias is None else _rows(bias, q0, q1, keys)
            if plan.score_mod is not None:  # bias + f in one pass (f = score_mod(0) - 0)
                base = base.to(dtype).expand(rows)
                add = apply_score_mod(plan.score_mod, base, q0, keys.positions(base.device))
                if self.inv_t != 1.0:
                    add.mul_(self.inv_t)  # a fresh tensor: score_mod is e + f
            else:
                add = base if self.inv_t == 1.0 else base * self.inv_t
            if allowed is None:
                attn_mask = add
            elif plan.score_mod is not None:
                attn_mask = add.masked_fill_(~allowed, float("-inf"))
            else:
                attn_mask = torch.where(allowed, add, neg)
        elif allowed is not None:
            attn_mask = piece.additive.get(dtype) if piece.allowed is allowed else None
            if attn_mask is None:
                attn_mask = torch.where(allowed, torch.zeros((), dtype=dtype), neg)
                if self.cache and piece.allowed is allowed:
                    piece.additive[dtype] = attn_mask
        return _PieceCall(keys, attn_mask, causal, flip, reverse, rows_any)


def _order(call: _PieceCall, *rows: Tensor) -> list[Tensor]:
    """Query-side tensors (…, rows, ·) in the order the call evaluates them."""
    return [x.flip(-2) if call.flip or call.reverse else x for x in rows]


def _fused_context(fused: _Fused, qp, kp, v, keep_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Context (…, M, d_v) and, with ``keep_lse``, the log-sum-exp of every row (−inf for a row
    with no key) of block-sparse softmax attention, piece by piece through the fused kernel."""
    plan, lead, dtype = fused.plan, fused.lead, fused.dtype
    qp, kp, v = (x.expand(*lead, *x.shape[-2:]) for x in (qp, kp, v))
    outs, totals = [], []
    for q0, q1, pieces in _schedule(plan):
        qb = qp[..., q0:q1, :]
        parts = []
        for piece in pieces:
            call = fused.call(q0, q1, piece)
            kb, vb = call.keys.take(kp, -2), call.keys.take(v, -2)
            attn_mask = call.attn_mask
            if call.flip:  # key ≥ query is key' ≤ query' on reversed positions
                kb, vb = kb.flip(-2), vb.flip(-2)
                attn_mask = None if attn_mask is None else attn_mask.flip(-2, -1)
            (q_in,) = _order(call, qb)
            out, lse = _fused_piece(q_in, kb, vb, attn_mask, call.causal, fused.scale)
            if call.flip or call.reverse:
                out, lse = out.flip(-2), lse.flip(-1)
            if call.rows_any is not None:  # a row with no key in this piece: weight 0
                lse = torch.where(call.rows_any, lse, float("-inf"))
                out = out.masked_fill(~call.rows_any.unsqueeze(-1), 0.0)
            parts.append((out, lse if lse.dtype == plan.work else lse.to(plan.work)))
        if not parts:  # a group with no allowed key
            acc = v.new_zeros(*lead, q1 - q0, v.shape[-1])
            total = torch.full((*lead, q1 - q0), float("-inf"), dtype=plan.work)
        elif len(parts) == 1:
            acc, total = parts[0]
        else:  # the online softmax's merge: each piece weighted by exp(lse − total)
            total = torch.logsumexp(torch.stack([lse for _, lse in parts]), dim=0)
            acc = None
            for out, lse in parts:
                w = torch.exp(lse - total).unsqueeze(-1).to(dtype)
                acc = out * w if acc is None else acc.addcmul_(out, w)
        outs.append(acc)
        totals.append(total)
    context = torch.cat(outs, dim=-2)
    if plan.has_key is not None and not _all(plan.has_key):  # rows with no key: context 0
        context = torch.where(plan.has_key, context, torch.zeros((), dtype=context.dtype))
    return context, (torch.cat(totals, dim=-1) if keep_lse else None)


def _fused_setup(plan: _Plan, q, k, v, bias, score: Score, align: Alignment):
    temperature = align.softmax_temperature()
    assert temperature is not None and plan.block_mask is not None and _FLASH is not None
    qp, kp, scale = score.dot_form(q, k)
    inv_t = 1.0 / temperature
    lead = torch.broadcast_shapes(plan.lead, qp.shape[:-2], kp.shape[:-2])
    fused = _Fused(plan, lead, v.dtype, bias, inv_t, scale * inv_t)
    return fused, qp, kp


def _sparse_fused(plan: _Plan, q, k, v, bias, score: Score, align: Alignment) -> Tensor:
    """Block-sparse dot-product softmax attention, forward only, through PyTorch's fused CPU
    kernel: each query block attends its full key tiles with no mask, its partial tiles with
    their mask, and a causal diagonal tile causally; the pieces are merged by their log-sum-exp
    (the online softmax of eq. 4, FlashAttention). An additive score_mod (``e + f``) and the
    bias enter as the kernel's additive mask; a score_mod whose f reads the positions only as
    kv_idx − q_idx (ALiBi, relative biases) is evaluated once per offset and each piece reads
    a view of it. Same result as the tiled path."""
    fused, qp, kp = _fused_setup(plan, q, k, v, bias, score, align)
    return _fused_context(fused, qp, kp, v, keep_lse=False)[0]


def _sparse_fused_grad(plan: _Plan, q, k, v, bias, score: Score, align: Alignment) -> Tensor:
    """:func:`_sparse_fused` with a backward through the fused kernel's backward, piece by
    piece (gradients for q, k and v)."""
    fused, qp, kp = _fused_setup(plan, q, k, v, bias, score, align)
    return _FusedAttention.apply(fused, qp, kp, v)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fused: _Fused, qp, kp, v):
        with torch.no_grad():
            context, lse = _fused_context(fused, qp, kp, v, keep_lse=True)
        ctx.fused = fused
        ctx.save_for_backward(qp, kp, v, context, lse)
        return context

    @staticmethod
    def backward(ctx, d_context):
        fused: _Fused = ctx.fused
        qp, kp, v, context, lse = ctx.saved_tensors
        lead, dtype = fused.lead, fused.dtype
        q_, k_, v_ = (x.expand(*lead, *x.shape[-2:]) for x in (qp, kp, v))
        d_context = d_context.to(dtype).expand(context.shape)
        # A row with no key has weight 0 everywhere: exp(s − ∞) = 0.
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        g_q, g_k, g_v = (torch.zeros(x.shape, dtype=dtype) for x in (q_, k_, v_))
        for q0, q1, pieces in _schedule(fused.plan):
            rows = [x[..., q0:q1, :] for x in (q_, d_context, context)]
            lb = lse[..., q0:q1]
            for piece in pieces:
                call = fused.call(q0, q1, piece)
                kb, vb = call.keys.take(k_, -2), call.keys.take(v_, -2)
                attn_mask = call.attn_mask
                if call.flip:
                    kb, vb = kb.flip(-2), vb.flip(-2)
                    attn_mask = None if attn_mask is None else attn_mask.flip(-2, -1)
                qb, db, ob = _order(call, *rows)
                lr = lb.flip(-1) if call.flip or call.reverse else lb
                gq, gk, gv = _fused_piece_backward(
                    db, qb, kb, vb, ob, lr.to(lse.dtype), attn_mask, call.causal, fused.scale
                )
                if call.flip or call.reverse:
                    gq = gq.flip(-2)
                if call.flip:
                    gk, gv = gk.flip(-2), gv.flip(-2)
                g_q[..., q0:q1, :] += gq
                call.keys.add(g_k, gk, -2)
                call.keys.add(g_v, gv, -2)
        return (
            None,
            g_q.sum_to_size(qp.shape),
            g_k.sum_to_size(kp.shape),
            g_v.sum_to_size(v.shape),
        )


# id(has_key of a block mask) -> (weak reference, whether every row has a key).
_ALL: dict[int, tuple[weakref.ref, bool]] = {}


def _all(has_key: Tensor) -> bool:
    """``bool(has_key.all())``, read once per tensor (a block mask's is reused by every call)."""
    hit = _ALL.get(id(has_key))
    if hit is not None and hit[0]() is has_key:
        return hit[1]
    found = bool(has_key.all())
    _ALL[id(has_key)] = (weakref.ref(has_key), found)
    weakref.finalize(has_key, _ALL.pop, id(has_key), None)
    return found


def _finite(v: Tensor) -> bool:
    """Whether every value is finite: one reduction (a NaN or infinity makes the sum
    non-finite; a sum that overflows only sends the call to the guarded path)."""
    return bool(torch.isfinite(v.sum())) or bool(torch.isfinite(v).all())


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def attend(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    score: Score,
    align: Alignment,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    need_weights: bool = False,
    chunk_size: int | None = None,
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
    finite: bool = False,
) -> AttentionOutput:
    """Evaluate attention block by block; inputs are assumed validated.

    ``chunk_size`` is the key block size (default :func:`default_chunk_size`); query blocks are
    sized so that a score tile holds about 2¹⁹ elements (2²¹ for wide scores such as
    additive). A ``block_mask`` sets both block sizes, and tiles it marks empty are skipped,
    forward and backward. ``score_mod(e, b, h, q_idx, kv_idx)`` modifies each tile's scores
    (after the bias), differentiably; an ``nn.Module`` score_mod's parameters get gradients.
    With ``need_weights`` the weights and scores are recomputed block by block into (…, M, N)
    tensors, without gradient. ``finite=True`` says the caller knows every value the mask
    leaves in is finite and the masked ones are zero (the call's ``masked_finite``), so the
    values are not scanned for the guarded path.

    The call is evaluated on the kernel's first path that serves it (the fused block-sparse
    path, then the tiled one; :mod:`attnkit.kernels.paths`).
    """
    reasons = reasons_not_streamable(align)
    if reasons:
        raise ValueError("chunked evaluation: " + "; ".join(reasons))
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if score_mod is not None and score.multi_dimensional:
        raise ValueError("score_mod applies to single-dimensional scores (…, M, N) only")
    if score.mixes_keys and (mask is not None or block_mask is not None):
        raise ValueError(
            f"chunked evaluation: score {type(score).__name__} mixes neighbouring keys and must "
            "see the whole mask at once; evaluate it with the dense kernel"
        )
    if block_mask is not None and chunk_size is not None and chunk_size != block_mask.block_k:
        raise ValueError(
            f"chunk_size={chunk_size} differs from the block mask's key block "
            f"{block_mask.block_k}; leave chunk_size out"
        )
    mask, bias = _rank2(mask), _rank2(bias)
    lead, m, n = _sizes(q, k, v, mask, bias)
    call = Call(
        q,
        k,
        v,
        score,
        align,
        torch.Size((*lead, m, n)),
        mask=mask,
        bias=bias,
        need_weights=need_weights,
        chunk_size=chunk_size,
        block_mask=block_mask,
        score_mod=score_mod,
        masked_finite=finite,
    )
    path = get("chunked").choose_path(call)
    assert path is not None
    return path.attend(call)


def _rank2(x: Tensor | None) -> Tensor | None:
    """A mask or bias of rank < 2 with the (…, M, N) rank (it broadcasts over rows and keys)."""
    if x is None or x.dim() >= 2:
        return x
    return x.reshape((1,) * (2 - x.dim()) + tuple(x.shape))


def _sizes(q, k, v, mask, bias) -> tuple[torch.Size, int, int]:
    """The output's batch dims (values, masks and biases may carry more than q and k do), M, N."""
    lead = torch.broadcast_shapes(
        k.shape[:-2],
        () if q is None else q.shape[:-2],
        v.shape[:-2],
        *(x.shape[:-2] for x in (mask, bias) if x is not None and x.dim() > 2),
    )
    return lead, 1 if q is None else q.shape[-2], k.shape[-2]


def _evaluate(call: Call, fused: bool) -> AttentionOutput:
    """Evaluate ``call`` on the fused block-sparse path (``fused``) or the tiled one; the
    caller has checked that the path serves the call."""
    q, k, v, score, align = call.parts()
    mask, bias, block_mask = _rank2(call.mask), _rank2(call.bias), call.block_mask
    lead, m, n = _sizes(q, k, v, mask, bias)
    if m == 0 or n == 0 or math.prod(lead) == 0 or v.shape[-1] == 0:
        # Nothing to stream; the dense path returns the empty result with its autograd graph.
        return dense.attend(
            q,
            k,
            v,
            score,
            align,
            mask=mask,
            bias=bias,
            need_weights=call.need_weights,
            block_mask=block_mask,
            score_mod=call.score_mod,
        )
    assert isinstance(align, Streaming)
    if block_mask is not None:
        block_q, block_k = block_mask.block_q, block_mask.block_k
        # Adjacent visited tiles merge into one as long as it holds about a tile budget.
        per_key = block_q * tile_width(score) * max(1, math.prod(lead))
        budget = TILE_ELEMENTS if tile_width(score) == 1 else WIDE_TILE_ELEMENTS
        span_k = max(block_k, (budget // per_key) // block_k * block_k)
    else:
        span_k = 0
        chunk = call.chunk_size
        block_k = min(default_chunk_size(n, score) if chunk is None else chunk, n)
        per_row = block_k * tile_width(score) * max(1, math.prod(lead))
        budget = TILE_ELEMENTS if tile_width(score) == 1 else WIDE_TILE_ELEMENTS
        block_q = max(1, min(m, budget // per_row))
    has_key = None if mask is None else mask.any(dim=-1, keepdim=True)
    if block_mask is not None:
        has_key = block_mask.has_key if mask is None else _has_key(mask, block_mask)
    masked = mask is not None or block_mask is not None
    plan = _Plan(
        score=score,
        align=align,
        mask=mask,
        has_key=has_key,
        lead=lead,
        multi=score.multi_dimensional,
        m=m,
        n=n,
        block_q=block_q,
        block_k=block_k,
        work=_work_dtype(v.dtype),
        guard=masked and not fused and not call.masked_finite and not _finite(v),
        block_mask=block_mask,
        score_mod=call.score_mod,
        span_k=span_k,
    )
    if fused:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
            return AttentionOutput(_sparse_fused_grad(plan, q, k, v, bias, score, align))
        return AttentionOutput(_sparse_fused(plan, q, k, v, bias, score, align))
    qp = score.project_query(q)
    kp = score.project_key(k)
    score_mod = call.score_mod
    mod_params = score_mod.parameters() if isinstance(score_mod, nn.Module) else ()
    params = [p for p in (*score.parameters(), *align.parameters(), *mod_params) if p.requires_grad]
    # A strided v (heads split off by a transpose) would be copied by every tile's matmuls.
    context = _Chunked.apply(plan, qp, kp, v.contiguous(), bias, *params)
    if not call.need_weights:
        return AttentionOutput(context)
    weights, scores = _weights(plan, qp, kp, v, bias)
    return AttentionOutput(context, weights, scores)


class Fused(Path):
    """Block-sparse dot-product softmax attention through PyTorch's fused CPU kernel, piece by
    piece, merged by the log-sum-exp (:func:`_sparse_fused`); gradients for q, k and v through
    the fused kernel's backward (:func:`_sparse_fused_grad`). Same result as the tiled path."""

    kernel = "chunked"
    name = "fused"
    supports_dtypes = frozenset({torch.float32, torch.float64})
    supports_devices = frozenset({"cpu"})
    needs_dot_product_score = True
    needs_equal_head_sizes = True  # the fused kernel wants one head size for q, k and v
    supports_multi_dimensional = False
    needs_softmax = True
    returns_weights = False
    needs_block_mask = True
    gradients = "inputs"
    runs_compiled = False

    def extra_reasons(self, call: Call) -> list[str]:
        """The fused kernel's presence, a score_mod of the form e + f, one dtype, and (only
        when nothing else refuses: it reads the tensors) finite keys and masked values (the
        pieces add the mask to the scores, and NaN + −inf is NaN)."""
        label = self.label
        reasons = []
        if _FLASH is None:
            reasons.append(
                f"{label} needs torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"
            )
        if call.score_mod is not None and _additive(call.score_mod) is None:
            reasons.append(f"{label} takes a score_mod of the form e + f(b, h, q_idx, kv_idx) only")
        dtypes = {t.dtype for t in (call.q, call.k, call.v) if t is not None}
        if len(dtypes) > 1:
            reasons.append(f"{label} takes q, k and v of one dtype")
        if call.bias is not None and call.bias.dtype != call.v.dtype:
            reasons.append(
                f"{label} takes a bias of the values' dtype {call.v.dtype}, not {call.bias.dtype}"
            )
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (call.q, call.k, call.v)
        )
        if wants_grad and _FLASH_BACKWARD is None:
            reasons.append(
                f"{label} gives gradients with "
                "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward only"
            )
        if reasons or self.capability_reasons(call) or call.masked_finite:
            return reasons
        if not _finite(call.v):
            reasons.append(f"{label} needs finite values (a masked one is not)")
        elif not _finite(call.k):
            reasons.append(
                f"{label} needs finite keys (a masked one would reach the rows it is hidden from)"
            )
        return reasons

    def attend(self, call: Call) -> AttentionOutput:
        return _evaluate(call, fused=True)


class Tiled(Path):
    """The general path: query × key tiles of any score and streaming alignment, with the
    kernel's own backward (:class:`_Chunked`); it serves every call the kernel supports."""

    kernel = "chunked"
    name = "tiled"

    def attend(self, call: Call) -> AttentionOutput:
        return _evaluate(call, fused=False)


class Chunked(Kernel):
    """Exact attention in key and query blocks, for every score and streaming alignment."""

    name = "chunked"
    priority = 20
    needs_streaming_alignment = True
    masks_key_mixing_scores = False  # a tile sees its own keys only
    accepts_dropout = False
    accepts_chunk_size = True
    preference = (
        "for a block mask, or when the dense score tensor (B·…·M·N·d_w elements) would "
        "exceed DENSE_LIMIT"
    )
    paths = (Fused(), Tiled())

    def prefers(self, call: Call) -> bool:
        if call.block_mask is not None:
            return True  # its cost follows the pattern's density
        return call.shape.numel() * tile_width(call.score) > DENSE_LIMIT

    def attend(self, call: Call) -> AttentionOutput:
        return attend(
            *call.parts(),
            mask=call.mask,
            bias=call.bias,
            need_weights=call.need_weights,
            chunk_size=call.chunk_size,
            block_mask=call.block_mask,
            score_mod=call.score_mod,
            finite=call.masked_finite,
        )


register(Chunked())
