"""Attention over per-query key subsets, evaluated in blocks of queries with a hand-written
backward, so that time follows the selection and memory stays O(M·T) plus one block's gathered
keys.

Each query m attends its own T keys ``index[m, :]`` (those with ``ok``). Gathering them for every
query at once, (…, M, T, d), and letting autograd keep the gathered copies costs O(M·T·d) memory;
here the keys and values are gathered one block of queries at a time, forward and again in the
backward, so that besides the inputs only the weights (…, M, T) are kept:

    e_{m,t} = scale · q_m · k_{index[m,t]} + b_{m,t},   p_m = softmax over {t | ok[m,t]} of e_m,
    o_m = Σ_t p_{m,t} v_{index[m,t]}

and, for the backward (the softmax Jacobian, g = ∂L/∂p + ∂L/∂o · v_{index}):

    ∂L/∂e_{m,t} = p_{m,t} (g_{m,t} − Σ_u p_{m,u} g_{m,u}),
    ∂L/∂q_m = scale Σ_t ∂L/∂e_{m,t} k_{index[m,t]},
    ∂L/∂k_j = scale Σ_{(m,t): index=j} ∂L/∂e_{m,t} q_m,
    ∂L/∂v_j = Σ_{(m,t): index=j} p_{m,t} ∂L/∂o_m.

Time O(M·T·d); memory O(M·T) kept plus O(block·T·d) transient.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gathered_softmax", "query_block"]

#: elements of one block's gathered keys (float32: 4 MiB; larger blocks ran slower on CPU)
BLOCK_ELEMENTS = 1 << 20


def query_block(m: int, per_query: int) -> int:
    """Queries per block such that a block holds about :data:`BLOCK_ELEMENTS` elements, given the
    elements one query needs."""
    return max(1, min(m, BLOCK_ELEMENTS // max(1, per_query)))


def _flat_rows(x: Tensor, count: int) -> Tensor:
    """(L, N, f) -> (L·N + 1, f): the rows of every item, then a row of zeros."""
    flat = x.reshape(count * x.shape[-2], x.shape[-1])
    return torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])


def _rows(index: Tensor, ok: Tensor, offsets: Tensor, zero: int) -> Tensor:
    """Flat row numbers (L·b·T,) of ``index`` (L, b, T) in :func:`_flat_rows`; the zero row where
    not ``ok`` (so that nothing unselected, NaN included, is read)."""
    return torch.where(ok, index + offsets, zero).reshape(-1)


def _gather(flat: Tensor, rows: Tensor, shape: torch.Size) -> Tensor:
    """``flat`` (R, f) at ``rows`` -> (*shape, f)."""
    return flat.index_select(0, rows).view(*shape, flat.shape[-1])


def _softmax(e: Tensor, ok: Tensor) -> Tensor:
    """Softmax of e (…, T) over ``ok``; rows without a key give 0 (never NaN)."""
    any_key = ok.any(-1, keepdim=True)
    filled = e.masked_fill(~ok, float("-inf")).masked_fill(~any_key, 0.0)
    return torch.softmax(filled, -1) * any_key


class _GatheredSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, index, ok, scale):
        count, m, t = index.shape
        kf, vf = _flat_rows(k, count), _flat_rows(v, count)
        offsets = torch.arange(count, device=q.device)[:, None, None] * k.shape[-2]
        zero = count * k.shape[-2]
        out = q.new_empty(count, m, v.shape[-1])
        weights = q.new_empty(count, m, t)
        step = query_block(m, count * t * max(q.shape[-1], v.shape[-1]))
        for s in range(0, m, step):
            sl = slice(s, s + step)
            rows = _rows(index[:, sl], ok[:, sl], offsets, zero)
            kg = _gather(kf, rows, index[:, sl].shape)  # (L, b, T, d)
            e = (q[:, sl, None, :] @ kg.transpose(-1, -2)).squeeze(-2)
            e = e * scale if bias is None else e * scale + bias[:, sl]
            p = _softmax(e, ok[:, sl])
            vg = _gather(vf, rows, index[:, sl].shape)
            out[:, sl] = (p[:, :, None, :] @ vg).squeeze(-2)
            weights[:, sl] = p
        ctx.save_for_backward(q, k, v, index, ok, weights)
        ctx.scale, ctx.has_bias = scale, bias is not None
        return out, weights

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_weights):
        q, k, v, index, ok, weights = ctx.saved_tensors
        count, m, t = index.shape
        kf, vf = _flat_rows(k, count), _flat_rows(v, count)
        offsets = torch.arange(count, device=q.device)[:, None, None] * k.shape[-2]
        zero = count * k.shape[-2]
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(kf)
        dv = torch.zeros_like(vf)
        dbias = q.new_empty(count, m, t) if ctx.has_bias else None
        step = query_block(m, count * t * max(q.shape[-1], v.shape[-1]))
        for s in range(0, m, step):
            sl = slice(s, s + step)
            p = weights[:, sl]
            g = torch.zeros_like(p) if grad_weights is None else grad_weights[:, sl].clone()
            rows = _rows(index[:, sl], ok[:, sl], offsets, zero)
            if grad_out is not None:
                go = grad_out[:, sl]
                vg = _gather(vf, rows, p.shape)
                g += (go[:, :, None, :] @ vg.transpose(-1, -2)).squeeze(-2)
                dv.index_add_(0, rows, (p[..., None] * go[:, :, None, :]).reshape(-1, dv.shape[-1]))
            de = p * (g - (p * g).sum(-1, keepdim=True))
            if dbias is not None:
                dbias[:, sl] = de
            de = de * ctx.scale
            dq[:, sl] = (de[:, :, None, :] @ _gather(kf, rows, p.shape)).squeeze(-2)
            dk.index_add_(0, rows, (de[..., None] * q[:, sl, None, :]).reshape(-1, dk.shape[-1]))
        return dq, dk[:zero].view_as(k), dv[:zero].view_as(v), dbias, None, None, None


def gathered_softmax(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    ok: Tensor,
    scale: float,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Softmax attention of each query over its own keys (module docstring).

    Args:
        q: (*lead, M, d) queries.
        k, v: (*lead, N, d) and (*lead, N, d_v) keys and values.
        index: (*lead, M, T) int64 key numbers in [0, N).
        ok: (*lead, M, T) bool, the entries each query attends; a row without one gives
            weights 0 and context 0.
        scale: the factor of the dot products.
        bias: (*lead, M, T) added to the scaled dot products, or None.

    Returns:
        context (*lead, M, d_v) and weights (*lead, M, T) (0 where not ``ok``), both
        differentiable (once).
    """
    lead, (m, t) = q.shape[:-2], index.shape[-2:]
    count = lead.numel()
    q3 = q.reshape(count, m, q.shape[-1])
    k3 = k.broadcast_to(*lead, *k.shape[-2:]).reshape(count, k.shape[-2], k.shape[-1])
    v3 = v.broadcast_to(*lead, *v.shape[-2:]).reshape(count, v.shape[-2], v.shape[-1])
    index3 = index.broadcast_to(*lead, m, t).reshape(count, m, t)
    ok3 = ok.broadcast_to(*lead, m, t).reshape(count, m, t)
    bias3 = None if bias is None else bias.broadcast_to(*lead, m, t).reshape(count, m, t)
    out, weights = _GatheredSoftmax.apply(q3, k3, v3, bias3, index3, ok3, float(scale))
    return out.view(*lead, m, v.shape[-1]), weights.view(*lead, m, t)
