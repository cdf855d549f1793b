"""The tiled path's streaming evaluation: each query block's context from its key tiles
(online or with a per-row statistic from the streaming protocol), and a backward pass that
recomputes each tile's scores from the saved statistics (:class:`TiledAttention`)."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.inputs import broadcast_shapes
from attnkit.kernels.block_mask import BlockMask
from attnkit.kernels.chunked.plan import Plan, TileKeys, block_of, block_ranges, sliced

__all__ = ["TiledAttention", "recomputed_weights", "rows_with_a_key"]


def _forward_rows(plan: Plan, qp, kp, v, bias, q0, q1) -> tuple[Tensor, Tensor | None]:
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
        hk = sliced(plan.has_key, -2, q0, q1)
        context = torch.where(hk, context, torch.zeros((), dtype=context.dtype))
    return context, stat


def _correction(plan: Plan, qp, kp, v, bias, d_out, context, st, q0, q1) -> Tensor | None:
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


class TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: Plan, qp, kp, v, bias, *params):
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
        plan: Plan = ctx.plan
        qp, kp, v, bias, context, stat, *params = ctx.saved_tensors
        work = plan.work
        kw = {"dtype": work, "device": v.device}  # (the gradients where the inputs are)
        g_qp = None if qp is None else torch.zeros(qp.shape, **kw)
        g_kp, g_v = torch.zeros(kp.shape, **kw), torch.zeros(v.shape, **kw)
        want_bias = bias is not None and ctx.needs_input_grad[4]
        g_bias = torch.zeros(bias.shape, **kw) if want_bias else None
        g_params = [torch.zeros(p.shape, dtype=plan.work, device=p.device) for p in params]
        for q0, q1 in plan.q_blocks():
            d_out = d_context[..., q0:q1, :].to(work)
            st = None if stat is None else stat.narrow(-2, q0, q1 - q0)
            with torch.no_grad():
                corr = _correction(plan, qp, kp, v, bias, d_out, context[..., q0:q1, :], st, q0, q1)
            for keys in plan.k_blocks(q0):
                with torch.enable_grad():
                    qb = None if qp is None else qp[..., q0:q1, :].detach().requires_grad_()
                    kb = keys.take(kp, -2).detach().requires_grad_()
                    bb = block_of(bias, q0, q1, keys)
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
                    rows = sliced(g_bias, -2, q0, q1) if g_bias.dim() >= 2 else g_bias
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


def recomputed_weights(plan: Plan, qp, kp, v, bias) -> tuple[Tensor, Tensor]:
    """Weights and scores (before alignment, as the dense path returns them), recomputed block
    by block (no gradient)."""
    w_rows, e_rows = [], []
    with torch.no_grad():
        for q0, q1 in plan.q_blocks():
            _, stat = _forward_rows(plan, qp, kp, v, bias, q0, q1)
            ws, es = [], []
            for keys in plan.k_blocks():
                qb = None if qp is None else qp[..., q0:q1, :]
                e = plan.raw(qb, keys.take(kp, -2), block_of(bias, q0, q1, keys), q0, q1, keys)
                ws.append(plan.weights(plan.prepared(e, q0, q1, keys), stat, q0, q1))
                es.append(e)
            w_rows.append(torch.cat(ws, dim=-1))
            e_rows.append(torch.cat(es, dim=-1))
    weights, scores = torch.cat(w_rows, dim=-2), torch.cat(e_rows, dim=-2)
    if plan.multi:
        weights, scores = weights.movedim(-3, -1), scores.movedim(-3, -1)
    return weights.to(v.dtype), scores.to(v.dtype)


def rows_with_a_key(mask: Tensor, block_mask: BlockMask) -> Tensor:
    """(…, M, 1): rows with a key that both the mask and the block mask allow (visited tiles
    only: the others hold no allowed pair)."""
    rows = []
    for i, (q0, q1) in enumerate(block_ranges(block_mask.block_q, block_mask.m)):
        hit = None
        for j, (k0, k1) in enumerate(block_ranges(block_mask.block_k, block_mask.n)):
            if not bool(block_mask.any_allowed[i, j]):
                continue
            both = block_of(mask, q0, q1, TileKeys(k0, k1)) & block_mask.tile(q0, q1, k0, k1)
            found = both.any(dim=-1, keepdim=True)
            hit = found if hit is None else hit | found
        if hit is None:
            hit = torch.zeros(q1 - q0, 1, dtype=torch.bool, device=mask.device)
        rows.append(hit)
    shapes = broadcast_shapes(*(r.shape[:-2] for r in rows))
    return torch.cat([r.expand(*shapes, *r.shape[-2:]) for r in rows], dim=-2)
