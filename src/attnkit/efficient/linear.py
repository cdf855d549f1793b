"""Linear attention (Katharopoulos, Vyas, Pappas and Fleuret, "Transformers are RNNs: Fast
Autoregressive Transformers with Linear Attention", ICML 2020; Soydaner 5.3): softmax's
similarity replaced by a kernel φ(q)·φ(k), so attention costs O(N) (see
:mod:`attnkit.efficient.kernelized` for the sums and their masks).

The feature map is pluggable: ``"elu+1"`` (the paper's φ(x) = elu(x) + 1, eq. 7), ``"relu"``, or
any module mapping (…, L, d) to non-negative features (…, L, m). Non-causal attention is eq. 5;
``causal=True`` is eqs. 8-9 by prefix sums; :meth:`LinearAttention.step` is the recurrent form
(eqs. 18-20) for decoding one position at a time.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from attnkit import arguments, hooks, masks
from attnkit import taxonomy as tx
from attnkit.efficient import kernelized as kz
from attnkit.efficient.feature_maps import (
    FEATURE_MAPS,
    EluPlusOne,
    ReLUFeatures,
    attend,
    causal_rows,
    check_causal,
    make_feature_map,
)
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["FEATURE_MAPS", "EluPlusOne", "LinearAttention", "ReLUFeatures", "make_feature_map"]


class _EluLinear(torch.autograd.Function):
    """Non-causal linear attention with φ = elu + 1 (Katharopoulos eqs. 5 and 7) as one node:

        out_i = Sᵀ φ(q_i) / den_i,   S = Σ_j φ(k_j) v_jᵀ (m × d_v),
        den_i = φ(q_i)ᵀ s,   s = Σ_j φ(k_j).

    The node keeps only the inputs (referenced, not copied), S, s and r = 1/den: the maps and
    the output are freed after the forward pass, and the backward pass forms φ(q) again, uses
    it, frees it, then does the same with φ(k), so at most two (…, L, m) maps are alive at once
    besides the gradients. The derivative of the map is read from the map itself: φ'(x) = 1
    for x > 0 and eˣ = φ(x) for x ≤ 0, that is min(φ(x), 1). With g = ∂L/∂out, g' = g r and
    P = S g' (the (…, M, m) product ∂L/∂φ(q) needs anyway), g'_i · out_i = r_i φ(q_i) · P_i:

        ∂L/∂den_i = −r_i φ(q_i) · P_i,   ∂L/∂φ(q_i) = P_i + (∂L/∂den_i) s,
        ∂L/∂S = Σ_i φ(q_i) g'_iᵀ,   ∂L/∂s = Σ_i φ(q_i) ∂L/∂den_i,
        ∂L/∂φ(k_j) = ∂L/∂S v_j + ∂L/∂s,   ∂L/∂v_j = (∂L/∂S)ᵀ φ(k_j).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        fk = F.elu(k).add_(1)
        s = fk.sum(-2, keepdim=True)  # (…, 1, m)
        kv = fk.transpose(-1, -2) @ v  # S (…, m, d_v)
        del fk
        fq = F.elu(q).add_(1)
        den = fq @ s.transpose(-1, -2)  # (…, M, 1)
        r = torch.where(den != 0, den.reciprocal(), 0)  # a row with no kernel mass gets 0
        out = (fq @ kv).mul_(r)
        ctx.save_for_backward(q, k, v, kv, s, r)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, kv, s, r = ctx.saved_tensors
        fq = F.elu(q).add_(1)
        gr = g * r
        dkv = fq.transpose(-1, -2) @ gr  # ∂L/∂S (…, m, d_v)
        dq = gr @ kv.transpose(-1, -2)  # P
        del gr
        dden = (fq * dq).sum(-1, keepdim=True).mul_(r).neg_()  # ∂L/∂den (…, M, 1)
        ds = (fq.transpose(-1, -2) @ dden).transpose(-1, -2)  # ∂L/∂s (…, 1, m)
        dq.addcmul_(dden, s).mul_(fq.clamp_(max=1))
        del fq, dden
        fk = F.elu(k).add_(1)
        dv = fk @ dkv
        dk = (v @ dkv.transpose(-1, -2)).add_(ds).mul_(fk.clamp_(max=1))
        return dq, dk, dv


@REGISTRY.register("linear")
class LinearAttention(HeadAttention):
    """Linear attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with q
    (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        feature_map: ``"elu+1"``, ``"relu"`` or a module giving non-negative features.
        causal: query i attends keys j ≤ i (needs M = N).
        chunk_size: block length of the causal prefix sums (memory vs. parallelism).

    Masks: key padding masks (…, 1, N) are honoured; a mask varying over queries is refused
    (ValueError). A bias cannot be added to a kernel's factorised scores and is refused.
    """

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    # causal=True: queries after a KV cache are the last rows of the causal sequence
    takes_q_offset: ClassVar[bool] = True

    def __init__(
        self, feature_map: str | nn.Module = "elu+1", *, causal: bool = False, chunk_size: int = 64
    ) -> None:
        super().__init__()
        self.phi = make_feature_map(feature_map)
        self.causal = arguments.boolean(causal, "causal")
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        self.align = kz.KernelNormalized()

    @property
    def decodes_with_cache(self) -> bool:
        """Causal, a decoding step over the cached keys equals its rows of the causal pass."""
        return self.causal

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (1, 2, 3))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.AlignmentKind.SOFT]

    def extra_repr(self) -> str:
        return f"causal={self.causal}, chunk_size={self.chunk_size}"

    def features(self, x: Tensor) -> Tensor:
        """φ(x) (…, L, m)."""
        return self.phi(x)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        q_offset: int,
    ) -> AttentionOutput:
        who = type(self).__name__
        rows = causal_rows(self, q, k, v, q_offset, mask=mask, bias=bias, need_weights=need_weights)
        if rows is not None:  # queries after a KV cache: the last rows of the causal sequence
            return rows
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if self.causal:
            check_causal(q, k, who)
        keep = kz.key_mask(mask, torch.Size((*lead, q.shape[-2], k.shape[-2])), who)
        if keep is None and not need_weights and self._fused(q, k, v):
            return AttentionOutput(_EluLinear.apply(q, k, v))
        # Elementwise maps (…, L, d) are the inputs' size: formed whole, they cost no more
        # memory than the inputs and no recomputation in the backward pass.
        fq, fk = self.features(q), self.features(k)
        return attend(self, fq, fk, v, keep, need_weights)

    def _fused(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether the non-causal elu + 1 context can be one autograd node (:class:`_EluLinear`):
        this class's map, no listener (who would read the weights), inputs of one dtype and
        leading dims (its gradients are not reduced over broadcast dims)."""
        return (
            not self.causal
            and type(self.phi) is EluPlusOne
            and type(self).features is LinearAttention.features
            and not hooks.listening()
            and q.dtype == k.dtype == v.dtype
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
        )

    def step(
        self, q: Tensor, k: Tensor, v: Tensor, state: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One decoding step of causal linear attention (Katharopoulos eqs. 18-20).

        Args:
            q, k: (B, …, d) the current position's query and key; v: (B, …, d_v).
            state: what the previous step returned, or None at the first position.

        Returns:
            the context (B, …, d_v) and the state (S (B, …, m, d_v), z (B, …, m)).
        """
        return kz.step(state, self.features(q), self.features(k), v)
