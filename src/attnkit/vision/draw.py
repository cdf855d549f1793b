"""DRAW's selective read with a grid of Gaussian filters (Gregor et al. 2015, "DRAW: A Recurrent
Neural Network For Image Generation", Sec. 3.2, eqs. 19-26).

From the decoder state h, one linear layer emits (g̃_X, g̃_Y, log σ², log δ̃, log γ) (eq. 21).
For an image of width A and height B and an N × N grid:

- centre g_X = (A + 1)/2 (g̃_X + 1), g_Y = (B + 1)/2 (g̃_Y + 1) (eqs. 22-23),
- stride δ = (max(A, B) − 1)/(N − 1) δ̃ (eq. 24),
- filter means μ_X^i = g_X + (i − N/2 − 0.5) δ, μ_Y^j = g_Y + (j − N/2 − 0.5) δ, i, j = 1 … N
  (eqs. 19-20), pixel coordinates a = 1 … A, b = 1 … B,
- F_X[i, a] = exp(−(a − μ_X^i)²/(2σ²)) / Z_X, normalised so Σ_a F_X[i, a] = 1 (eqs. 25-26),
  i.e. a softmax over a of the scores −(a − μ_X^i)²/(2σ²) (the alignment module); F_Y alike,
- read = γ F_Y x F_Xᵀ (eq. 27), per channel.

The paper reads the image and the error image side by side; pass them as two channels of x.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, hooks, inputs
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.vision.channel import feature_map

__all__ = ["DRAWFilterbank", "DRAWRead", "DRAWReadOutput", "filterbank_params"]


class DRAWFilterbank(NamedTuple):
    """The attention parameters of one read (eqs. 21-24), each (B,)."""

    g_x: Tensor
    g_y: Tensor
    sigma2: Tensor
    delta: Tensor
    gamma: Tensor


def filterbank_params(raw: Tensor, height: int, width: int, glimpse: int) -> DRAWFilterbank:
    """(g_X, g_Y, σ², δ, γ) from the linear layer's output (…, 5) = (g̃_X, g̃_Y, log σ², log δ̃,
    log γ), for an image of height B and width A and an N × N grid."""
    gx_t, gy_t, log_s2, log_d, log_g = raw.unbind(-1)
    g_x = (width + 1) / 2 * (gx_t + 1)
    g_y = (height + 1) / 2 * (gy_t + 1)
    delta = (max(width, height) - 1) / (glimpse - 1) * log_d.exp()
    return DRAWFilterbank(g_x, g_y, log_s2.exp(), delta, log_g.exp())


class DRAWReadOutput(NamedTuple):
    """read (B, C, N, N), F_X (B, N, A), F_Y (B, N, B) and the parameters."""

    read: Tensor
    filter_x: Tensor
    filter_y: Tensor
    params: DRAWFilterbank

    @property
    def representation(self) -> Tensor:
        return self.read

    def named_weights(self) -> dict[str, Tensor]:
        return {"filter_x": self.filter_x, "filter_y": self.filter_y}


REGISTRY.renamed["draw-read"] = "draw_read"


@REGISTRY.register("draw_read")
class DRAWRead(nn.Module):
    """DRAW's read with attention: an N × N grid of Gaussian filters placed by the state h.

    Args:
        hidden_size: size of h (the decoder state in the paper).
        height, width: B and A, the image size.
        glimpse: N ≥ 2, the grid is N × N.
        align: the alignment over pixel coordinates (default softmax, the paper's normalised
            Gaussian).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(
        self,
        hidden_size: int,
        height: int,
        width: int,
        glimpse: int,
        *,
        align: str | nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(hidden_size=hidden_size, height=height, width=width, glimpse=glimpse)
        if glimpse < 2:
            raise ValueError(f"glimpse (N) must be ≥ 2 for the stride of eq. 24, got {glimpse}")
        self.hidden_size, self.glimpse = hidden_size, glimpse
        self.height, self.width = height, width
        self.params = nn.Linear(hidden_size, 5, device=device, dtype=dtype)  # eq. 21
        self.align = (
            Softmax()
            if align is None
            else checks.resolve_alignment(align, device=device, dtype=dtype)
        )

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(h of size 4, a 5 × 6 image with 2 channels, N = 3; x (2, 2, 5, 6), h (2, 4))."""
        return cls(4, 5, 6, 3), (example_tensor(2, 2, 5, 6), example_tensor(2, 4, seed=1)), {}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.LOCATION, tx.QueryType.BASIC]

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, image={self.height}x{self.width}, N={self.glimpse}"

    def _filters(self, mu: Tensor, sigma2: Tensor, size: int) -> Tensor:
        """F (B, N, size): row i is softmax_a(−(a − μ_i)²/(2σ²)), a = 1 … size."""
        a = torch.arange(1, size + 1, dtype=mu.dtype, device=mu.device)
        scores = -((a - mu[..., None]) ** 2) / (2 * sigma2[:, None, None])
        return self.align(scores).weights

    def filterbank(self, h: Tensor) -> tuple[Tensor, Tensor, DRAWFilterbank]:
        """F_X (B, N, A), F_Y (B, N, B) and the parameters from h (B, hidden_size)."""
        p = filterbank_params(self.params(h), self.height, self.width, self.glimpse)
        i = torch.arange(1, self.glimpse + 1, dtype=h.dtype, device=h.device)
        offset = (i - self.glimpse / 2 - 0.5) * p.delta[:, None]  # (B, N)
        fx = self._filters(p.g_x[:, None] + offset, p.sigma2, self.width)
        fy = self._filters(p.g_y[:, None] + offset, p.sigma2, self.height)
        return fx, fy, p

    def forward(self, x: Tensor, h: Tensor) -> DRAWReadOutput:
        """x (B, C, B_img, A), h (B, hidden_size) → γ F_Y x F_Xᵀ (B, C, N, N)."""
        x = feature_map(x, "x")
        h = inputs.tensor(h, "h", min_dim=1)
        if h.dim() != 2 or h.shape[-1] != self.hidden_size or h.shape[0] != x.shape[0]:
            raise ValueError(
                f"h must be (B, hidden_size={self.hidden_size}) with B = {x.shape[0]} as in x, "
                f"got shape {tuple(h.shape)}"
            )
        if x.shape[-2:] != (self.height, self.width):
            raise ValueError(
                f"x must be {self.height} x {self.width} images (B, C, height, width), got shape "
                f"{tuple(x.shape)}"
            )
        fx, fy, p = self.filterbank(h)
        hooks.report(self, fx, "filter_x")
        hooks.report(self, fy, "filter_y")
        read = p.gamma[:, None, None, None] * (fy[:, None] @ x @ fx[:, None].transpose(-2, -1))
        return DRAWReadOutput(read, fx, fy, p)
