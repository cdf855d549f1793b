"""Gated linear attention (Yang, Wang, Shen, Panda and Kim 2023, "Gated Linear Attention
Transformers with Hardware-Efficient Training"): linear attention whose state decays per key
dimension by a data-dependent gate.

Per head (Yang et al. eqs. 3-4): α_t = σ(W_α x_t + b_α)^(1/τ) ∈ (0, 1)^(d_k),
S_t = diag(α_t) S_{t−1} + k_tᵀ v_t, o_t = q_t S_t. In log space log α_t = log σ(·)/τ, and the
parallel and chunkwise forms decay q_i k_j by Π_{j<t≤i} α_t per dimension (eq. 5 and §4.2).
The chunkwise form here applies the decays inside a chunk in log space (one level of chunking;
the paper's secondary sub-chunks serve tensor cores, not the result).

A per-head part does not see the layer input x_t; the gate reads the head's key k_t instead,
α_t = σ(k_t W_α + b_α)^(1/τ) with W_α (d_k × d_k) per head. As k_t = W_k x_t, this is the
paper's low-rank gate W_α = W_α² W_α¹ (their rank 16) with the first factor shared with the key
projection. The output gate and norm of the GLA layer act on the layer's output and are left
to the layer.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.head_registry import REGISTRY
from attnkit.linear_family.base import Inputs, _DecayFamily

__all__ = ["GatedLinearAttention"]


@REGISTRY.register("gla")
class GatedLinearAttention(_DecayFamily):
    """Gated linear attention as a per-head part (see :class:`LinearFamilyPart` for the call).

    Args:
        head_dim: d_k (q is scaled by d_k^−1/2).
        num_heads: H, each with its own gate W_α (d_k × d_k), b_α (d_k).
        tau: the temperature τ of α = σ(·)^(1/τ) (16 in the paper), which keeps the gates near
            1 so that the state forgets slowly.
        form, chunk_size: as :class:`LinearFamilyPart`.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        *,
        tau: float = 16.0,
        form: str = "chunkwise",
        chunk_size: int = 64,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(head_dim, num_heads, form=form, chunk_size=chunk_size)
        self.tau = arguments.finite_float(tau, "tau", positive=True)
        kw = {"device": device, "dtype": dtype}
        self.gate_weight = nn.Parameter(
            torch.randn(num_heads, head_dim, head_dim, **kw) / math.sqrt(head_dim)
        )
        self.gate_bias = nn.Parameter(torch.zeros(num_heads, 1, head_dim, **kw))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tau={self.tau}"

    def log_gates(self, k: Tensor) -> Tensor:
        """log α_t = log σ(k_t W_α + b_α) / τ (…, H, N, d_k), ≤ 0."""
        w, b = self.gate_weight.to(k.dtype), self.gate_bias.to(k.dtype)
        return F.logsigmoid(k @ w + b) / self.tau

    def prepare(self, q: Tensor, k: Tensor, v: Tensor) -> Inputs:
        return Inputs(q / math.sqrt(self.head_dim), k, v, self.log_gates(k))
