"""Attention gates (Oktay et al. 2018, "Attention U-Net", Sec. 2.2; Brauwers Table III).

A gating signal g from a coarser level of the network (a specialized query) decides, for every
pixel i of the skip features x^l (B, F_l, H, W), how much of it passes:
q_att = ψᵀ σ_1(W_xᵀ x_i + W_gᵀ g_i + b_g) + b_ψ (eq. 1, additive attention with ReLU σ_1),
α_i = σ_2(q_att) with σ_2 the sigmoid (eq. 2), and x̂_i = α_i · x_i. The coefficients do not
compete (no softmax): several regions can pass at once.

g may be coarser than x: W_g g is resampled to x's grid (bilinear) before the sum, equivalent to
the paper's resampling of the coefficients when the grids agree. With ``coefficients`` = c > 1
each pixel gets c coefficients, one per group of F_l / c channels (the paper's
multi-dimensional coefficients, Sec. 2.2).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, checks, hooks
from attnkit import taxonomy as tx
from attnkit.alignments import Sigmoid
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.vision.channel import feature_map

__all__ = ["AttentionGate", "AttentionGateOutput"]


class AttentionGateOutput(NamedTuple):
    """x̂ = α ⊙ x (B, F_l, H, W) and the coefficients α (B, c, H, W)."""

    output: Tensor
    coefficients: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"coefficients": self.coefficients}


@REGISTRY.register("attention_gate")
class AttentionGate(nn.Module):
    """Additive attention gate with sigmoid coefficients on every pixel (Oktay et al. eqs. 1-2).

    Args:
        d_x: F_l, channels of the skip features x.
        d_g: F_g, channels of the gating signal g.
        d_int: F_int, channels of the intermediate (additive) space.
        coefficients: c coefficients per pixel (1 in the paper's basic gate); must divide d_x.
        align: turns q_att into coefficients (default sigmoid, eq. 2).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(
        self,
        d_x: int,
        d_g: int,
        d_int: int,
        *,
        coefficients: int = 1,
        align: str | nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(d_x=d_x, d_g=d_g, d_int=d_int, coefficients=coefficients)
        if d_x % coefficients:
            raise ValueError(f"coefficients = {coefficients} must divide d_x = {d_x}")
        kw = {"device": device, "dtype": dtype}
        self.d_x, self.d_g, self.n_coefficients = d_x, d_g, coefficients
        self.W_x = nn.Conv2d(d_x, d_int, 1, bias=False, **kw)
        self.W_g = nn.Conv2d(d_g, d_int, 1, **kw)  # its bias is b_g
        self.psi = nn.Conv2d(d_int, coefficients, 1, **kw)  # its bias is b_ψ
        self.align = (
            Sigmoid()
            if align is None
            else checks.resolve_alignment(align, device=device, dtype=dtype)
        )

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(x (2, 4, 6, 6) and a coarser g (2, 3, 3, 3))."""
        x, g = example_tensor(2, 4, 6, 6, seed=0), example_tensor(2, 3, 3, 3, seed=1)
        return cls(4, 3, 5), (x, g), {}

    def taxonomy_tags(self) -> list:
        tags = [tx.Scoring.ADDITIVE, tx.QueryType.SPECIALIZED]
        if self.n_coefficients > 1:
            tags.append(tx.Dimensionality.MULTI)
        return tags

    def forward(self, x: Tensor, g: Tensor) -> AttentionGateOutput:
        """x (B, F_l, H, W), g (B, F_g, H_g, W_g) → α ⊙ x, α (B, c, H, W)."""
        x = feature_map(x, "x", self.d_x)
        g = feature_map(g, "g", self.d_g)
        checks.same_batch(("x", x), ("g", g))
        gate = self.W_g(g)
        if gate.shape[-2:] != x.shape[-2:]:
            gate = F.interpolate(gate, size=x.shape[-2:], mode="bilinear", align_corners=False)
        q_att = self.psi(torch.relu(self.W_x(x) + gate))  # eq. 1, (B, c, H, W)
        alpha = self.align(q_att.flatten(2)).weights.reshape(q_att.shape)  # eq. 2
        hooks.report(self, alpha, "coefficients")
        groups = x.unflatten(1, (self.n_coefficients, -1))  # (B, c, F_l / c, H, W)
        out = (groups * alpha.unsqueeze(2)).flatten(1, 2)
        return AttentionGateOutput(out, alpha)
