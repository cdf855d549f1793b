"""QANet's encoder block (Yu, Dohan, Luong, Zhao, Chen, Norouzi and Le, ICLR 2018; Soydaner 5):
convolutions for local structure and self-attention for global interactions, without recurrence.

One block, on x (B, N, D) with a padding mask:

    x ← x + PE                                           (sinusoidal positions, Vaswani et al.)
    x ← x + f_l(LayerNorm(x))    for f_1 … f_c  depthwise-separable convolutions,
                                     f_{c+1}     multi-head self-attention,
                                     f_{c+2}     a position-wise feed-forward network,

each "placed inside a residual block" with layer normalisation first (Yu et al.). Stochastic
depth (layer dropout, Huang et al. 2016) over the sublayers: sublayer l of the L in the encoder
survives with probability

    p_l = 1 − (l / L)(1 − p_L)        (p_L = 0.9 in the paper: the last sublayer survives 90%),

decaying linearly with depth. In training a sublayer is kept (x + f(LN(x))) or skipped (x) for
the whole mini-batch; at evaluation it is scaled by its survival probability, x + p_l f(LN(x))
(Huang et al.'s rule), so that its expected contribution is the same.

A depthwise-separable convolution (Chollet 2017) is a per-channel convolution of width ``k``
followed by a pointwise (1 × 1) one: y = W_p (w_c ⊛ x_c)_c + b, then a ReLU; D·k + D² weights
instead of D²·k. Padded positions are zeroed before each convolution, so padding reads like the
sequence end and the real positions give what the truncated sequence gives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import arguments, inputs
from attnkit.multihead import MultiHeadAttention
from attnkit.positions.sinusoidal import sinusoid_table

__all__ = ["DepthwiseSeparableConv", "QANetEncoder", "QANetEncoderBlock", "survival_probability"]


def survival_probability(layer: int, total: int, last: float) -> float:
    """p_l = 1 − (l / L)(1 − p_L) for sublayer l = 1 … L (Yu et al.)."""
    return 1.0 - layer / total * (1.0 - last)


@arguments.renamed(d_model="embed_dim")
class DepthwiseSeparableConv(nn.Module):
    """ReLU(pointwise(depthwise(x))) over the sequence: x (B, N, D) → (B, N, D), 'same' padding
    (``kernel_size`` odd)."""

    def __init__(self, embed_dim: int, kernel_size: int, *, device=None, dtype=None) -> None:
        super().__init__()
        arguments.positive_int(embed_dim, "embed_dim")
        arguments.positive_int(kernel_size, "kernel_size")
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (same-length output), got {kernel_size}")
        kw = {"device": device, "dtype": dtype}
        self.depthwise = nn.Conv1d(
            embed_dim,
            embed_dim,
            kernel_size,
            padding=kernel_size // 2,
            groups=embed_dim,
            bias=False,
            **kw,
        )
        self.pointwise = nn.Conv1d(embed_dim, embed_dim, 1, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.pointwise(self.depthwise(x.transpose(1, 2)))).transpose(1, 2)


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class QANetEncoderBlock(nn.Module):
    """One QANet encoder block (module docstring): positions, ``num_convs`` convolutions,
    self-attention, feed-forward, each a pre-norm residual sublayer with layer dropout.

    Args:
        embed_dim: D. num_heads: H of the self-attention (dividing D).
        num_convs: c, the convolutions (4 in QANet's embedding encoder, 2 in its model encoder).
        kernel_size: k, the convolution width (odd; 7 in the paper).
        d_ff: hidden size of the feed-forward network (default D).
        layer_offset: how many sublayers precede this block in the encoder (its sublayers are
            l = layer_offset + 1 … layer_offset + c + 2).
        total_layers: L, the sublayers in the whole encoder (default: this block's c + 2).
        survival_last: p_L, the survival probability of the last sublayer (1.0: no layer
            dropout).
        score: the self-attention's score, as :class:`attnkit.MultiHeadAttention`.
        align: the self-attention's alignment.
        dropout: on each sublayer's output in training.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_convs: int = 4,
        kernel_size: int = 7,
        d_ff: int | None = None,
        layer_offset: int = 0,
        total_layers: int | None = None,
        survival_last: float = 0.9,
        score: Any = "scaled_dot",
        align: Any = "softmax",
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        arguments.positive_int(num_convs, "num_convs")
        arguments.nonnegative_int(layer_offset, "layer_offset")
        count = num_convs + 2
        total = layer_offset + count if total_layers is None else total_layers
        arguments.positive_int(total, "total_layers")
        if total < layer_offset + count:
            raise ValueError(
                f"total_layers = {total} but this block's sublayers run up to layer_offset + "
                f"num_convs + 2 = {layer_offset + count}"
            )
        last = arguments.finite_float(survival_last, "survival_last", positive=True)
        if last > 1.0:
            raise ValueError(f"survival_last must be in (0, 1], got {survival_last!r}")
        kw = {"device": device, "dtype": dtype}
        d_ff = embed_dim if d_ff is None else arguments.positive_int(d_ff, "d_ff")
        self.convs = nn.ModuleList(
            DepthwiseSeparableConv(embed_dim, kernel_size, **kw) for _ in range(num_convs)
        )
        self.attention = MultiHeadAttention(embed_dim, num_heads, score, align, **kw)
        self.ff = nn.Sequential(
            nn.Linear(embed_dim, d_ff, **kw), nn.ReLU(), nn.Linear(d_ff, embed_dim, **kw)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(embed_dim, **kw) for _ in range(count))
        self.survival = tuple(
            survival_probability(layer_offset + i + 1, total, last) for i in range(count)
        )
        self.drop = nn.Dropout(arguments.probability(dropout, "dropout"))

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, survival={tuple(round(p, 4) for p in self.survival)}"

    def _residual(self, i: int, x: Tensor, f) -> Tensor:
        """x + f(LN(x)) with layer dropout: kept with probability p_l in training (skipped
        otherwise), scaled by p_l at evaluation."""
        p = self.survival[i]
        if self.training:
            if p < 1.0 and torch.rand(()) >= p:
                return x
            return x + self.drop(f(self.norms[i](x)))
        return x + p * f(self.norms[i](x))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, N, D); mask (B, N) or (B, 1, N) boolean, True = a real position (None: all
        real). Returns (B, N, D), zeros at padded positions."""
        x = inputs.tensor(x, "x", min_dim=3)
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must be (B, N, D) with D = embed_dim = {self.embed_dim}, "
                f"got shape {tuple(x.shape)}"
            )
        keep = _padding(mask, x)
        n = x.shape[1]
        positions = torch.arange(n, device=x.device, dtype=torch.float64)
        x = x + sinusoid_table(positions, self.embed_dim).to(x.dtype)
        real = None if keep is None else keep[..., None]  # (B, N, 1)

        def zero_padding(t: Tensor) -> Tensor:  # where, not a product: padding may hold NaN
            return t if real is None else torch.where(real, t, torch.zeros((), dtype=t.dtype))

        x = zero_padding(x)
        for i, conv in enumerate(self.convs):
            x = self._residual(i, x, lambda h, conv=conv: conv(zero_padding(h)))
        attend = None if keep is None else keep[:, None, :]  # (B, 1, N): the real keys
        c = len(self.convs)
        x = self._residual(c, x, lambda h: self.attention(h, h, h, mask=attend).context)
        x = self._residual(c + 1, x, self.ff)
        return zero_padding(x)


def _padding(mask: object, x: Tensor) -> Tensor | None:
    """A padding mask (B, N) or (B, 1, N) as (B, N)."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a boolean tensor, got {mask!r:.80}")
    b, n = x.shape[0], x.shape[1]
    if mask.shape == (b, 1, n):
        mask = mask[:, 0]
    if mask.shape != (b, n):
        raise ValueError(
            f"mask must be (B, N) or (B, 1, N) = ({b}, {n}) or ({b}, 1, {n}) for x of shape "
            f"{tuple(x.shape)}, got {tuple(mask.shape)}"
        )
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
    return mask


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class QANetEncoder(nn.Module):
    """A stack of :class:`QANetEncoderBlock` whose sublayers are numbered through the whole
    stack, so that the survival probability decays linearly from the first sublayer of the first
    block to p_L at the last sublayer of the last block (Yu et al.).

    Args:
        blocks: the number of blocks. embed_dim, num_heads and the keywords: as the block.
    """

    def __init__(
        self,
        blocks: int,
        embed_dim: int,
        num_heads: int,
        *,
        num_convs: int = 4,
        kernel_size: int = 7,
        d_ff: int | None = None,
        survival_last: float = 0.9,
        score: Any = "scaled_dot",
        align: Any = "softmax",
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(blocks, "blocks")
        arguments.positive_int(num_convs, "num_convs")
        per_block = num_convs + 2
        self.blocks = nn.ModuleList(
            QANetEncoderBlock(
                embed_dim,
                num_heads,
                num_convs=num_convs,
                kernel_size=kernel_size,
                d_ff=d_ff,
                layer_offset=i * per_block,
                total_layers=blocks * per_block,
                survival_last=survival_last,
                score=score,
                align=align,
                dropout=dropout,
                device=device,
                dtype=dtype,
            )
            for i in range(blocks)
        )

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, N, D); mask (B, N) or (B, 1, N), True = a real position. Returns (B, N, D)."""
        for block in self.blocks:
            x = block(x, mask)
        return x
