"""Self-attention for feature maps (Zhang et al. 2019, "Self-Attention Generative Adversarial
Networks", Sec. 3; Wikipedia "Variants").

Every position j of x (B, C, H, W) attends every position i: s_ij = f(x_i)ᵀ g(x_j) with
f(x) = W_f x and g(x) = W_g x (1×1 convolutions to C̄ channels), β_{j,i} = softmax_i(s_ij),
o_j = W_v (Σ_i β_{j,i} W_h x_i); the output is y_j = γ o_j + x_j with a learnable γ that starts
at 0, so the network first relies on local features and learns to add non-local evidence.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Dot
from attnkit.vision.channel import feature_map

__all__ = ["SAGANSelfAttention", "SAGANSelfAttentionOutput"]


class SAGANSelfAttentionOutput(NamedTuple):
    """y = γ o + x (B, C, H, W) and β (B, H·W, H·W): row j is where position j looks."""

    output: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("sagan")
class SAGANSelfAttention(nn.Module):
    """The SAGAN self-attention layer.

    Args:
        channels: C.
        reduction: C̄ = max(1, C // reduction) channels for f, g and h (8 in the paper).
        gamma: the initial γ (0 in the paper).
        align: the alignment over positions (default softmax).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(
        self,
        channels: int,
        reduction: int = 8,
        *,
        gamma: float = 0.0,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(channels=channels, reduction=reduction)
        gamma = arguments.finite_float(gamma, "gamma")
        kw = {"device": device, "dtype": dtype}
        inner = max(1, channels // reduction)
        self.channels = channels
        self.f = nn.Conv2d(channels, inner, 1, **kw)
        self.g = nn.Conv2d(channels, inner, 1, **kw)
        self.h = nn.Conv2d(channels, inner, 1, **kw)
        self.v = nn.Conv2d(inner, channels, 1, **kw)
        self.gamma = nn.Parameter(torch.full((), gamma, **kw))
        self.attention = Attention(Dot(), align)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(C = 4, C̄ = 2, γ = 0.5 so that every parameter has a gradient; x (2, 4, 3, 3))."""
        return cls(4, 2, gamma=0.5), (example_tensor(2, 4, 3, 3),), {}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def forward(self, x: Tensor) -> SAGANSelfAttentionOutput:
        """x (B, C, H, W) → y (B, C, H, W), β (B, H·W, H·W)."""
        x = feature_map(x, "x", self.channels)

        def positions(t: Tensor) -> Tensor:
            return t.flatten(2).transpose(1, 2)  # (B, H·W, C̄)

        out = self.attention(
            positions(self.g(x)), positions(self.f(x)), positions(self.h(x)), need_weights=True
        )
        o = out.context.transpose(1, 2).unflatten(2, x.shape[-2:])  # (B, C̄, H, W)
        return SAGANSelfAttentionOutput(self.gamma * self.v(o) + x, out.weights)
