"""The short causal convolution of today's recurrent token mixers (Mamba, Mamba-2, Gated DeltaNet,
KDA): a depthwise 1-D convolution over the positions with a kernel of K (typically 4), applied
to the projections before the recurrence so that every position sees its K − 1 predecessors.

Per channel c, with the kernel w_c (K) and optional bias b_c,

    y_{t,c} = act(b_c + Σ_{i=0}^{K−1} w_{c,i} x_{t−K+1+i, c}),

with x_s = 0 before the first position (or the cached inputs of an earlier call). Decoding keeps
the last K − 1 inputs of each sequence as the layer's state.

Padding: a key-padding mask zeroes the inputs at padded positions, so they contribute nothing to
any output, and the outputs there are 0: a right-padded batch gives, at its real positions, the
outputs of each sequence alone (padding equals truncation), and the state kept for decoding holds
the last K − 1 *real* inputs of each sequence.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.mixers.base import MixerCache, padding_mask

__all__ = ["ACTIVATIONS", "ShortConv", "last_real", "zero_padding"]

ACTIVATIONS = (None, "silu")


def zero_padding(x: Tensor, keep: Tensor | None) -> Tensor:
    """x (B, N, …) with the positions where ``keep`` (B, N) is False set to 0."""
    if keep is None:
        return x
    keep = keep.reshape(*keep.shape, *(1,) * (x.dim() - 2))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def last_real(x: Tensor, keep: Tensor | None, count: int) -> Tensor:
    """The last ``count`` rows of x (B, L, C) among the positions ``keep`` (B, L) marks real
    (all when None), in order; zero rows ahead of them where fewer than ``count`` are real."""
    if keep is None:
        return x[:, x.shape[1] - count :]
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # real ones first
    packed = x.gather(1, order.unsqueeze(-1).expand_as(x))
    real = keep.sum(1, keepdim=True)  # (B, 1)
    rows = real - count + torch.arange(count, device=x.device)  # (B, count)
    ahead = rows < 0  # fewer real positions than count: zeros before them, as before a sequence
    picked = packed.gather(1, rows.clamp(min=0).unsqueeze(-1).expand(-1, -1, x.shape[-1]))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(ahead.unsqueeze(-1), zero, picked)


class ShortConv(nn.Module):
    """A causal depthwise convolution over x (B, N, channels) → (B, N, channels).

    Args:
        channels: C, the number of channels (each with its own kernel).
        kernel_size: K, positions per kernel (the current one and K − 1 before it).
        bias: add a learned bias per channel.
        activation: None or ``"silu"``, applied after the convolution.
        state_name: the entry of a :class:`attnkit.mixers.MixerCache` that holds the last
            K − 1 inputs (a layer with two convolutions gives them two names).

    The weight has the shape of a depthwise ``nn.Conv1d`` (C, 1, K) (its last tap multiplies
    the current position), so a ``nn.Conv1d(C, C, K, groups=C)``'s weights copy over as they
    are.

    State: with a cache, the entry ``state_name`` holds the last K − 1 real inputs,
    (B, K − 1, C) in x's dtype (:meth:`state_shape`); the owning layer lists it among its
    :attr:`attnkit.mixers.TokenMixer.state_names`.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        *,
        bias: bool = True,
        activation: str | None = None,
        state_name: str = "conv",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.channels = arguments.positive_int(channels, "channels")
        self.kernel_size = arguments.positive_int(kernel_size, "kernel_size")
        arguments.boolean(bias, "bias")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be None or 'silu', got {activation!r}")
        if not isinstance(state_name, str) or not state_name:
            raise TypeError(f"state_name must be a non-empty string, got {state_name!r}")
        self.activation = activation
        self.state_name = state_name
        kw = {"device": device, "dtype": dtype}
        bound = 1 / math.sqrt(kernel_size)  # nn.Conv1d's default, fan-in K per channel
        self.weight = nn.Parameter(
            torch.empty(channels, 1, kernel_size, **kw).uniform_(-bound, bound)
        )
        self.bias = (
            nn.Parameter(torch.empty(channels, **kw).uniform_(-bound, bound)) if bias else None
        )

    def extra_repr(self) -> str:
        return (
            f"channels={self.channels}, kernel_size={self.kernel_size}, "
            f"bias={self.bias is not None}, activation={self.activation!r}"
        )

    def state_shape(self, batch: int) -> tuple[int, int, int]:
        """The shape of the state kept for ``batch`` sequences: (B, K − 1, C)."""
        return (arguments.positive_int(batch, "batch"), self.kernel_size - 1, self.channels)

    def new_state(self, batch: int, *, device=None, dtype=None) -> Tensor:
        """The state before the first position: K − 1 zero inputs (B, K − 1, C)."""
        return torch.zeros(batch, self.kernel_size - 1, self.channels, device=device, dtype=dtype)

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, cache: MixerCache | None = None
    ) -> Tensor:
        """Convolve x (B, N, C) causally.

        Args:
            x: the inputs; with a cache, the N new positions only.
            mask: key padding (B, N) or (B, 1, N), True = a real position.
            cache: the owning layer's :class:`attnkit.mixers.MixerCache`: the convolution
                continues from its entry ``state_name`` (zeros if absent) and writes the new
                last K − 1 real inputs there. The layer that owns the cache counts the positions
                (:meth:`attnkit.mixers.MixerCache.advance`).
        """
        who = type(self).__name__
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.channels:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{who}: x must be (B, N, {self.channels}), got {shape}")
        if cache is not None and not isinstance(cache, MixerCache):
            raise TypeError(
                f"{who}: cache must be a MixerCache or None, got {type(cache).__name__}"
            )
        b, n, c = x.shape
        keep = padding_mask(mask, b, n, who)
        x = zero_padding(x, keep)
        k = self.kernel_size
        state = None
        if cache is not None:
            state = cache.states.get(self.state_name)
            if state is not None and (state.shape != (b, k - 1, c) or state.dtype != x.dtype):
                raise ValueError(
                    f"{who}: the cache's {self.state_name!r} state is {tuple(state.shape)} "
                    f"{state.dtype}, but this step needs ({b}, {k - 1}, {c}) {x.dtype} "
                    "(another batch size, or another layer's cache?)"
                )
            if state is None:
                state = self.new_state(b, device=x.device, dtype=x.dtype)
        weight = self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if state is None:
            y = F.conv1d(x.transpose(1, 2), weight, bias, padding=k - 1, groups=c)
            y = y[..., :n].transpose(1, 2)
        else:
            full = torch.cat([state, x], 1)
            if n == 1:  # a decoding step: one window, a product and a sum beat conv1d's set-up
                y = (full * weight[:, 0].t()).sum(1, keepdim=True)
                y = y if bias is None else y + bias
            else:
                y = F.conv1d(full.transpose(1, 2), weight, bias, groups=c).transpose(1, 2)
            cache.states[self.state_name] = last_real(
                full, None if keep is None else F.pad(keep, (k - 1, 0), value=True), k - 1
            )
        if self.activation == "silu":
            y = F.silu(y)
        return zero_padding(y, keep)
