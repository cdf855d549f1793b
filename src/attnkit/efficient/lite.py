"""Long-short range attention, LSRA (Wu, Liu, Lin, Lin and Han, "Lite Transformer with
Long-Short Range Attention", ICLR 2020; Brauwers 3.1 on the Lite Transformer).

The E embedding channels are split in two halves: one half goes through multi-head
self-attention (the long-range branch, global context), the other through a convolution (the
short-range branch, local context), and the two results are concatenated back to E channels:

    LSRA(x) = [ MHA(x[:, :, :E/2]) ; Conv(x[:, :, E/2:]) ].

The convolution branch is the paper's: a linear layer with a GLU, a *lightweight* convolution
(Wu et al. 2019: depth-wise, kernel weights softmax-normalised over the kernel width and shared
by the channels of a group), and an output linear layer. LSRA is a self-attention layer over the
embeddings, a sibling of :class:`attnkit.MultiHeadAttention` (its convolution needs the embedded
channels, so it is not a per-head part).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.multihead import MultiHeadAttention

__all__ = ["LongShortRangeAttention", "LongShortRangeOutput"]


class LongShortRangeOutput(NamedTuple):
    """The layer's output (B, N, E) and the attention branch's weights (B, H, N, N)."""

    output: Tensor
    weights: Tensor | None = None

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {} if self.weights is None else {"weights": self.weights}


class _LightweightConv(nn.Module):
    """The convolution branch of LSRA: Linear → GLU → lightweight convolution → Linear.

    A lightweight convolution (Wu et al. 2019) mixes each channel over a window of
    ``kernel_size`` positions with weights W_g = softmax(w_g) over the window, one kernel per
    group g of channels: out_{t,c} = Σ_u W_{g(c),u} · x_{t+u−⌊k/2⌋,c}. Padding positions are
    zeroed before mixing, so they contribute nothing.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int = 3,
        groups: int = 1,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(channels, "channels")
        arguments.positive_int(kernel_size, "kernel_size")
        arguments.positive_int(groups, "groups")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (centred window), got {kernel_size}")
        if channels % groups:
            raise ValueError(f"channels ({channels}) must be divisible by groups ({groups})")
        kw = {"device": device, "dtype": dtype}
        self.channels, self.kernel_size, self.groups = channels, kernel_size, groups
        self.glu_in = nn.Linear(channels, 2 * channels, **kw)
        self.kernel = nn.Parameter(torch.randn(groups, kernel_size, **kw) * 0.5)
        self.out = nn.Linear(channels, channels, **kw)

    def weights(self) -> Tensor:
        """The normalised kernels (groups, kernel_size): softmax over the window."""
        return F.softmax(self.kernel, -1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.channels:
            raise ValueError(
                f"the convolution branch needs x (B, N, {self.channels}), got {tuple(x.shape)}"
            )
        h = F.glu(self.glu_in(x), -1)  # (B, N, C)
        if mask is not None:
            if mask.dim() >= 2 and mask.shape[-2] != 1:
                raise ValueError(
                    "the convolution branch of LSRA honours key-padding masks (B, 1, N) only (its "
                    f"window is fixed and centred), got a mask of shape {tuple(mask.shape)}"
                )
            masks.check(mask, torch.Size((x.shape[0], 1, x.shape[1])))
            keep = mask.broadcast_to(x.shape[0], 1, x.shape[1]).transpose(1, 2)  # (B, N, 1)
            h = torch.where(keep, h, 0.0)
        w = self.weights().repeat_interleave(self.channels // self.groups, 0)  # (C, k)
        mixed = F.conv1d(
            h.transpose(1, 2),
            w[:, None, :].to(h.dtype),
            padding=self.kernel_size // 2,
            groups=self.channels,
        )
        return self.out(mixed.transpose(1, 2))


@REGISTRY.register("long_short_range")
class LongShortRangeAttention(nn.Module):
    """LSRA: multi-head self-attention on half of the channels beside a lightweight convolution
    on the other half (Lite Transformer).

    Args:
        embed_dim: E, even; each branch gets E/2 channels.
        num_heads: heads of the attention branch (E/2 divisible by it).
        kernel_size: the convolution's window (odd).
        attention: the per-head part of the attention branch (default scaled dot + softmax).

    ``forward(x, mask=None, need_weights=False)`` with x (B, N, E) and a key-padding mask
    (B, 1, N) returns the layer's output (B, N, E) and, on request, the attention branch's
    weights (B, H, N, N).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kernel_size: int = 3,
        *,
        attention: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(embed_dim, "embed_dim")
        if embed_dim % 2:
            raise ValueError(f"embed_dim must be even (two branches of E/2), got {embed_dim}")
        half = embed_dim // 2
        kw = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.attention = MultiHeadAttention(half, num_heads, attention=attention, **kw)
        self.conv = _LightweightConv(half, kernel_size, num_heads, **kw)

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)
        return cls(8, 2), (example_tensor(2, 6, 8, seed=20),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def forward(
        self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> LongShortRangeOutput:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"LongShortRangeAttention({self.embed_dim}) needs x (B, N, {self.embed_dim}), "
                f"got {tuple(x.shape)}"
            )
        half = self.embed_dim // 2
        long = self.attention(x[..., :half], mask=mask, need_weights=need_weights)
        short = self.conv(x[..., half:], mask=mask)
        return LongShortRangeOutput(torch.cat([long.context, short], -1), long.weights)
