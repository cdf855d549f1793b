"""Sliding-window (local, banded) softmax attention by blocks of queries (Soydaner 5.1;
Longformer's window, Beltagy et al. 2020): query i attends the keys j with |i − j| ≤ w (and
j ≤ i when causal), exactly the pattern :func:`attnkit.patterns.sliding_window` names.

The queries are cut into blocks of c rows; block b needs the keys from b·c − w to
(b + 1)·c + w, a window of c + 2w keys (c + w causal). Each block's scores are one (c × (c + 2w))
tile of a batched matrix product, masked to the band and to the real keys, and normalised by
softmax — O(N·(c + 2w)·d) instead of O(N²·d). The blocks are evaluated a group at a time (about
2²⁰ score elements per group), so the forward pass holds the output, one log-sum-exp per query
and one group's tiles — about SDPA's forward memory — and keeps no weights: the backward pass
recomputes each group's weights from the log-sum-exp (FlashAttention's), one batched product more.

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


# Score-tile elements (rows × window keys, all batch entries) evaluated at once: a group of query
# blocks holds this much, so that the transient tensors stay a fraction of the output.
_TILE_ELEMENTS = 1 << 20


class _Groups:
    """The query blocks of a call in groups, and each group's keys cut into windows."""

    def __init__(self, q: Tensor, size: int, causal: bool, key_mask: Tensor | None) -> None:
        z, n, _ = q.shape
        self.n, self.size, self.key_mask = n, size, key_mask
        self.c = c = _block(size, n)
        self.blocks = -(-n // c)
        self.width = c + size if causal else c + 2 * size
        self.length = (self.blocks - 1) * c + self.width  # rows of the padded keys
        per_block = max(1, z * c * self.width)
        self.per_group = max(1, _TILE_ELEMENTS // per_block)
        # key t of a block's window is position (block start) − size + t; query r is row r
        t = torch.arange(self.width, device=q.device)
        gap = t[None, :] - torch.arange(c, device=q.device)[:, None]  # (c, W): j − i + size
        self.band = (gap >= 0) & (gap <= (size if causal else 2 * size))
        self.t = t

    def ranges(self) -> list[tuple[int, int]]:
        step = self.per_group
        return [(b0, min(b0 + step, self.blocks)) for b0 in range(0, self.blocks, step)]

    def rows(self, x: Tensor, b0: int, b1: int) -> Tensor:
        """Rows of x (Z, N, e) of blocks [b0, b1), zero-padded to whole blocks: (Z, G, c, e)."""
        c = self.c
        r0, r1 = b0 * c, min(b1 * c, self.n)
        part = x[:, r0:r1]
        if r1 - r0 < (b1 - b0) * c:
            part = torch.nn.functional.pad(part, (0, 0, 0, (b1 - b0) * c - (r1 - r0)))
        return part.reshape(x.shape[0], b1 - b0, c, x.shape[-1])

    def windows(self, x: Tensor, b0: int, b1: int) -> Tensor:
        """The windows of keys (or values) x (Z, N, e) of blocks [b0, b1): (Z, G, W, e)."""
        k0 = b0 * self.c - self.size
        k1 = (b1 - 1) * self.c - self.size + self.width
        part = x[:, max(k0, 0) : min(k1, self.n)]
        front, back = max(0, -k0), max(0, k1 - self.n)
        if front or back:
            part = torch.nn.functional.pad(part, (0, 0, front, back))
        return part.unfold(1, self.width, self.c).transpose(-1, -2)

    def allowed(self, b0: int, b1: int) -> Tensor:
        """(G, c, W), or (Z, G, c, W) with a key mask: the band, at real (unmasked) keys."""
        pos = torch.arange(b0, b1, device=self.t.device)[:, None] * self.c - self.size + self.t
        real = (pos >= 0) & (pos < self.n)  # (G, W)
        if self.key_mask is not None:
            inside = pos.clamp(0, self.n - 1)
            real = real & self.key_mask[:, inside]
        return self.band & real[..., None, :]

    def add_windows(self, target: Tensor, g: Tensor, b0: int, b1: int) -> None:
        """target (Z, length, e) += each window of g (Z, G, W, e) at its padded positions."""
        index = (torch.arange(b0, b1, device=g.device)[:, None] * self.c + self.t).flatten()
        target.index_add_(1, index, g.reshape(g.shape[0], -1, g.shape[-1]))


class _Banded(torch.autograd.Function):
    """Forward by groups of query blocks (online, nothing of size N × window kept); backward
    recomputes each group's weights from the saved log-sum-exp (FlashAttention's)."""

    @staticmethod
    def forward(ctx, q, k, v, size, causal, key_mask, scale):
        z, n, _ = q.shape
        plan = _Groups(q, size, causal, key_mask)
        out = q.new_empty(z, n, v.shape[-1])
        lse = q.new_empty(z, plan.blocks * plan.c)
        low = torch.finfo(q.dtype).min
        for b0, b1 in plan.ranges():
            qs = plan.rows(q, b0, b1) * scale
            ok = plan.allowed(b0, b1)
            e = (qs @ plan.windows(k, b0, b1).transpose(-1, -2)).masked_fill_(~ok, low)
            top = e.amax(-1, keepdim=True)
            p = e.sub_(top).exp_()
            total = p.sum(-1, keepdim=True)
            p.div_(total)
            if key_mask is not None:  # a query with no key (all masked): weights and context 0
                p.mul_(ok.any(-1, keepdim=True))
            lse[:, b0 * plan.c : b1 * plan.c] = (top + total.log()).flatten(1)
            o = (p @ plan.windows(v, b0, b1)).flatten(1, 2)
            out[:, b0 * plan.c : min(b1 * plan.c, n)] = o[:, : min(b1 * plan.c, n) - b0 * plan.c]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        plan: _Groups = ctx.plan
        scale = ctx.scale
        z, n, d = q.shape
        dq = torch.empty_like(q)
        dk = q.new_zeros(z, plan.length, d)
        dv = q.new_zeros(z, plan.length, v.shape[-1])
        low = torch.finfo(q.dtype).min
        for b0, b1 in plan.ranges():
            qs = plan.rows(q, b0, b1) * scale
            kw, vw = plan.windows(k, b0, b1), plan.windows(v, b0, b1)
            ok = plan.allowed(b0, b1)
            e = (qs @ kw.transpose(-1, -2)).masked_fill_(~ok, low)
            rows = lse[:, b0 * plan.c : b1 * plan.c].view(z, b1 - b0, plan.c, 1)
            p = e.sub_(rows).exp_()
            if plan.key_mask is not None:
                p.mul_(ok.any(-1, keepdim=True))
            g = plan.rows(grad, b0, b1)
            delta = (g * plan.rows(out, b0, b1)).sum(-1, keepdim=True)
            plan.add_windows(dv, p.transpose(-1, -2) @ g, b0, b1)
            de = (g @ vw.transpose(-1, -2)).sub_(delta).mul_(p)  # softmax backward on the tile
            r1 = min(b1 * plan.c, n)
            dq[:, b0 * plan.c : r1] = (de @ kw).flatten(1, 2)[:, : r1 - b0 * plan.c] * scale
            plan.add_windows(dk, de.transpose(-1, -2) @ qs, b0, b1)
        return dq, dk[:, plan.size : plan.size + n], dv[:, plan.size : plan.size + n], *[None] * 4


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
        context (…, N, d_v). Differentiable once (its backward recomputes the block weights
        from the saved log-sum-exp, not a graph).
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
