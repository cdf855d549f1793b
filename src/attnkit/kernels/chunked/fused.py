"""The fused path: block-sparse dot-product softmax attention through PyTorch's fused CPU
kernel, piece by piece (:mod:`attnkit.kernels.chunked.schedule`), merged by the log-sum-exp
(:func:`sparse_fused`), with gradients for q, k and v through the kernel's backward
(:func:`sparse_fused_grad`)."""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.inputs import broadcast_shapes
from attnkit.kernels.block_mask import apply_score_mod
from attnkit.kernels.chunked.forms import is_relative
from attnkit.kernels.chunked.plan import Plan, TileKeys, block_of
from attnkit.kernels.chunked.schedule import ADDITIVE_CACHE_ELEMENTS, Piece, schedule_of
from attnkit.scores import Score

__all__ = ["FLASH", "FLASH_BACKWARD", "all_finite", "sparse_fused", "sparse_fused_grad"]

FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(
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
    out, lse = FLASH(
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
    grads = FLASH_BACKWARD(
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

    keys: TileKeys
    attn_mask: Tensor | None
    causal: bool
    flip: bool
    reverse: bool
    rows_any: Tensor | None


@dataclass
class _FusedRun:
    """What every fused call of one block-sparse evaluation shares."""

    plan: Plan
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
        schedule = schedule_of(plan)
        kept = sum(p.allowed.numel() for _, _, ps in schedule for p in ps if p.allowed is not None)
        self.cache = (
            plan.mask is None
            and self.bias is None
            and plan.score_mod is None
            and kept <= ADDITIVE_CACHE_ELEMENTS
        )
        if plan.score_mod is not None and self.bias is None and is_relative(plan.score_mod):
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

    def _relative_tile(self, q0: int, q1: int, keys: TileKeys) -> Tensor:
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

    def call(self, q0: int, q1: int, piece: Piece) -> _PieceCall:
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
            call = block_of(plan.mask, q0, q1, keys)
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
            base = torch.zeros((), dtype=dtype) if bias is None else block_of(bias, q0, q1, keys)
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


def _fused_context(fused: _FusedRun, qp, kp, v, keep_lse: bool) -> tuple[Tensor, Tensor | None]:
    """Context (…, M, d_v) and, with ``keep_lse``, the log-sum-exp of every row (−inf for a row
    with no key) of block-sparse softmax attention, piece by piece through the fused kernel."""
    plan, lead, dtype = fused.plan, fused.lead, fused.dtype
    qp, kp, v = (x.expand(*lead, *x.shape[-2:]) for x in (qp, kp, v))
    outs, totals = [], []
    for q0, q1, pieces in schedule_of(plan):
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


def _fused_setup(plan: Plan, q, k, v, bias, score: Score, align: Alignment):
    temperature = align.softmax_temperature()
    assert temperature is not None and plan.block_mask is not None and FLASH is not None
    qp, kp, scale = score.dot_form(q, k)
    inv_t = 1.0 / temperature
    lead = broadcast_shapes(plan.lead, qp.shape[:-2], kp.shape[:-2])
    fused = _FusedRun(plan, lead, v.dtype, bias, inv_t, scale * inv_t)
    return fused, qp, kp


def sparse_fused(plan: Plan, q, k, v, bias, score: Score, align: Alignment) -> Tensor:
    """Block-sparse dot-product softmax attention, forward only, through PyTorch's fused CPU
    kernel: each query block attends its full key tiles with no mask, its partial tiles with
    their mask, and a causal diagonal tile causally; the pieces are merged by their log-sum-exp
    (the online softmax of eq. 4, FlashAttention). An additive score_mod (``e + f``) and the
    bias enter as the kernel's additive mask; a score_mod whose f reads the positions only as
    kv_idx − q_idx (ALiBi, relative biases) is evaluated once per offset and each piece reads
    a view of it. Same result as the tiled path."""
    fused, qp, kp = _fused_setup(plan, q, k, v, bias, score, align)
    return _fused_context(fused, qp, kp, v, keep_lse=False)[0]


def sparse_fused_grad(plan: Plan, q, k, v, bias, score: Score, align: Alignment) -> Tensor:
    """:func:`sparse_fused` with a backward through the fused kernel's backward, piece by
    piece (gradients for q, k and v)."""
    fused, qp, kp = _fused_setup(plan, q, k, v, bias, score, align)
    return _FusedAttention.apply(fused, qp, kp, v)


class _FusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fused: _FusedRun, qp, kp, v):
        with torch.no_grad():
            context, lse = _fused_context(fused, qp, kp, v, keep_lse=True)
        ctx.fused = fused
        ctx.save_for_backward(qp, kp, v, context, lse)
        return context

    @staticmethod
    def backward(ctx, d_context):
        fused: _FusedRun = ctx.fused
        qp, kp, v, context, lse = ctx.saved_tensors
        lead, dtype = fused.lead, fused.dtype
        q_, k_, v_ = (x.expand(*lead, *x.shape[-2:]) for x in (qp, kp, v))
        d_context = d_context.to(dtype).expand(context.shape)
        # A row with no key has weight 0 everywhere: exp(s − ∞) = 0.
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)
        g_q, g_k, g_v = (torch.zeros(x.shape, dtype=dtype) for x in (q_, k_, v_))
        for q0, q1, pieces in schedule_of(fused.plan):
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


def all_finite(v: Tensor) -> bool:
    """Whether every value is finite: one reduction (a NaN or infinity makes the sum
    non-finite; a sum that overflows only sends the call to the guarded path)."""
    return bool(torch.isfinite(v.sum())) or bool(torch.isfinite(v).all())
