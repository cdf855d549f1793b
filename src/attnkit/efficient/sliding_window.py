"""Sliding-window (local, banded) softmax attention by blocks of queries (Soydaner 5.1;
Longformer's window, Beltagy et al. 2020): query i attends the keys j with |i − j| ≤ w (and
j ≤ i when causal), exactly the pattern :func:`attnkit.patterns.sliding_window` names.

The queries are cut into blocks of c rows; block b needs the keys from b·c − w to
(b + 1)·c + w, a window of c + 2w keys (c + w causal). Each block's scores are one (c × (c + 2w))
tile of a batched matrix product, masked to the band and to the real keys, and normalised by
softmax — O(N·(c + 2w)·d) instead of O(N²·d). The tiles' weights are kept for the backward
pass (one (N × (c + 2w)) tensor), which then costs three more batched products and no
recomputation of the scores.

A layer built with ``pattern=patterns.sliding_window(w)`` (or ``attnkit.attention`` with the
window's block mask) runs the chunked kernel's block-sparse path instead, which computes the
same attention tile by tile and keeps no weights (less memory; as fast or faster, see
benchmarks/RESULTS.md, "Efficient mechanisms against their reference packages").
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from attnkit import arguments
from attnkit.inputs import broadcast_shapes

__all__ = ["sliding_window_attention"]


def _block(size: int, n: int) -> int:
    """Query rows per block: 128, or fewer for a narrow window or a short sequence."""
    return max(1, min(n, 128, max(16, size)))


def _windows(x: Tensor, front: int, length: int, width: int, step: int) -> Tensor:
    """x (Z, N, e) padded with ``front`` zero rows before and up to ``length`` after, cut into
    windows of ``width`` rows every ``step`` rows: (Z, C, width, e)."""
    back = length - front - x.shape[1]
    padded = torch.nn.functional.pad(x, (0, 0, front, back))
    return padded.unfold(1, width, step).transpose(-1, -2)


class _Banded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, size, causal, key_mask, scale):
        z, n, d = q.shape
        c = _block(size, n)
        blocks = -(-n // c)
        width = c + size if causal else c + 2 * size
        length = (blocks - 1) * c + width  # rows of the padded keys the windows cover
        qs = torch.nn.functional.pad(q * scale, (0, 0, 0, blocks * c - n)).view(z, blocks, c, d)
        kw = _windows(k, size, length, width, c)  # (Z, C, W, d)
        vw = _windows(v, size, length, width, c)
        # key t of block b is position b·c − size + t; query r is b·c + r
        t = torch.arange(width, device=q.device)
        r = torch.arange(c, device=q.device)
        gap = t[None, :] - r[:, None]  # (c, W): j − i + size
        band = (gap >= 0) & (gap <= (size if causal else 2 * size))
        pos = torch.arange(blocks, device=q.device)[:, None] * c - size + t  # (C, W)
        real = (pos >= 0) & (pos < n)
        if key_mask is not None:
            real = real & _windows(key_mask[..., None], size, length, width, c)[..., 0]
        ok = band & real[..., None, :]  # (C, c, W) or (Z, C, c, W)
        e = (qs @ kw.transpose(-1, -2)).masked_fill_(~ok, torch.finfo(q.dtype).min)
        p = torch.softmax(e, -1)
        del e
        if key_mask is not None:  # a query with no key (all masked): weights and context 0
            p = p.masked_fill(~ok.any(-1, keepdim=True), 0)
        out = (p @ vw).view(z, blocks * c, -1)
        ctx.save_for_backward(qs, kw, vw, p, out)
        ctx.shape = (n, size, c, length, scale)
        return out[:, :n]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        qs, kw, vw, p, out = ctx.saved_tensors
        n, size, c, length, scale = ctx.shape
        z, blocks = qs.shape[:2]
        d = qs.shape[-1]
        g = torch.nn.functional.pad(grad, (0, 0, 0, blocks * c - n)).view(z, blocks, c, -1)
        delta = (g * out.view_as(g)).sum(-1, keepdim=True)
        width = p.shape[-1]
        if width % c:  # windows that are not whole blocks: the whole (Z, C, W, ·) products
            de = (g @ vw.transpose(-1, -2)).sub_(delta).mul_(p)  # softmax backward
            dq = (de @ kw).view(z, blocks * c, d)[:, :n] * scale
            dk = _overlap_add(de.transpose(-1, -2) @ qs, size, n, c, length)
            dv = _overlap_add(p.transpose(-1, -2) @ g, size, n, c, length)
            return dq, dk, dv, None, None, None, None
        # block by block of the window (each product the size of the inputs, not W/c times)
        segments = [slice(s * c, (s + 1) * c) for s in range(width // c)]
        de = torch.empty_like(p)
        for seg in segments:
            torch.matmul(g, vw[:, :, seg].transpose(-1, -2), out=de[..., seg])
        de.sub_(delta).mul_(p)  # softmax backward on the tile
        dq = torch.zeros_like(qs)
        dk = qs.new_zeros(z, length, d)
        dv = g.new_zeros(z, length, g.shape[-1])
        for s, seg in enumerate(segments):
            rows = slice(s * c, s * c + blocks * c)
            dq += de[..., seg] @ kw[:, :, seg]
            dk[:, rows] += (de[..., seg].transpose(-1, -2) @ qs).view(z, blocks * c, d)
            dv[:, rows] += (p[..., seg].transpose(-1, -2) @ g).view(z, blocks * c, -1)
        dq = dq.view(z, blocks * c, d)[:, :n] * scale
        return dq, dk[:, size : size + n], dv[:, size : size + n], None, None, None, None


def _overlap_add(windows: Tensor, size: int, n: int, step: int, length: int) -> Tensor:
    """The gradient of :func:`_windows`: each window's rows added back at their positions."""
    z, blocks, width, e = windows.shape
    out = windows.new_zeros(z, length, e)
    index = (torch.arange(blocks, device=windows.device)[:, None] * step
             + torch.arange(width, device=windows.device)).flatten()  # fmt: skip
    out.index_add_(1, index, windows.reshape(z, blocks * width, e))
    return out[:, size : size + n]


def sliding_window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    size: int,
    *,
    causal: bool = False,
    key_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Softmax attention of each query i over the keys j with |i − j| ≤ ``size`` (and j ≤ i when
    ``causal``), by blocks of queries: the context of ``attnkit.attention(q, k, v,
    mask=patterns.dense(patterns.sliding_window(size, causal=causal), N, N))`` in
    O(N·size·d) time and memory.

    Args:
        q, k: (…, N, d); v: (…, N, d_v) — self-attention, one length N.
        size: w ≥ 0, the window's reach on each side.
        causal: only keys j ≤ i.
        key_mask: boolean (…, N) or broadcastable, True = the key may be attended (padding);
            a query with no key gets context 0.
        scale: the scores' factor, q·k · scale (default 1/√d).

    Returns:
        context (…, N, d_v). Differentiable once (its backward keeps the block weights, not a
        graph).
    """
    size = arguments.nonnegative_int(size, "size")
    arguments.boolean(causal, "causal")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() < 2 or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor (…, N, d), got {x!r:.60}")
    if q.shape[-2] != k.shape[-2] or k.shape[-2] != v.shape[-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"sliding_window_attention needs q, k (…, N, d) and v (…, N, d_v) of one length N, "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    n = q.shape[-2]
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if key_mask is not None:
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
            raise TypeError(f"key_mask must be a boolean tensor (…, N), got {key_mask!r:.60}")
        try:
            key_mask = key_mask.broadcast_to(*lead, n).reshape(-1, n)
        except RuntimeError:
            raise ValueError(
                f"key_mask of shape {tuple(key_mask.shape)} does not broadcast to {(*lead, n)}"
            ) from None
    size = min(size, max(n - 1, 0))
    if scale is None:
        scale = q.shape[-1] ** -0.5
    scale = arguments.finite_float(scale, "scale")
    flat = [x.broadcast_to(*lead, n, x.shape[-1]).reshape(-1, n, x.shape[-1]) for x in (q, k, v)]
    out = _Banded.apply(*flat, size, causal, key_mask, scale)
    return out.reshape(*lead, n, v.shape[-1])
