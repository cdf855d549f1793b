"""Retention (Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large
Language Models"): causal linear attention whose state decays by a fixed factor γ per step.

Per head (Sun et al. eqs. 1-8): the recurrent form S_n = γ S_{n−1} + k_nᵀ v_n,
o_n = q_n S_n (eq. 6); the parallel form (QKᵀ ⊙ D) V with D_nm = γ^(n−m) for n ≥ m and 0
otherwise (eq. 5); the chunkwise form (eq. 7). Multi-scale retention gives head h the decay
γ_h = 1 − 2^(−5−h) (eq. 8 with h counted from 0), and normalises each head's output by
GroupNorm over its d_v channels (the heads are the groups): the heads' scales differ by their
decays, and the norm makes them comparable.

Left out, and why: the xPos rotation of q and k (the relative position factor e^{inθ} of eq. 5)
is a position scheme: pass ``position="rope"`` to :class:`attnkit.MultiHeadAttention` for the
rotation (xPos's extra length-extrapolation scaling is not offered); the swish output gate
and W_O of the multi-scale retention layer read the layer input X, which a per-head part does
not see; the scaling tricks of the paper's §2.2 (D̃ and R̃ row normalisations) are row scalings
that the GroupNorm removes, so they are not applied.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.derived import DerivedBuffers
from attnkit.head_registry import REGISTRY
from attnkit.linear_family.base import Inputs, _DecayFamily

__all__ = ["Retention", "retention_decays"]


def retention_decays(num_heads: int) -> Tensor:
    """γ_h = 1 − 2^(−5−h) for h = 0 … H − 1 (Sun et al. eq. 8), float64."""
    h = torch.arange(num_heads, dtype=torch.float64)
    return 1 - 2.0 ** (-5 - h)


@REGISTRY.register("retention")
class Retention(DerivedBuffers, _DecayFamily):
    """Multi-scale retention as a per-head part (see :class:`LinearFamilyPart` for the call).

    Args:
        head_dim: d (q and k are scaled by d^−1/2 as in the paper's implementation).
        num_heads: H; head h decays by γ_h = 1 − 2^(−5−h).
        group_norm: normalise each head's output over its channels, with a per-channel affine
            weight and bias (the GroupNorm of multi-scale retention, Sun et al. eq. 8).
        eps: the norm's ε.
        form, chunk_size: as :class:`LinearFamilyPart`.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}
    any_value_size: ClassVar[bool] = False  # its GroupNorm is sized for head_dim values

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        *,
        group_norm: bool = True,
        eps: float = 1e-5,
        form: str = "chunkwise",
        chunk_size: int = 64,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(head_dim, num_heads, form=form, chunk_size=chunk_size)
        self.group_norm = arguments.boolean(group_norm, "group_norm")
        self.eps = arguments.finite_float(eps, "eps", positive=True)
        kw = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        log_gamma = torch.log(retention_decays(num_heads).double()).view(num_heads, 1, 1)
        self.register_derived("log_gamma", log_gamma, **kw)
        if self.group_norm:
            self.norm_weight = nn.Parameter(torch.ones(num_heads, 1, head_dim, **kw))
            self.norm_bias = nn.Parameter(torch.zeros(num_heads, 1, head_dim, **kw))

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.SOFT]

    def prepare(self, q: Tensor, k: Tensor, v: Tensor) -> Inputs:
        if v.shape[-1] != self.head_dim and self.group_norm:
            raise ValueError(
                f"Retention: the GroupNorm has {self.head_dim} channels per head, got v "
                f"{tuple(v.shape)}"
            )
        g = self.log_gamma.to(q.dtype) + torch.zeros_like(k[..., :1])
        return Inputs(q / math.sqrt(self.head_dim), k, v, g)

    def finish(self, out: Tensor, x: Inputs) -> Tensor:
        if not self.group_norm:
            return out
        centred = out - out.mean(-1, keepdim=True)
        normed = centred / torch.sqrt(centred.square().mean(-1, keepdim=True) + self.eps)
        return normed * self.norm_weight.to(out.dtype) + self.norm_bias.to(out.dtype)
