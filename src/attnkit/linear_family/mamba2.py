"""The Mamba-2 state-space layer as attention (Dao and Gu 2024, "Transformers are SSMs:
Generalized Models and Efficient Algorithms Through Structured State Space Duality").

Per head, with a scalar decay (the SSD case A = a·I): Δ_t = softplus(Δ-projection + b_Δ),
a_t = exp(Δ_t A) with A = −exp(A_log) < 0, and

    S_t = a_t S_{t−1} + (Δ_t B_t)ᵀ x_t,    y_t = C_t S_t + D x_t           (Dao and Gu §3, eq. 2)

— the recurrent (linear) form. Unrolled it is masked attention y = (L ∘ C Bᵀ) x + D x with the
1-semiseparable mask L_ij = a_{j+1} ⋯ a_i = exp(Σ_{j<t≤i} Δ_t A) for i ≥ j (§4, "structured
masked attention"): the quadratic form; the SSD algorithm evaluates it by chunks (§6): the
chunkwise form. Mapped onto the attention slot: C ↔ q, B ↔ k, x ↔ v; the state size N of the
paper is d_k here, its head dimension P is d_v.

A per-head part does not see the layer input u_t, so Δ_t reads the head's B_t = k_t:
Δ_t = softplus(w_Δ · k_t + b_Δ). The convolution before the SSM, the gate z and the norm act on
the layer's input and output and are left to the layer.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.head_registry import REGISTRY
from attnkit.linear_family import decay
from attnkit.linear_family.base import Inputs, _DecayFamily

__all__ = ["Mamba2SSD"]


@REGISTRY.register("mamba2")
class Mamba2SSD(_DecayFamily):
    """The SSD layer of Mamba-2 as a per-head part (see :class:`LinearFamilyPart` for the call):
    q is C, k is B, v is x.

    Args:
        head_dim: d_k, the state size (of B and C); no scaling of C (as in Mamba-2).
        num_heads: H, each with its own A = −exp(A_log), b_Δ, w_Δ (d_k) and skip D.
        form, chunk_size: as :class:`LinearFamilyPart`.

    Initialised as Mamba-2: A ∈ −[1, 16], Δ = softplus(b_Δ) ∈ [10⁻³, 10⁻¹] (log-uniform), D = 1.
    The weights include the skip D on the diagonal (y = W x).
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        *,
        form: str = "chunkwise",
        chunk_size: int = 64,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(head_dim, num_heads, form=form, chunk_size=chunk_size)
        kw = {"device": device, "dtype": dtype}
        self.A_log, self.dt_bias = decay.mamba2_decay_parameters(num_heads, **kw)
        self.dt_weight = nn.Parameter(torch.randn(num_heads, head_dim, 1, **kw) / head_dim)
        self.D = nn.Parameter(torch.ones(num_heads, 1, 1, **kw))

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.MULTIPLICATIVE, tx.AlignmentKind.SOFT]

    def steps(self, k: Tensor) -> Tensor:
        """Δ_t = softplus(w_Δ · B_t + b_Δ) (…, H, N, 1)."""
        return F.softplus(k @ self.dt_weight.to(k.dtype) + self.dt_bias.to(k.dtype))

    def prepare(self, q: Tensor, k: Tensor, v: Tensor) -> Inputs:
        dt = self.steps(k)
        g = dt * -torch.exp(self.A_log.to(k.dtype))  # log a_t = Δ_t A
        return Inputs(q, k * dt, v, g)

    def finish(self, out: Tensor, x: Inputs) -> Tensor:
        return out + self.D.to(out.dtype) * x.v

    def dense_weights(self, x: Inputs) -> Tensor:
        n = x.q.shape[-2]
        eye = torch.eye(n, dtype=x.q.dtype, device=x.q.device)
        return super().dense_weights(x) + self.D.to(x.q.dtype) * eye
