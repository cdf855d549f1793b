"""Differential attention (Ye et al., "Differential Transformer", ICLR 2025, arXiv 2410.05258).

Each head's query and key are split in two halves, [Q_1; Q_2] and [K_1; K_2] of d features each,
giving two softmax maps over the same keys; their difference cancels the attention both maps
give to irrelevant context ("attention noise"), as a differential amplifier cancels common-mode
noise (Ye et al. eq. 1):

    DiffAttn(X) = (softmax(Q_1 K_1ᵀ / √d) − λ softmax(Q_2 K_2ᵀ / √d)) V,

with the scalar λ re-parameterised by learnable vectors λ_q1, λ_k1, λ_q2, λ_k2 ∈ R^d (eq. 2)

    λ = exp(λ_q1 · λ_k1) − exp(λ_q2 · λ_k2) + λ_init,
    λ_init = 0.8 − 0.6 · exp(−0.3 · (l − 1)),   l ∈ [1, L] the layer's depth.

Each head's output is normalised on its own (the paper's GroupNorm: RMSNorm over the head's
value features) and scaled by (1 − λ_init) so that the gradient flow matches a Transformer's
(eq. 3):

    head_i = (1 − λ_init) · RMSNorm(DiffAttn_i(X)),

and ``MultiHeadAttention`` concatenates the heads and applies W^O. In the paper a head has
d = d_model / (2h) features per half and 2d value features, so that h differential heads cost
what 2h ordinary ones do: ``MultiHeadAttention(E, h, attention=DifferentialAttention(E // h))``
gives each head 2d = E / h features. The paper's RMSNorm has a learnable gain per feature; a
gain before W^O is absorbed into W^O, so it is left out (as in Hugging Face's DiffLlama).

The two maps are computed by one core call over a stacked pair (…, 2, M, N), so masks, biases
and position schemes act on both exactly as on ordinary attention.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["DifferentialAttention", "lambda_init"]


def lambda_init(depth: int) -> float:
    """λ_init = 0.8 − 0.6 · exp(−0.3 · (l − 1)) for the layer at depth l ≥ 1 (Ye et al. eq. 2)."""
    depth = arguments.positive_int(depth, "depth")
    return 0.8 - 0.6 * math.exp(-0.3 * (depth - 1))


@REGISTRY.register("differential")
class DifferentialAttention(HeadAttention):
    """Differential attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with
    q (B, …, M, 2d), k (B, …, N, 2d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        head_dim: 2d, the query/key size of a head (even): its first d features are Q_1 / K_1,
            the last d are Q_2 / K_2.
        depth: l ≥ 1, the layer's depth, which sets λ_init (eq. 2).
        eps: the RMSNorm's ε.
        lambda_std: standard deviation of the λ vectors' normal initialisation (0.1 in the
            paper's code).
        device, dtype: of the λ vectors.

    Masks and biases are those of ordinary attention and apply to both maps. A row with no key
    gives context 0.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    decodes_with_cache: ClassVar[bool] = True  # each query's rows are over the keys it is given

    def __init__(
        self,
        head_dim: int,
        depth: int = 1,
        *,
        eps: float = 1e-5,
        lambda_std: float = 0.1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        if head_dim % 2:
            raise ValueError(
                f"head_dim must be even (two halves Q_1, Q_2 of d features each), got {head_dim}"
            )
        self.depth = arguments.positive_int(depth, "depth")
        self.lambda_init = lambda_init(depth)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"eps must be a number > 0, got {eps!r}")
        self.eps = float(eps)
        if isinstance(lambda_std, bool) or not isinstance(lambda_std, (int, float)):
            raise TypeError(f"lambda_std must be a number >= 0, got {lambda_std!r}")
        if not lambda_std >= 0:
            raise ValueError(f"lambda_std must be >= 0, got {lambda_std!r}")
        d = head_dim // 2
        kw = {"device": device, "dtype": dtype}
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(d, **kw) * lambda_std) for _ in range(4)
        )
        self.attention = Attention("scaled_dot", "softmax")

    @classmethod
    def example(cls):
        q, k = (example_tensor(2, 2, 6, 4, seed=s) for s in (31, 32))
        v = example_tensor(2, 2, 6, 3, seed=33)
        mask = masks.from_lengths(torch.tensor([6, 3]), 6)[:, None].expand(2, 2, 1, 6)
        return cls(4, depth=2, lambda_std=0.5), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.GLOBAL]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, depth={self.depth}, lambda_init={self.lambda_init:.4f}"

    def lam(self) -> Tensor:
        """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init (eq. 2), a scalar tensor."""
        return (
            torch.exp(torch.dot(self.lambda_q1, self.lambda_k1))
            - torch.exp(torch.dot(self.lambda_q2, self.lambda_k2))
            + self.lambda_init
        )

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:
        """The context (1 − λ_init) · RMSNorm((A_1 − λ A_2) V) (eqs. 1 and 3); with
        ``need_weights=True`` also the weights, the differential map A_1 − λ A_2 (…, M, N),
        signed, its rows summing to 1 − λ, and the two softmax maps by name in ``extra``:
        ``maps``, A_1 and A_2 stacked (…, 2, M, N). ``scores`` and ``log_prob`` are None."""
        who = type(self).__name__
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"{who}(head_dim={self.head_dim}) got q with {q.shape[-1]} features")
        d = self.head_dim // 2
        pair = torch.Size((*lead, 1, q.shape[-2], k.shape[-2]))  # (…, 1, M, N): both maps
        qs = torch.stack((q[..., :d], q[..., d:]), dim=-3)  # (…, 2, M, d)
        ks = torch.stack((k[..., :d], k[..., d:]), dim=-3)
        mask = None if mask is None else mask.broadcast_to(pair[:-3] + pair[-2:]).unsqueeze(-3)
        bias = None if bias is None else bias.broadcast_to(pair[:-3] + pair[-2:]).unsqueeze(-3)
        out = self.attention(
            qs, ks, v.unsqueeze(-3), mask=mask, bias=bias, need_weights=need_weights
        )
        lam = self.lam().to(q.dtype)
        diff = out.context[..., 0, :, :] - lam * out.context[..., 1, :, :]  # eq. 1
        context = (1 - self.lambda_init) * F.rms_norm(diff, (diff.shape[-1],), eps=self.eps)
        if not need_weights:
            return AttentionOutput(context)
        maps = out.weights
        diff_map = maps[..., 0, :, :] - lam * maps[..., 1, :, :]
        return AttentionOutput(context, diff_map, extra={"maps": maps})
