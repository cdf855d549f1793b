"""Softmax attention of each query over its own selected keys (DSA's top-k), a chunk of queries
at a time with one hand-written backward: on the CPU through PyTorch's fused kernel, the
selection an additive mask over the chunk's causal keys (every key up to the chunk's last is
scored, as in causal attention; nothing is gathered); elsewhere over key-block tiles
(:mod:`attnkit.sparse_trainable._pairs`), below.

A query's selected keys are scattered over the key blocks it touches; each (query, touched
block) is a pair, read through a (chunk, N) mask of the selection, so a key block is read once
per tile of queries, not once per query (a per-query gather moves M·k·d numbers and multiplies
them as vectors). The price: a touched block is scored whole, so the work is (touched blocks)·l'
keys per query, between k and the causal prefix. Kept for the backward: the log-sum-exp (…, M)
and the selection (…, M, k).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.sparse_trainable._pairs import tile_backward, tile_forward, tile_weights, tiles

__all__ = ["fused_applies", "fused_chunks", "masked_softmax", "selected_softmax"]

#: (query, key block) pairs per chunk
PAIRS = 1 << 14
#: keys per block, pairs per tile
BLOCK, TILE = 64, 32


def _chunk(keys: Tensor, ok: Tensor, pos: Tensor, n: int):
    """The chunk's tiles and its selection mask as a lookup for them."""
    count, q, _ = keys.shape
    blocks = -(-n // BLOCK)
    chosen = torch.zeros(count * q + 1, n, dtype=torch.bool, device=keys.device)
    rows = torch.arange(count * q, device=keys.device).view(count, q, 1).expand_as(keys)
    rows = rows.where(ok, count * q)  # entries not read mark the spare last row
    chosen[rows, keys] = True
    touched = torch.zeros(count * q + 1, blocks, dtype=torch.bool, device=keys.device)
    touched[rows, keys // BLOCK] = True
    item, query, block = touched[:-1].view(count, q, blocks).nonzero(as_tuple=True)
    t = tiles(
        item, block, item * q + query, torch.zeros_like(block), pos.clamp_max(n - 1)[query],
        items=count, blocks=blocks, block_size=BLOCK, empty=count * q, size=TILE,
    )  # fmt: skip
    flat = chosen.view(-1)

    def lookup(query_rows: Tensor, positions: Tensor) -> Tensor:
        return flat[query_rows[..., None] * n + positions[:, None, :]]

    return t, lookup


def _steps(m: int, count: int, touched: int):
    step = max(1, min(m, PAIRS // max(1, count * touched)))
    return [(a, min(m, a + step)) for a in range(0, m, step)]


def _flat(x: Tensor) -> Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return torch.cat([flat, flat.new_zeros(1, flat.shape[-1])])


class _SelectedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, keys, ok, q_offset, scale, want_weights):
        count, m, _ = q.shape
        n = k.shape[1]
        kf, vf = k.reshape(count * n, -1), v.reshape(count * n, -1)
        out = q.new_empty(count, m, v.shape[-1])
        lse = q.new_empty(count, m)
        weights = q.new_zeros(keys.shape) if want_weights else None
        touched = min(-(-n // BLOCK), keys.shape[-1])
        for a, b in _steps(m, count, touched):
            pos = torch.arange(a, b, device=q.device) + q_offset
            t, rows = _chunk(keys[:, a:b], ok[:, a:b], pos, n)
            qf = _flat(q[:, a:b])
            o, s = tile_forward(qf, kf, vf, t, n=n, block_size=BLOCK, scale=scale, rows=rows)
            out[:, a:b], lse[:, a:b] = o.view(count, b - a, -1), s.view(count, b - a)
            if want_weights:  # p at the selected keys: exp(e − lse), e = scale · q · k
                lse_f = torch.cat([s, s.new_zeros(1)])
                dense = tile_weights(
                    qf, kf, lse_f, t, n=n, block_size=BLOCK, scale=scale, rows=rows
                )
                picked = dense[:-1].view(count, b - a, n).gather(-1, keys[:, a:b])
                weights[:, a:b] = picked.where(ok[:, a:b], 0.0)
        ctx.save_for_backward(q, k, v, keys, ok, lse)
        ctx.q_offset, ctx.scale = q_offset, scale
        return out, weights

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _grad_weights):
        q, k, v, keys, ok, lse = ctx.saved_tensors
        count, m, _ = q.shape
        n = k.shape[1]
        kf, vf = k.reshape(count * n, -1), v.reshape(count * n, -1)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(kf), torch.zeros_like(vf)
        touched = min(-(-n // BLOCK), keys.shape[-1])
        for a, b in _steps(m, count, touched):
            pos = torch.arange(a, b, device=q.device) + ctx.q_offset
            t, rows = _chunk(keys[:, a:b], ok[:, a:b], pos, n)
            qf, gf = _flat(q[:, a:b]), _flat(grad[:, a:b])
            lse_f = torch.cat([lse[:, a:b].reshape(-1), lse.new_zeros(1)])
            gate = torch.ones_like(lse_f)
            dqf = torch.zeros_like(qf)
            tile_backward(
                qf, kf, vf, gf, lse_f, gate, t, dqf, dk, dv,
                n=n, block_size=BLOCK, scale=ctx.scale, rows=rows,
            )  # fmt: skip
            dq[:, a:b] = dqf[:-1].view(count, b - a, -1)
        return dq, dk.view_as(k), dv.view_as(v), None, None, None, None, None


FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
FLASH_BACKWARD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)
#: mask entries (query rows × causal keys) per fused call
MASK = 1 << 20


def fused_applies(q: Tensor, v: Tensor) -> bool:
    """Whether PyTorch's fused CPU kernel takes q and v (CPU, float32/64, d_v = d)."""
    return (
        FLASH is not None
        and FLASH_BACKWARD is not None
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and q.shape[-1] == v.shape[-1]
    )


def masked_softmax(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, has: Tensor, scale: float
) -> Tensor:
    """Softmax attention of q (b, d) over k, v (L, d) under an additive ``mask`` (b, L), by the
    fused CPU kernel, without autograd -> (b, d); 0 for the rows without ``has``."""
    out = FLASH(
        q[None, None], k[None, None], v[None, None], 0.0, False,
        attn_mask=mask[None, None], scale=scale,
    )[0][0, 0]  # fmt: skip
    return out.masked_fill_(~has[:, None], 0.0)


def fused_chunks(m: int, n: int, q_offset: int):
    """Rows [a, b) and the keys [0, end) they may read, ~MASK mask entries each."""
    step = max(1, MASK // max(1, min(n, q_offset + m)))
    for a in range(0, m, step):
        b = min(m, a + step)
        yield a, b, min(n, q_offset + b)


def _selection_mask(keys: Tensor, end: int, like: Tensor) -> Tensor:
    """(rows, end) additive mask: 0 at the selected keys, −inf elsewhere; the keys scattered
    into rows of −inf (a view of a (rows, end + 1) buffer, whose last column takes the entries
    not available: see :func:`_spare`)."""
    mask = like.new_full((keys.shape[0], end + 1), float("-inf"))
    zero = torch.zeros((), dtype=like.dtype, device=like.device).expand(keys.shape)
    return mask.scatter_(1, keys, zero)[:, :end]


def _spare(keys: Tensor, ok: Tensor, end: int, full: bool) -> Tensor:
    """The keys, those not available (which may name keys past ``end``) moved to ``end``;
    ``full``: every entry is available."""
    return keys if full else torch.where(ok, keys, end)


class _FusedSelected(torch.autograd.Function):
    """The selected keys as a mask over each chunk's causal keys, through PyTorch's fused CPU
    kernel (forward and backward): every key up to the chunk's last is scored (as causal
    attention does) and the mask keeps the selection, with no per-query gather. A row whose
    mask is −inf throughout (no key) gets output 0 and log-sum-exp 0, so that its backward is
    0 too."""

    @staticmethod
    def forward(ctx, q, k, v, keys, ok, q_offset, scale, want_weights):
        count, m, _ = q.shape
        n = k.shape[1]
        out = q.new_empty(count, m, v.shape[-1])
        lse = q.new_empty(count, m)
        weights = q.new_empty(keys.shape) if want_weights else None
        full_rows = ok.all(-1)  # (count, M)
        for c in range(count):
            for a, b, end in fused_chunks(m, n, q_offset):
                every = bool(full_rows[c, a:b].all())
                chosen = _spare(keys[c, a:b], ok[c, a:b], end, every)
                mask = _selection_mask(chosen, end, q)
                qc, kc, vc = q[c, a:b], k[c, :end], v[c, :end]
                o, s = FLASH(
                    qc[None, None], kc[None, None], vc[None, None], 0.0, False,
                    attn_mask=mask[None, None], scale=scale,
                )[:2]  # fmt: skip
                out[c, a:b], lse[c, a:b] = o[0, 0], s[0, 0]
                if not every:  # a row without a key: 0 (the kernel's own result is NaN where
                    # q is not finite)
                    none = ~ok[c, a:b].any(-1)
                    out[c, a:b].masked_fill_(none[:, None], 0.0)
                    lse[c, a:b].masked_fill_(none, 0.0)
                if want_weights:  # p at the selected keys: exp(e − lse)
                    e = torch.matmul(qc, kc.transpose(0, 1))
                    e = e.gather(-1, chosen if every else chosen.clamp_max(end - 1))
                    p = e.mul_(scale).sub_(s[0, 0, :, None]).exp_()
                    weights[c, a:b] = p if every else p.masked_fill_(~ok[c, a:b], 0.0)
        ctx.save_for_backward(q, k, v, keys, ok, out, lse, full_rows)
        ctx.q_offset, ctx.scale = q_offset, scale
        return out, weights

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, _grad_weights):
        q, k, v, keys, ok, out, lse, full_rows = ctx.saved_tensors
        count, m, _ = q.shape
        n = k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grad = grad.contiguous()
        for c in range(count):
            for a, b, end in fused_chunks(m, n, ctx.q_offset):
                every = bool(full_rows[c, a:b].all())
                chosen = _spare(keys[c, a:b], ok[c, a:b], end, every)
                mask = _selection_mask(chosen, end, q)
                args = (grad[c, a:b], q[c, a:b], k[c, :end], v[c, :end], out[c, a:b])
                gq, gk, gv = FLASH_BACKWARD(
                    *(x[None, None] for x in args), lse[c, a:b][None, None], 0.0, False,
                    attn_mask=mask[None, None], scale=ctx.scale,
                )  # fmt: skip
                dq[c, a:b] = gq[0, 0]
                dk[c, :end] += gk[0, 0]
                dv[c, :end] += gv[0, 0]
        return dq, dk, dv, None, None, None, None, None


def selected_softmax(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keys: Tensor,
    ok: Tensor,
    q_offset: int,
    scale: float,
    want_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Softmax attention of query i (at position q_offset + i) over its keys ``keys[i]`` where
    ``ok`` (module docstring).

    Args:
        q: (count, M, d); k, v: (count, N, d), (count, N, d_v).
        keys: (count, M, T) int64 distinct key numbers per row, at most the query's position.
        ok: (count, M, T) bool, the entries the query reads.
        scale: the factor of the dot products.
        want_weights: also return the weights at ``keys`` (count, M, T), without gradient.

    Returns:
        context (count, M, d_v) (0 for a row without a key), differentiable (once) with respect
        to q, k, v; the weights or None.
    """
    q, k, v = (x.contiguous() for x in (q, k, v))
    if fused_applies(q, v):
        return _FusedSelected.apply(q, k, v, keys, ok, q_offset, scale, want_weights)
    return _SelectedSoftmax.apply(q, k, v, keys, ok, q_offset, scale, want_weights)
