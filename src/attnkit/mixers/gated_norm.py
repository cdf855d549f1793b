"""The gated RMSNorm at the output of today's recurrent token mixers: an RMSNorm of the mixer's
output combined with a gate z read from the layer input: SiLU(z), or σ(z) where the model gates
with a sigmoid (Kimi Linear's KDA, MiniMax's lightning attention).

Two orders are in use, and they differ:

- ``"gate_first"`` (Mamba-2, ``MambaRMSNormGated`` of transformers and ``RMSNormGated`` of the
  reference ``mamba_ssm`` with ``norm_before_gate=False``): y = w ⊙ RMSNorm(x ⊙ SiLU(z)),
  the norm taken over groups of ``group_size`` channels (one group per B/C group);
- ``"norm_first"`` (Qwen3-Next's Gated DeltaNet, ``Qwen3NextRMSNormGated``):
  y = (w ⊙ RMSNorm(x)) ⊙ SiLU(z), the norm over each head's channels; Kimi Linear's KDA
  (``KimiLinearRMSNormGated``) and MiniMax's lightning attention take this order with
  ``activation="sigmoid"``: y = (w ⊙ RMSNorm(x)) ⊙ σ(z).

RMSNorm over a group g of channels: x_g / sqrt(mean(x_g²) + eps). The arithmetic runs in at
least float32 (as the transformers modules do) and the result has x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments

__all__ = ["ACTIVATIONS", "ORDERS", "GatedRMSNorm"]

ORDERS = ("gate_first", "norm_first")
ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) gated by SiLU(z) (or σ(z)): x, z (…, dim) → (…, dim).

    Args:
        dim: the size of the last dim of x and z (the weight's size).
        eps: added to the mean square.
        group_size: channels per normalised group (``dim`` must be a multiple); None = all
            ``dim`` channels in one group.
        order: ``"gate_first"`` (w ⊙ RMSNorm(x ⊙ SiLU(z)), Mamba-2) or ``"norm_first"``
            ((w ⊙ RMSNorm(x)) ⊙ SiLU(z), Qwen3-Next).
        activation: the gate's nonlinearity, ``"silu"`` (Mamba-2, Qwen3-Next) or ``"sigmoid"``
            (Kimi Linear, MiniMax).

    ``z=None`` leaves the gate out (a plain, grouped RMSNorm).
    """

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-6,
        group_size: int | None = None,
        order: str = "norm_first",
        activation: str = "silu",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.dim = arguments.positive_int(dim, "dim")
        self.eps = arguments.finite_float(eps, "eps", nonnegative=True)
        group = dim if group_size is None else arguments.positive_int(group_size, "group_size")
        if dim % group:
            raise ValueError(f"group_size {group} must divide dim {dim}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}"
            )
        self.group_size = group
        self.order = order
        self.activation = activation
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, eps={self.eps}, group_size={self.group_size}, "
            f"order={self.order!r}, activation={self.activation!r}"
        )

    def _norm(self, x: Tensor) -> Tensor:
        groups = x.unflatten(-1, (self.dim // self.group_size, self.group_size))
        scale = torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (groups * scale).flatten(-2)

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        who = type(self).__name__
        if not isinstance(x, Tensor) or x.shape[-1:] != (self.dim,):
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{who}: x must be (…, {self.dim}), got {shape}")
        if z is not None and (not isinstance(z, Tensor) or z.shape != x.shape):
            shape = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
            raise ValueError(f"{who}: the gate z must have x's shape {tuple(x.shape)}, got {shape}")
        dtype = x.dtype
        work = torch.promote_types(dtype, torch.float32)
        h = x.to(work)
        gate = None if z is None else ACTIVATIONS[self.activation](z.to(work))
        if gate is not None and self.order == "gate_first":
            h = h * gate
        h = self.weight.to(work) * self._norm(h)
        if gate is not None and self.order == "norm_first":
            h = h * gate
        return h.to(dtype)
