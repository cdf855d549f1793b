"""Kernelized attention, the shared core of linear attention, fast weight programmers, Performer
and RFA (Katharopoulos et al., "Transformers are RNNs", ICML 2020, eqs. 2-9; Soydaner 5.3).

Softmax attention weighs value j for query i by sim(q_i, k_j) = exp(q_i·k_j/√d). Replacing sim by
a kernel with a feature map, sim(q, k) = φ(q)·φ(k), lets the sum over keys be taken once
(Katharopoulos eq. 5, the associativity of the matrix product):

    y_i = φ(q_i)ᵀ (Σ_j φ(k_j) v_jᵀ) / φ(q_i)ᵀ (Σ_j φ(k_j)),

O(N·m·d) instead of O(N²·d) for m features. The causal form restricts both sums to j ≤ i
(eqs. 8-9): prefix sums S_i = Σ_{j≤i} φ(k_j) v_jᵀ and z_i = Σ_{j≤i} φ(k_j), which a recurrent
network carries step by step (:func:`step`). Here the prefix sums are taken by blocks: within a
block of C positions the masked products are formed densely (C × C), and the state of all earlier
blocks enters through its block-level prefix sum, so memory stays O(N·C + N/C·m·d) rather than
the O(N·m·d) of a per-position cumulative sum.

Padding masks over keys are honoured by dropping the padded keys from both sums (``torch.where``,
so that whatever the padded rows hold, NaN included, never enters). A mask that varies over
queries cannot be honoured in this factorised form (the sums would differ per query): use the
causal variant for the causal mask; any other such mask is refused with a ValueError. A query
whose denominator is 0 (no key, or a ReLU feature map that vanishes) gets context 0.

Working set (:func:`chunked_feature_attention`). The non-causal sums are the same whether the
feature maps are formed at once, (…, N, m), or a chunk of rows at a time: the key sums
Σ_j φ(k_j) v_jᵀ and Σ_j φ(k_j) are accumulated over key chunks, then each chunk of queries is
answered from them. With m random features larger than d (Performer, RFA) the whole maps are
many times the cache at long N and every elementwise pass over them goes to main memory; by
chunks (and with the maps recomputed chunk by chunk in the backward pass instead of kept) the
working set stays a few MiB whatever N, so time grows as N, and memory holds only the inputs
and the (m × d_v) sums. Maps small enough to stay in cache anyway (:data:`WHOLE_BYTES`) are
formed whole, which is faster there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attnkit import masks
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment, AlignOutput
from attnkit.inputs import broadcast_shapes
from attnkit.kernels.base import guarded_sum

__all__ = [
    "KernelNormalized",
    "causal_feature_attention",
    "chunked_feature_attention",
    "dense_feature_weights",
    "feature_attention",
    "key_mask",
    "step",
]


class KernelNormalized(Alignment):
    """The alignment of kernelized attention: kernel values s_ij = φ(q_i)·φ(k_j) normalised
    over the keys, a_ij = s_ij / Σ_l s_il (Katharopoulos eq. 4); masked keys get 0 and a row
    whose kernel values sum to 0 gets weights 0. The scores are the kernel values (≥ 0 for the
    positive feature maps; RFA's trigonometric features can make an estimate negative)."""

    label = tx.AlignmentKind.SOFT

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        s = scores if mask is None else torch.where(mask, scores, torch.zeros_like(scores))
        total = s.sum(-1, keepdim=True)
        ok = total != 0
        return AlignOutput(torch.where(ok, s / torch.where(ok, total, 1), 0))


def key_mask(mask: Tensor | None, shape: torch.Size, who: str) -> Tensor | None:
    """A boolean mask broadcastable to ``shape`` (…, M, N) as a key mask (…, N, 1), or a
    ValueError when it varies over queries (a factorised sum over keys cannot honour it)."""
    if mask is None:
        return None
    masks.check(mask, shape)
    if mask.dim() >= 2 and mask.shape[-2] != 1 and shape[-2] != 1:
        rows = mask.broadcast_to(shape)
        if not (rows == rows[..., :1, :]).all():
            raise ValueError(
                f"{who}: the mask varies over queries (shape {tuple(mask.shape)}); kernelized "
                "attention sums over keys once for all queries, so it honours only key padding "
                "masks (…, 1, N) (use causal=True for the causal mask)"
            )
        mask = mask[..., :1, :]
    return mask.transpose(-1, -2)  # (…, N, 1)


def _drop(x: Tensor, keep: Tensor | None) -> Tensor:
    return x if keep is None else torch.where(keep, x, torch.zeros((), dtype=x.dtype))


def _divide(num: Tensor, den: Tensor) -> Tensor:
    ok = den != 0
    return torch.where(ok, num / torch.where(ok, den, 1), 0)


def feature_attention(fq: Tensor, fk: Tensor, v: Tensor, keep: Tensor | None = None) -> Tensor:
    """Non-causal kernelized attention (Katharopoulos eq. 5).

    Args:
        fq: φ(q) (…, M, m); fk: φ(k) (…, N, m); v: (…, N, d_v).
        keep: key mask (…, N, 1) from :func:`key_mask`, or None.

    Returns:
        context (…, M, d_v).
    """
    fk, v = _drop(fk, keep), _drop(v, keep)
    kv = fk.transpose(-1, -2) @ v
    num = fq @ kv
    den = fq @ fk.sum(-2).unsqueeze(-1)  # (…, M, 1)
    ok = den != 0
    out = num * torch.where(ok, 1 / torch.where(ok, den, 1), 0)  # one pass over (…, M, d_v)
    if not bool(ok.all()):  # a row with no kernel mass: context 0 whatever num holds
        out = torch.where(ok, out, 0)
    return out


FeatureMap = Callable[..., Tensor]
"""φ(x, *params): features (…, L, m) of rows x (…, L, d), row by row (a constant it subtracts,
such as a stabiliser, is fixed before the call, so that a chunk of rows gets the rows of the
whole map)."""

CHUNK_ELEMENTS = 1 << 18
"""Elements of a chunk's feature map (all leading dims together): 1 MiB in float32, so that
the few maps alive at once while a chunk is processed stay in a core's cache."""


WHOLE_BYTES = 8 << 20
"""Feature maps up to this size are formed whole (and kept for the backward pass): while they
fit in cache, recomputing them by chunks costs more than it saves."""


def chunk_rows(lead: torch.Size, m: int, elements: int | None = None) -> int:
    """Rows per chunk (at least 16) so that a chunk's (…, rows, m) map has about ``elements``
    entries (default :data:`CHUNK_ELEMENTS`)."""
    elements = CHUNK_ELEMENTS if elements is None else elements
    return max(16, elements // max(1, lead.numel() * m))


def _rows(x: Tensor | None, start: int, stop: int) -> Tensor | None:
    if x is None or x.shape[-2] == 1:  # a key mask may broadcast over the keys
        return x
    return x[..., start:stop, :]


def _starts(n: int, c: int) -> range:
    return range(0, max(n, 1), c)  # one (empty) chunk when n = 0


def _key_sums(
    phi_k: FeatureMap, k: Tensor, v: Tensor, keep: Tensor | None, c: int, params: Sequence[Tensor]
) -> tuple[Tensor, Tensor]:
    """Σ_j φ(k_j) v_jᵀ (…, m, d_v) and Σ_j φ(k_j) (…, m) over the kept keys, chunk by chunk."""
    kv = z = None
    for s in _starts(k.shape[-2], c):
        part_kv, part_z = _key_chunk(phi_k, k[..., s : s + c, :], v[..., s : s + c, :],
                                     _rows(keep, s, s + c), params)  # fmt: skip
        kv = part_kv if kv is None else kv + part_kv
        z = part_z if z is None else z + part_z
    return kv, z


def _key_chunk(
    phi_k: FeatureMap, k: Tensor, v: Tensor, keep: Tensor | None, params: Sequence[Tensor]
) -> tuple[Tensor, Tensor]:
    fk = _drop(phi_k(k, *params), keep)
    return fk.transpose(-1, -2) @ _drop(v, keep), fk.sum(-2)


def _query_chunk(
    phi_q: FeatureMap, q: Tensor, kv: Tensor, z: Tensor, params: Sequence[Tensor]
) -> Tensor:
    fq = phi_q(q, *params)
    return _divide(fq @ kv, fq @ z.unsqueeze(-1))


def _leaf(x: Tensor, grad: bool) -> Tensor:
    return x.detach().requires_grad_(grad)


class _ChunkedFeatureAttention(torch.autograd.Function):
    """Forward by chunks without keeping any feature map; backward recomputes each chunk's
    maps and differentiates the chunk (autograd on the chunk), so neither pass holds more than
    a chunk of features."""

    @staticmethod
    def forward(ctx, phi_q, phi_k, c, keep, q, k, v, *params):
        kv, z = _key_sums(phi_k, k, v, keep, c, params)
        chunks = [q[..., s : s + c, :] for s in _starts(q.shape[-2], c)]
        out = torch.cat([_query_chunk(phi_q, qc, kv, z, params) for qc in chunks], -2)
        ctx.phi, ctx.c = (phi_q, phi_k), c
        ctx.save_for_backward(q, k, v, kv, z, *params)
        ctx.keep = keep
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (phi_q, phi_k), c, keep = ctx.phi, ctx.c, ctx.keep
        q, k, v, kv, z, *params = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[4:7]
        need_p = ctx.needs_input_grad[7:]
        if torch.is_grad_enabled():  # create_graph: gradients that are differentiable again
            return (None, None, None, None, *_whole_grads(ctx, grad_out, q, k, v, params))
        gq = torch.zeros_like(q) if need_q else None
        gk = torch.zeros_like(k) if need_k else None
        gv = torch.zeros_like(v) if need_v else None
        gp = [torch.zeros_like(p) if need else None for p, need in zip(params, need_p, strict=True)]
        need_sums = need_k or need_v or any(need_p)
        with torch.enable_grad():
            leaves_p = [_leaf(p, need) for p, need in zip(params, need_p, strict=True)]
            kv_, z_ = _leaf(kv, need_sums), _leaf(z, need_sums)
            gkv = torch.zeros_like(kv) if need_sums else None
            gz = torch.zeros_like(z) if need_sums else None
            # queries: y_c = φ(q_c)ᵀS / φ(q_c)ᵀz; gradients to q_c, S, z and the parameters
            for s in _starts(q.shape[-2], c):
                qc = _leaf(q[..., s : s + c, :], need_q)
                out = _query_chunk(phi_q, qc, kv_, z_, leaves_p)
                wrt = [(qc, gq, s)] if need_q else []
                wrt += [(kv_, gkv, None), (z_, gz, None)] if need_sums else []
                wrt += [(p, g, None) for p, g in zip(leaves_p, gp, strict=True) if g is not None]
                _accumulate(out, grad_out[..., s : s + c, :], wrt)
            if need_sums:  # keys: S = Σ φ(k_j) v_jᵀ, z = Σ φ(k_j); gradients to k, v, parameters
                for s in _starts(k.shape[-2], c):
                    kc = _leaf(k[..., s : s + c, :], need_k)
                    vc = _leaf(v[..., s : s + c, :], need_v)
                    part = _key_chunk(phi_k, kc, vc, _rows(keep, s, s + c), leaves_p)
                    wrt = [(kc, gk, s)] if need_k else []
                    wrt += [(vc, gv, s)] if need_v else []
                    wrt += [
                        (p, g, None) for p, g in zip(leaves_p, gp, strict=True) if g is not None
                    ]
                    _accumulate(part, (gkv, gz), wrt)
        return (None, None, None, None, gq, gk, gv, *gp)


def _whole_grads(ctx, grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, params: list) -> list:
    """The gradients through the whole maps, with their own graph (for second derivatives,
    e.g. a gradient penalty; memory as the unchunked computation)."""
    (phi_q, phi_k), keep = ctx.phi, ctx.keep
    inputs = [q, k, v, *params]
    need = ctx.needs_input_grad[4:]
    out = feature_attention(phi_q(q, *params), phi_k(k, *params), v, keep)
    wanted = [x for x, n in zip(inputs, need, strict=True) if n]
    found = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=True, allow_unused=True))
    return [next(found) if n else None for n in need]


def _accumulate(
    outputs: Tensor | tuple[Tensor, ...],
    grads: Tensor | tuple[Tensor, ...],
    wrt: list[tuple[Tensor, Tensor, int | None]],
) -> None:
    """Add d(outputs)/d(leaf) · grads into each target: at rows start: of it, or all of it."""
    if isinstance(outputs, Tensor):
        outputs, grads = (outputs,), (grads,)
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    if not wrt or not pairs:  # e.g. Σ φ(k_j) when only v asks for gradients
        return
    found = torch.autograd.grad(
        [o for o, _ in pairs],
        [leaf for leaf, _, _ in wrt],
        [g for _, g in pairs],
        allow_unused=True,
    )
    for (leaf, target, start), g in zip(wrt, found, strict=True):
        if g is None:
            continue
        if start is None:
            target += g
        else:
            target[..., start : start + leaf.shape[-2], :] += g


def chunked_feature_attention(
    phi_q: FeatureMap,
    phi_k: FeatureMap,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None = None,
    *,
    params: Sequence[Tensor] = (),
    chunk_size: int,
) -> Tensor:
    """Non-causal kernelized attention (Katharopoulos eq. 5) from the inputs, by chunks of
    ``chunk_size`` rows: :func:`feature_attention` of ``phi_q(q)``, ``phi_k(k)`` up to float
    rounding, without ever forming the (…, N, m) maps (see the module's "Working set").

    Args:
        phi_q, phi_k: feature maps ``phi(x, *params)`` acting row by row.
        q: (…, M, d); k: (…, N, d); v: (…, N, d_v).
        keep: key mask (…, N, 1) from :func:`key_mask`, or None.
        params: the tensors the maps take after x (their gradients are returned).
        chunk_size: rows per chunk (:func:`chunk_rows`).

    Returns:
        context (…, M, d_v).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedFeatureAttention.apply(phi_q, phi_k, chunk_size, keep, q, k, v, *params)


def causal_feature_attention(
    fq: Tensor, fk: Tensor, v: Tensor, keep: Tensor | None = None, chunk_size: int = 64
) -> Tensor:
    """Causal kernelized attention by block prefix sums (Katharopoulos eqs. 8-9): query i sees
    keys j ≤ i. Shapes as :func:`feature_attention` with M = N."""
    fk, v = _drop(fk, keep), _drop(v, keep)
    lead = broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2])
    n, m, dv = fq.shape[-2], fq.shape[-1], v.shape[-1]
    c = min(chunk_size, n)
    pad = -n % c
    fq, fk, v = (
        torch.nn.functional.pad(x.broadcast_to(*lead, n, x.shape[-1]), (0, 0, 0, pad))
        for x in (fq, fk, v)
    )
    blocks = (n + pad) // c
    fq, fk, v = (x.reshape(*lead, blocks, c, x.shape[-1]) for x in (fq, fk, v))
    # state of all earlier blocks: exclusive prefix sums over blocks (by a shifted sum, not by
    # subtracting the block itself, so that a non-finite later key cannot reach earlier rows)
    block_kv = torch.einsum("...cnm,...cnd->...cmd", fk, v)
    block_z = fk.sum(-2)
    prev_kv = _exclusive_cumsum(block_kv, -3)
    prev_z = _exclusive_cumsum(block_z, -2)
    within = (fq @ fk.transpose(-1, -2)).tril()  # (…, blocks, C, C): j ≤ i inside the block
    if torch.compiler.is_compiling() or bool(torch.isfinite(v).all()):
        num = fq @ prev_kv + within @ v
    else:  # a later value in the block is NaN or infinite: weight 0 must mean no influence
        num = fq @ prev_kv + guarded_sum(torch.matmul, within, v)
    den = (fq * prev_z.unsqueeze(-2)).sum(-1, keepdim=True) + within.sum(-1, keepdim=True)
    out = _divide(num, den).reshape(*lead, blocks * c, dv)
    del m
    return out[..., :n, :]


def _exclusive_cumsum(x: Tensor, dim: int) -> Tensor:
    """Σ_{b' < b} x_b' along ``dim``: the sums of the blocks before each block."""
    zero = torch.zeros_like(x.narrow(dim, 0, 1))
    return torch.cat((zero, x.narrow(dim, 0, x.shape[dim] - 1).cumsum(dim)), dim)


def step(
    state: tuple[Tensor, Tensor] | None, fq: Tensor, fk: Tensor, v: Tensor
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One recurrent step of causal kernelized attention (Katharopoulos eqs. 18-20):
    S_i = S_{i−1} + φ(k_i) v_iᵀ, z_i = z_{i−1} + φ(k_i), y_i = φ(q_i)ᵀS_i / φ(q_i)ᵀz_i.

    Args:
        state: (S (…, m, d_v), z (…, m)) or None for the empty prefix.
        fq, fk: (…, m); v: (…, d_v) — one position.

    Returns:
        y_i (…, d_v) and the new state.
    """
    if state is None:
        s = fk.new_zeros(*fk.shape, v.shape[-1])
        z = fk.new_zeros(fk.shape)
    else:
        s, z = state
    s = s + fk.unsqueeze(-1) * v.unsqueeze(-2)
    z = z + fk
    num = (fq.unsqueeze(-1) * s).sum(-2)
    den = (fq * z).sum(-1, keepdim=True)
    return _divide(num, den), (s, z)


def dense_feature_weights(
    align: KernelNormalized, fq: Tensor, fk: Tensor, keep: Tensor | None, causal: bool
) -> Tensor:
    """The weights (…, M, N) that kernelized attention applies, formed densely (O(M·N); only
    when asked for): a_ij = φ(q_i)·φ(k_j) / Σ_l φ(q_i)·φ(k_l) over the keys it may attend."""
    fk = _drop(fk, keep)
    scores = fq @ fk.transpose(-1, -2)
    mask = None if keep is None else keep.transpose(-1, -2)
    if causal:
        tri = masks.causal(scores.shape[-2], scores.shape[-1], device=scores.device)
        mask = tri if mask is None else mask & tri
    return align(scores, mask).weights
