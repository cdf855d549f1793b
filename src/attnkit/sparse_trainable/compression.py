"""The block compression φ of Native Sparse Attention (Yuan et al. 2025, eq. 7): what the
compressed branch attends and the selection ranks blocks by, learned (:class:`BlockCompression`)
or fixed (:class:`MeanCompression`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnkit import arguments

__all__ = ["BlockCompression", "MeanCompression", "compress_blocks"]


class BlockCompression(nn.Module):
    """φ of NSA eq. 7: a block (…, l, d) ↦ W · flatten(block + P) + b (…, d_out), P a learned
    (l, d) intra-block position embedding."""

    def __init__(
        self, block: int, dim: int, out_dim: int | None = None, *, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.block = arguments.positive_int(block, "block")
        self.dim = arguments.positive_int(dim, "dim")
        out_dim = self.dim if out_dim is None else arguments.positive_int(out_dim, "out_dim")
        self.position = nn.Parameter(torch.zeros(block, dim, device=device, dtype=dtype))
        nn.init.normal_(self.position, std=0.02)
        self.proj = nn.Linear(block * dim, out_dim, device=device, dtype=dtype)
        with torch.no_grad():  # start as the block mean (plus a little noise to break symmetry)
            self.proj.weight.normal_(std=0.02 / math.sqrt(block * dim))
            self.proj.weight += torch.eye(out_dim, dim).repeat(1, block) / block
            self.proj.bias.zero_()

    def forward(self, blocks: Tensor) -> Tensor:
        return self.proj((blocks + self.position).flatten(-2))

    def sequence(self, x: Tensor, stride: int) -> Tensor:
        """φ of every block of x (…, N, d) that starts at a multiple of ``stride``
        -> (…, C, d_out), C = ⌊(N − l)/stride⌋ + 1 (N ≥ l).

        Where the stride divides l, a block is l/stride consecutive sub-blocks of ``stride``
        rows and W·flatten(block + P) + b = Σ_i W_i · flatten(sub-block i) + (W·flatten(P) + b),
        W_i the columns of sub-block i: products on a view of x, without the (…, C, l, d) copy
        of the overlapping blocks (twice x at l = 2·stride, kept for the backward)."""
        l, d = self.block, x.shape[-1]
        c = (x.shape[-2] - l) // stride + 1
        if l % stride:
            return self(x.unfold(-2, l, stride).transpose(-1, -2))
        parts = l // stride
        w = self.proj.weight
        out = nn.functional.linear(self.position.flatten(), w, self.proj.bias)
        n = x.shape[-2]
        if n % stride == 0 and x.is_contiguous():
            # one product of every sub-block with every W_i: x viewed whole, so that no slice
            # of it is copied (a slice of a batched x is not one matrix)
            whole = x.unflatten(-2, (n // stride, stride)).flatten(-2)
            every = whole @ w.unflatten(1, (parts, stride * d)).permute(2, 1, 0).flatten(1)
            every = every.unflatten(-1, (parts, w.shape[0]))  # (…, N/stride, parts, d_out)
            for i in range(parts):
                out = out + every[..., i : i + c, i, :]
            return out
        sub = x[..., : (c + parts - 1) * stride, :].unflatten(-2, (c + parts - 1, stride))
        sub = sub.flatten(-2)  # (…, C + parts − 1, stride·d), a view of x
        for i in range(parts):
            columns = w[:, i * stride * d : (i + 1) * stride * d]
            out = out + sub[..., i : i + c, :] @ columns.transpose(0, 1)
        return out


def compress_blocks(phi: nn.Module, x: Tensor, block: int, stride: int) -> Tensor:
    """φ (``phi``) of every block of ``block`` rows of x (…, N, d) starting at a multiple of
    ``stride`` -> (…, C, d_out), by :meth:`BlockCompression.sequence` where φ is one."""
    if isinstance(phi, BlockCompression) and phi.block == block:
        return phi.sequence(x, stride)
    return phi(x.unfold(-2, block, stride).transpose(-1, -2))


class MeanCompression(nn.Module):
    """φ(block) = mean of the block's rows (a parameter-free compression)."""

    def forward(self, blocks: Tensor) -> Tensor:
        return blocks.mean(-2)
