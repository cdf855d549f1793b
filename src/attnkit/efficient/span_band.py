"""The band evaluation of span-masked attention (Sukhbaatar et al. 2019, eq. 4-5): queries in
blocks, each block scored only against the keys within ⌈max z + R⌉ of its positions, so that the
work follows the span and not the sequence length. Used by
:mod:`attnkit.efficient.adaptive_span`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.efficient.gather import pairs
from attnkit.kernels.base import guarded_sum

__all__ = ["span_band_attention", "span_mask"]


def span_mask(distance: Tensor, z: Tensor, ramp: float) -> Tensor:
    """m_z(x) = min(max((R + z − x)/R, 0), 1) (Sukhbaatar et al. eq. 4), broadcasting."""
    return ((ramp + z - distance) / ramp).clamp(0.0, 1.0)


def span_band_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spans: Tensor,
    ramp: float,
    align: Alignment,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    q_offset: int = 0,
    block: int = 32,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Span-masked scaled dot-product attention (eq. 5) over the band of keys each query block
    can reach.

    Queries sit at positions q_offset … q_offset + M − 1, keys at 0 … N − 1. The M queries are cut
    into blocks of ``block``; a block attends only the keys within W = ⌈max z + R⌉ of its
    positions (block + 2W keys, gathered), where m_z > 0 is possible. Keys outside the band have
    m_z = 0 and are not computed.

    Args:
        q: (*L, M, d); k: (*L, N, d); v: (*L, N, d_v), broadcasting over L.
        spans: z per query, broadcastable to (*L, M).
        ramp: R > 0.
        align: the alignment applied to the banded scores (a softmax: eq. 5).
        mask: boolean, True = may attend, broadcastable to (*L, M, N).
        bias: float, added to the scores, broadcastable to (*L, M, N).
        need_weights: also return the dense weights (*L, M, N) (zeros outside the band).

    Returns:
        context (*L, M, d_v) and the weights or None.
    """
    m, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], spans.shape[:-1])
    nl, dev = len(lead), q.device
    # the band's reach: spans of padded (possibly NaN) queries do not widen it
    finite = spans.detach().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    z_max = float(finite.max()) if finite.numel() else 0.0
    reach = min(math.ceil(z_max + ramp), q_offset + m + n)
    blk = max(1, min(block, m))
    nb = -(-m // blk)
    width = blk + 2 * reach
    rows = torch.arange(nb * blk, device=dev).reshape(nb, blk)
    if width >= n:  # the band holds every key: the dense form, without a gather
        cols = torch.arange(n, device=dev).expand(nb, n)
    else:
        cols = rows[:, :1] + q_offset - reach + torch.arange(width, device=dev)
    valid = (cols >= 0) & (cols < n)  # (nb, w)
    cols = cols.clamp(0, n - 1)
    w = cols.shape[-1]
    exact = torch.promote_types(q.dtype, torch.float32)  # positions stay exact in bfloat16
    distance = (rows[:, :, None] + q_offset - cols[:, None, :]).abs().to(exact)  # (nb, blk, w)
    pad = nb * blk - m
    q_b = F.pad(q, (0, 0, 0, pad)).unflatten(-2, (nb, blk))  # (*L, nb, blk, d)
    if width >= n:  # every block sees the same keys: broadcast them, gather nothing
        k_w, v_w = k.unsqueeze(-3), v.unsqueeze(-3)  # (*L, 1, N, ·)
    else:
        k_w = k.index_select(-2, cols.reshape(-1)).unflatten(-2, (nb, w))  # (*L, nb, w, d)
        v_w = v.index_select(-2, cols.reshape(-1)).unflatten(-2, (nb, w))
    spans = spans.broadcast_to(*spans.shape[:-1], m)
    z = F.pad(spans.to(exact), (0, pad)).unflatten(-1, (nb, blk))[..., None]
    soft = span_mask(distance, z, ramp).to(q.dtype)  # (*L, nb, blk, w)
    inside = (soft > 0) & valid[:, None, :]
    shape = (1,) * nl
    r_idx = rows.clamp(max=m - 1).reshape(*shape, nb, blk, 1)
    c_idx = cols.reshape(*shape, nb, 1, w)
    if mask is not None:
        inside = inside & pairs(mask, r_idx, c_idx, nl)
    # a key no query of the block may attend is left out by construction (padding may hold NaN)
    key_ok = inside.any(-2)[..., None]  # (*L, nb, w, 1)
    if width >= n:
        key_ok = key_ok.any(-3, keepdim=True)  # (*L, 1, N, 1)
    k_w, v_w = torch.where(key_ok, k_w, 0.0), torch.where(key_ok, v_w, 0.0)
    scores = torch.einsum("...ixd,...iyd->...ixy", q_b, k_w) / math.sqrt(d)
    scores = scores + torch.where(inside, soft, 1.0).log()  # softmax(e + log m), eq. 5
    if bias is not None:
        scores = scores + pairs(bias, r_idx, c_idx, nl)
    inside = inside.broadcast_to(scores.shape)
    weights = align(scores, inside).weights
    if bool(torch.isfinite(v_w).all()):
        context = _combine(weights, v_w)
    else:  # a NaN or infinite value with weight 0 (masked) must not reach the context
        context = guarded_sum(_combine, weights, v_w)
    context = context.flatten(-3, -2)[..., :m, :]
    dense = None
    if need_weights:
        index = cols[:, None, :].expand(weights.shape)
        dense = weights.new_zeros(*weights.shape[:-1], n).scatter_add(-1, index, weights)
        dense = dense.flatten(-3, -2)[..., :m, :]
    return context, dense


def _combine(weights: Tensor, values: Tensor) -> Tensor:
    return torch.einsum("...ixy,...iyd->...ixd", weights, values)
