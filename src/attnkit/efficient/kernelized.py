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
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import masks
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment, AlignOutput

__all__ = [
    "KernelNormalized",
    "causal_feature_attention",
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
    kv = torch.einsum("...nm,...nd->...md", fk, v)
    num = fq @ kv
    den = (fq * fk.sum(-2, keepdim=True)).sum(-1, keepdim=True)
    return _divide(num, den)


def causal_feature_attention(
    fq: Tensor, fk: Tensor, v: Tensor, keep: Tensor | None = None, chunk_size: int = 64
) -> Tensor:
    """Causal kernelized attention by block prefix sums (Katharopoulos eqs. 8-9): query i sees
    keys j ≤ i. Shapes as :func:`feature_attention` with M = N."""
    fk, v = _drop(fk, keep), _drop(v, keep)
    lead = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2])
    n, m, dv = fq.shape[-2], fq.shape[-1], v.shape[-1]
    c = min(chunk_size, n)
    pad = -n % c
    fq, fk, v = (
        torch.nn.functional.pad(x.broadcast_to(*lead, n, x.shape[-1]), (0, 0, 0, pad))
        for x in (fq, fk, v)
    )
    blocks = (n + pad) // c
    fq, fk, v = (x.reshape(*lead, blocks, c, x.shape[-1]) for x in (fq, fk, v))
    # state of all earlier blocks: exclusive prefix sums over blocks
    block_kv = torch.einsum("...cnm,...cnd->...cmd", fk, v)
    block_z = fk.sum(-2)
    prev_kv = block_kv.cumsum(-3) - block_kv
    prev_z = block_z.cumsum(-2) - block_z
    within = (fq @ fk.transpose(-1, -2)).tril()  # (…, blocks, C, C): j ≤ i inside the block
    num = fq @ prev_kv + within @ v
    den = (fq * prev_z.unsqueeze(-2)).sum(-1, keepdim=True) + within.sum(-1, keepdim=True)
    out = _divide(num, den).reshape(*lead, blocks * c, dv)
    del m
    return out[..., :n, :]


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
