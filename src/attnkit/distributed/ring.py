"""Ring attention: exact attention over a sequence split across the ranks of a process group.

Each rank holds its part of the queries, keys and values (:mod:`attnkit.distributed.layout`).
It keeps its queries and passes its key/value block to the next rank of the ring, P − 1 times,
so every query meets every key while no rank holds more than two key/value blocks at a time
(two gradient blocks more in the backward pass): Liu et al., "Ring Attention with Blockwise
Transformers", the chunked kernel's blockwise evaluation (:mod:`attnkit.kernels.chunked`) with
the key blocks arriving over the network. The next block's transfer is posted before the work
on the block in hand, so communication overlaps computation.

The blocks are merged with the alignment's streaming statistics
(:mod:`attnkit.alignments.streaming`), for every score and every streaming alignment:

- online alignments (softmax: running maximum and sum) need one turn of the ring;
- alignments whose statistic needs whole rows (sparsemax, 1.5-entmax, α-entmax: the threshold
  τ over *all* keys) get it from the alignment's own
  :meth:`attnkit.alignments.streaming.Streaming.stream_statistic`, each of its sweeps over the
  key tiles being one turn of the ring (only the projected keys travel). The ranks agree
  before each sweep whether any of them still needs one, and a rank that is done forwards the
  blocks for the others, so the result is the single-process one: exact;
- alignments with independent weights (sigmoid) need no statistic.

The backward pass is a second :class:`torch.autograd.Function` turn: the key/value blocks travel
with their gradient accumulators, to which every rank adds its queries' part; after P steps
each block's gradient is back home. Alignments whose keys are coupled (sparsemax, entmax) need
one turn more for the per-row correction Σ r ∂L/∂p / Σ r.

Causal masks use global positions; with the ``"zigzag"`` layout every rank does the same work
(tiles that a mask or block mask leaves empty are skipped, forward and backward).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnkit import checks
from attnkit.alignments import Alignment
from attnkit.distributed.agreement import Call, agree
from attnkit.distributed.layout import LAYOUTS, check_layout
from attnkit.distributed.tiles import Plan, rows_of
from attnkit.distributed.transport import GRAD_TAG, KV_TAG, Ring
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.kernels.chunked import (
    TILE_ELEMENTS,
    WIDE_TILE_ELEMENTS,
    default_chunk_size,
    reasons_not_streamable,
    tile_width,
)
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["reasons_not_supported", "ring_attention"]


def reasons_not_supported(score: Score, align: Alignment) -> list[str]:
    """Why ring attention cannot evaluate ``score`` × ``align`` exactly (empty when it can)."""
    reasons = list(reasons_not_streamable(align))
    if score.multi_dimensional:
        reasons.append("ring attention takes single-dimensional scores (…, M, N) only")
    if score.query_free:
        reasons.append(
            f"the {type(score).__name__} score is query-free (one query for the whole "
            "sequence), which has no part to split over the ranks"
        )
    if score.mixes_keys:
        reasons.append(
            f"the {type(score).__name__} score mixes neighbouring keys, which lie on other ranks"
        )
    return reasons


def _statistic(plan: Plan, qp: Tensor, block: list[Tensor]) -> Tensor | None:
    """The alignment's per-row statistic of every local query row over all keys; each sweep of
    the alignment is a turn of the ring, and the ranks sweep together until all are done."""
    ring = plan.ring

    def sweep() -> Iterator[Tensor]:
        ring.any(True, plan.device)
        seen = False
        for owner, blk in ring.passes(block, "a threshold sweep"):
            kb, mb = plan.unpack(blk)
            for keys in plan.key_pieces(owner, plan.stat_k):
                e = plan.all_rows_tile(qp, kb, keys, mb)
                if e is not None:
                    seen = True
                    yield e
        if not seen:  # no row has any allowed key: the alignment still gets a (−inf) tile
            yield plan.empty(plan.m_local, 1)

    stat = plan.align.stream_statistic(sweep)
    while ring.any(False, plan.device):  # others still sweep: forward the blocks for them
        for _ in ring.passes(block, "a threshold sweep"):
            pass
    return stat


def _forward(plan: Plan, qp: Tensor, kp: Tensor, v: Tensor, mb: Tensor | None):
    """(context (…, M_l, d_v) in the work dtype, statistic (…, M_l, C) or None, has_key)."""
    align = plan.align
    lead = plan.lead
    has_key = torch.zeros(*lead, plan.m_local, 1, dtype=torch.bool, device=plan.device)
    stat = None
    if not align.stream_online:
        stat = _statistic(plan, qp, plan.block(kp, mb))
    accs: list[Tensor | None] = [None] * len(plan.row_pieces)
    states: list[tuple[Tensor, ...] | None] = [None] * len(plan.row_pieces)
    for owner, blk in plan.ring.passes(plan.block(kp, v, mb), "the forward turn"):
        kb, vb, mb_ = plan.unpack(blk)
        for i, rows in enumerate(plan.row_pieces):
            qr = rows.rows(qp)
            st = rows_of(stat, rows)
            for keys in plan.key_pieces(owner, plan.block_k):
                if not plan.visible(rows, keys, mb_):
                    continue
                e, mask = plan.tile(qr, keys.rows(kb), rows, keys, mb_)
                hk = rows.rows(has_key)
                hk |= True if mask is None else mask.any(dim=-1, keepdim=True)
                if align.stream_online:
                    p, rescale, states[i] = align.stream_accumulate(e, states[i])
                else:
                    p, rescale = align.stream_weights(e, st), None
                part = plan.combine(p, keys.rows(vb))
                acc = accs[i]
                if acc is None:
                    accs[i] = part
                elif rescale is None:
                    accs[i] = acc + part
                else:
                    accs[i] = acc * rescale + part
    contexts, stats = [], []
    d_v = v.shape[-1]
    for i, rows in enumerate(plan.row_pieces):
        acc = accs[i]
        if acc is None:  # every tile of these rows was empty
            acc = torch.zeros(*lead, rows.length, d_v, dtype=plan.work, device=plan.device)
        if align.stream_online:
            state = states[i]
            if state is None:
                _, _, state = align.stream_accumulate(plan.empty(rows.length, 1), None)
            norm, st = align.stream_finish(state)
            acc = acc / norm
            stats.append(st)
        contexts.append(acc.expand(*lead, rows.length, d_v))
    context = torch.cat(contexts, dim=-2)
    if align.stream_online:
        stat = torch.cat(stats, dim=-2)
    context = torch.where(has_key, context, torch.zeros((), dtype=context.dtype))
    return context, stat, has_key


def _correction(plan, qp, kp, v, mb, d_out, context, stat, has_key) -> Tensor | None:
    """c = Σ r ∂L/∂p / Σ r per local row over all keys (None when keys are not coupled)."""
    if plan.align.stream_weights_are_correction:
        return (d_out * context).sum(-1, keepdim=True)
    # Whether r exists is the alignment's property: ask it on one local tile.
    rows, keys = plan.row_pieces[0], plan.key_pieces(plan.ring.rank, plan.block_k)[0]
    e, _ = plan.tile(rows.rows(qp), keys.rows(kp), rows, keys, mb)
    st = rows_of(stat, rows)
    _, r = plan.align.stream_slope(plan.align.stream_weights(e, st), st)
    if r is None:
        return None
    num = torch.zeros(*plan.lead, plan.m_local, 1, dtype=plan.work, device=plan.device)
    den = torch.zeros_like(num)
    for owner, blk in plan.ring.passes(plan.block(kp, v, mb), "the backward correction turn"):
        kb, vb, mb_ = plan.unpack(blk)
        for rows in plan.row_pieces:
            st, hk = rows_of(stat, rows), rows.rows(has_key)
            for keys in plan.key_pieces(owner, plan.block_k):
                if not plan.visible(rows, keys, mb_):
                    continue
                e, _ = plan.tile(rows.rows(qp), keys.rows(kb), rows, keys, mb_)
                p = plan.weights(e, st, hk)
                _, r = plan.align.stream_slope(p, st)
                dp = plan.d_weights(rows.rows(d_out), keys.rows(vb))
                rows.rows(num).add_((r * dp).sum(-1, keepdim=True))
                rows.rows(den).add_(r.sum(-1, keepdim=True))
    return num / torch.where(den > 0, den, torch.ones((), dtype=den.dtype))


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: Plan, qp, kp, v, mb, *params):
        with torch.no_grad():
            context, stat, has_key = _forward(plan, qp, kp, v, mb)
        ctx.plan = plan
        ctx.save_for_backward(qp, kp, v, mb, context, stat, has_key, *params)
        return context.to(v.dtype)

    @staticmethod
    def backward(ctx, d_context):
        plan: Plan = ctx.plan
        qp, kp, v, mb, context, stat, has_key, *params = ctx.saved_tensors
        work, ring = plan.work, plan.ring
        d_out = d_context.to(work).expand(context.shape)
        with torch.no_grad():
            corr = _correction(plan, qp, kp, v, mb, d_out, context, stat, has_key)
        g_qp = torch.zeros(qp.shape, dtype=work, device=plan.device)
        g_params = [torch.zeros(p.shape, dtype=work, device=p.device) for p in params]
        blk = plan.block(kp, v, mb)
        pending_kv = pending_g = None
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            if step < ring.size - 1:
                pending_kv = ring.exchange(blk, KV_TAG)
            kb, vb, mb_ = plan.unpack(blk)
            g_k = torch.zeros(kb.shape, dtype=work, device=plan.device)
            g_v = torch.zeros(vb.shape, dtype=work, device=plan.device)
            for rows in plan.row_pieces:
                st, hk = rows_of(stat, rows), rows.rows(has_key)
                d_rows = rows.rows(d_out)
                c_rows = None if corr is None else rows.rows(corr)
                for keys in plan.key_pieces(owner, plan.block_k):
                    if not plan.visible(rows, keys, mb_):
                        continue
                    _tile_grads(
                        plan,
                        qp,
                        kb,
                        vb,
                        mb_,
                        rows,
                        keys,
                        st,
                        hk,
                        d_rows,
                        c_rows,
                        g_qp,
                        g_k,
                        g_v,
                        params,
                        g_params,
                    )
            if pending_g is not None:  # the gradients of this block from the ranks before
                got_k, got_v = ring.wait(pending_g, f"backward step {step}: gradient blocks")
                g_k += got_k
                g_v += got_v
            pending_g = ring.exchange([g_k, g_v], GRAD_TAG)
            if pending_kv is not None:
                blk = ring.wait(pending_kv, f"backward step {step + 1}: key/value blocks")
                pending_kv = None
        g_kp, g_v = ring.wait(pending_g, "backward: own gradient blocks")

        def back(g: Tensor | None, like: Tensor | None) -> Tensor | None:
            return None if g is None or like is None else g.to(like.dtype)

        return (
            None,
            back(g_qp, qp),
            back(g_kp, kp),
            back(g_v, v),
            None,
            *(back(g, p) for g, p in zip(g_params, params, strict=True)),
        )


def _tile_grads(
    plan, qp, kb, vb, mb, rows, keys, st, hk, d_rows, c_rows, g_qp, g_k, g_v, params, g_params
) -> None:
    """Add one tile's part to the gradients of the queries, the visiting keys and values, and
    the parameters (recomputing the tile's scores, as the chunked kernel does)."""
    with torch.enable_grad():
        qb = rows.rows(qp).detach().requires_grad_()
        kt = keys.rows(kb).detach().requires_grad_()
        e, _ = plan.tile(qb, kt, rows, keys, mb)
    with torch.no_grad():
        p = plan.weights(e.detach(), st, hk)
        vt = keys.rows(vb)
        keys.rows(g_v).add_(torch.matmul(p.transpose(-1, -2), d_rows).sum_to_size(vt.shape))
        dp = plan.d_weights(d_rows, vt)
        s, _ = plan.align.stream_slope(p, st)
        de = s * dp if c_rows is None else s * (dp - c_rows)
        de = torch.where(torch.isinf(e.detach()), torch.zeros((), dtype=de.dtype), de)
    if not e.requires_grad:
        return
    grads = torch.autograd.grad(e, [qb, kt, *params], de, allow_unused=True)
    if grads[0] is not None:
        rows.rows(g_qp).add_(grads[0].sum_to_size(qb.shape))
    if grads[1] is not None:
        keys.rows(g_k).add_(grads[1].sum_to_size(kt.shape))
    for target, g in zip(g_params, grads[2:], strict=True):
        if g is not None:
            target += g.sum_to_size(target.shape)


def _without_padded(k: Tensor, v: Tensor, key_padding_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Keys and values with the padded positions zeroed when one of them is not finite: a
    padded position's content must not reach anything (0·NaN is NaN), as in
    :func:`attnkit.attention`."""
    k_ok, v_ok = bool(torch.isfinite(k).all()), bool(torch.isfinite(v).all())
    if k_ok and v_ok:
        return k, v
    pad = key_padding_mask.to(k.device)
    zero = torch.zeros((), dtype=k.dtype, device=k.device)

    def keep(x: Tensor) -> Tensor:
        return pad.view(pad.shape[0], *([1] * (x.dim() - 3)), pad.shape[1], 1)

    k = k if k_ok else torch.where(keep(k), k, zero)
    v = v if v_ok else torch.where(keep(v), v, zero)
    return k, v


class _Checked(NamedTuple):
    score: Score
    align: Alignment
    lead: torch.Size
    m_local: int
    n_local: int


def _check_locally(
    q, k, v, score, align, causal, key_padding_mask, layout, block_mask, score_mod, chunk_size
) -> _Checked:
    """Every check of a call that needs nothing of the group; raises ValueError/TypeError."""
    score_part = checks.resolve_score(score)
    align_mod = checks.resolve_alignment(align)
    if q is None:
        raise ValueError("q is None; ring attention splits the queries over the ranks")
    checks.validate(q, k, v, score_part, mask=None, bias=None, align=align_mod)
    reasons = reasons_not_supported(score_part, align_mod)
    if reasons:
        raise ValueError("ring attention cannot evaluate this call: " + "; ".join(reasons))
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    check_layout(layout)
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable, got {type(score_mod).__name__}")
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    m_local, n_local = q.shape[-2], k.shape[-2]
    if m_local == 0:
        raise ValueError(f"q has no queries on this rank (shape {tuple(q.shape)})")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(
                "key_padding_mask must be a boolean tensor (B, N_l), True = a real key, got "
                f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}"
            )
        if (
            min(k.dim(), v.dim()) < 3
            or key_padding_mask.dim() != 2
            or key_padding_mask.shape[1] != n_local
            or key_padding_mask.shape[0] not in (1, lead[0])
        ):
            batch = lead[0] if k.dim() >= 3 else None
            raise ValueError(
                f"key_padding_mask must be (B, N_l) = ({batch}, {n_local}) for keys "
                f"{tuple(k.shape)} (batch first), got {tuple(key_padding_mask.shape)}"
            )
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be an attnkit.kernels.BlockMask, got {type(block_mask).__name__}"
        )
    for seg_len, name in ((m_local, "q"), (n_local, "k")):
        if layout == "zigzag" and seg_len % 2:
            raise ValueError(
                f"the zigzag layout holds a front and a back chunk of equal length per rank, so "
                f"each rank's {name} length must be even, got {seg_len}"
            )
    return _Checked(score_part, align_mod, lead, m_local, n_local)


def _check_on_ring(
    ring: Ring, checked: _Checked, q: Tensor, k: Tensor, layout: str, block_mask
) -> None:
    """The checks that need the ring: the tensors' device for its backend, the block mask's
    size against the whole sequence."""
    ring.check_device(q, "q")
    if block_mask is not None:
        p = ring.size
        block_mask.check(torch.Size((*checked.lead, p * checked.m_local, p * checked.n_local)))


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor | None = None,
    *,
    score: str | Score = "scaled_dot",
    align: str | Alignment = "softmax",
    group: dist.ProcessGroup | None = None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    layout: str = "contiguous",
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
    chunk_size: int | None = None,
) -> AttentionOutput:
    """Exact attention over a sequence split across the ranks of ``group`` (ring attention).

    Every rank of the group calls it with its own part of the sequence, laid out as ``layout``
    says (:func:`attnkit.distributed.shard` cuts a whole sequence so). The result on each rank
    is its part of what :func:`attnkit.attention` gives on the whole sequence (Brauwers eq. 2–4;
    blockwise as FlashAttention, the key blocks passed around the ring as in Liu et al.'s Ring
    Attention), forward and backward.

    Args:
        q: this rank's queries (B, …, M_l, d_q); the whole sequence has M = P·M_l.
        k: this rank's keys (B, …, N_l, d_k); N = P·N_l.
        v: this rank's values (B, …, N_l, d_v); None means v = k.
        score: a registered name or a :class:`attnkit.scores.Score` (single-dimensional, not
            query-free, not mixing keys).
        align: a registered name or an alignment implementing the streaming protocol
            (softmax, sparsemax, entmax15, entmax with a fixed 1 < α ≤ 2, sigmoid, …).
        group: the process group of the ring (None: the default group). Its backend sends
            the tensors: gloo for CPU tensors, nccl for CUDA tensors.
        causal: query i attends to keys j ≤ i (global positions).
        key_padding_mask: this rank's (B, N_l) boolean mask, True = a real key.
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced under ``causal``), the same on
            every rank (:mod:`attnkit.distributed.layout`).
        block_mask: a :class:`attnkit.kernels.BlockMask` over the whole (M, N) scores (global
            positions); its empty tiles are skipped.
        score_mod: ``score_mod(e, b, h, q_idx, kv_idx)`` with global positions, as in
            :func:`attnkit.attention`.
        chunk_size: key tile size (default as the chunked kernel's).

    Returns:
        :class:`attnkit.AttentionOutput` with this rank's context (B, …, M_l, d_v).

    Parameters of the score, the alignment and the score_mod are replicated on every rank;
    each rank's ``.grad`` holds its queries' part, so sum them over the group
    (``torch.distributed.all_reduce``) to get the whole sequence's gradient. Every rank must
    run the backward pass (it is a turn of the ring). A rank that stops makes the others raise
    :class:`attnkit.distributed.RingError` within the group's timeout.
    """
    return attend(
        q,
        k,
        v,
        score=score,
        align=align,
        group=group,
        causal=causal,
        key_padding_mask=key_padding_mask,
        layout=layout,
        block_mask=block_mask,
        score_mod=score_mod,
        chunk_size=chunk_size,
    )


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    *,
    score: str | Score,
    align: str | Alignment,
    group: dist.ProcessGroup | None,
    causal: bool,
    key_padding_mask: Tensor | None,
    layout: str,
    block_mask: BlockMask | None,
    score_mod: ScoreMod | None,
    chunk_size: int | None,
    refusal: Exception | None = None,
) -> AttentionOutput:
    """:func:`ring_attention`, with ``refusal``: an error the caller met on this rank before
    the call (:class:`attnkit.distributed.RingAttention`'s own checks), agreed on with the
    other ranks as this function's own checks are (:mod:`attnkit.distributed.agreement`)."""
    if v is None:
        v = k
    checked = None
    if refusal is None:
        try:
            checked = _check_locally(
                q, k, v, score, align, causal, key_padding_mask, layout, block_mask, score_mod,
                chunk_size,
            )  # fmt: skip
        except (ValueError, TypeError) as err:
            refusal = err
    try:
        ring = Ring.of(group)
    except (ValueError, TypeError):
        if refusal is not None:  # no group to agree with: this call's own error first
            raise refusal from None
        raise
    if checked is not None:
        try:
            _check_on_ring(ring, checked, q, k, layout, block_mask)
        except (ValueError, TypeError) as err:
            refusal = err
    if checked is not None and refusal is None and key_padding_mask is not None:
        k, v = _without_padded(k, v, key_padding_mask)
    # Every rank must accept its part of the same call: agree on that before any ring turn.
    call = Call()
    for name, x in (("q", q), ("k", k), ("v", v), ("key_padding_mask", key_padding_mask)):
        call.tensor(name, x)
    call.dtype(q)
    call.value("world_size", ring.size, ring.size)
    call.value("layout", LAYOUTS.index(layout) if layout in LAYOUTS else -1, layout)
    call.value("causal", int(causal) if isinstance(causal, bool) else -1, causal)
    for name, x in (("block_mask_m", "m"), ("block_mask_n", "n")):
        size = getattr(block_mask, x, -1) if isinstance(block_mask, BlockMask) else -1
        call.value(name, size, None if block_mask is None else size)
    call.value("score_mod", int(score_mod is not None), score_mod is not None)
    call.part("score", score if checked is None else checked.score)
    call.part("align", align if checked is None else checked.align)
    call.facts["v_finite"] = isinstance(v, Tensor) and bool(torch.isfinite(v).all())
    facts = agree(ring, call, refusal, ring.device_of(q))
    assert checked is not None  # every rank accepted: this one too
    score_part, align_mod, lead, m_local, n_local = checked
    width = tile_width(score_part) * max(1, math.prod(lead))
    budget = TILE_ELEMENTS if tile_width(score_part) == 1 else WIDE_TILE_ELEMENTS
    half = n_local if layout == "contiguous" else n_local // 2
    block_k = min(half, chunk_size or default_chunk_size(half, score_part))
    mb = None if key_padding_mask is None else key_padding_mask.to(torch.uint8).contiguous()
    masked = causal or mb is not None or block_mask is not None
    plan = Plan(
        score=score_part,
        align=align_mod,
        ring=ring,
        layout=layout,
        causal=causal,
        m_local=m_local,
        n_local=n_local,
        lead=lead,
        work=torch.float64 if v.dtype == torch.float64 else torch.float32,
        block_q=max(1, min(m_local, budget // (block_k * width))),
        block_k=block_k,
        stat_k=min(half, chunk_size or max(1, budget // (m_local * width))),
        padded=mb is not None,
        guard=masked and not facts["v_finite"],
        block_mask=block_mask,
        score_mod=score_mod,
        device=q.device,
    )
    qp = score_part.project_query(q)
    kp = score_part.project_key(k)
    mods = score_mod.parameters() if isinstance(score_mod, nn.Module) else ()
    params = [
        p for p in (*score_part.parameters(), *align_mod.parameters(), *mods) if p.requires_grad
    ]
    context = _RingFunction.apply(plan, qp, kp.contiguous(), v.contiguous(), mb, *params)
    return AttentionOutput(context)
