"""Recurrent visual attention: a sequence of glimpses (Mnih et al. 2014, "Recurrent Models of
Visual Attention"; Brauwers 3.2.2 on hard alignment; Soydaner Sec. 2).

The model never sees the whole image. At step t a glimpse sensor ρ(x, l_t) extracts k
concentric patches around the location l_t, of sizes g, 2g, …, 2^{k−1}g, each average-pooled to
g × g (a retina: high resolution at the centre, coarse around it); the glimpse network combines
what and where, g_t = ReLU(Linear(h_g) + Linear(h_l)) with h_g = ReLU(Linear(ρ)) and
h_l = ReLU(Linear(l_t)); a recurrent core updates h_t = LSTM(g_t, h_{t−1}); the location network
chooses where to look next from h_t; after T glimpses the action network classifies from h_T.

Locations here are the centres of a G × G grid of cells, chosen through an alignment over the
G² cells: ``align="hard"`` samples one cell (training) or takes the most probable (evaluation)
and returns log π(l_t) for REINFORCE, as the paper's stochastic location policy (its Gaussian
policy over continuous locations becomes a categorical one over cells); a soft alignment instead
takes the expected glimpse Σ_l π(l) ρ(x, l), differentiable end to end.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, checks, hooks
from attnkit import taxonomy as tx
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.vision.channel import feature_map

__all__ = ["GlimpseOutput", "RecurrentAttention", "glimpse_sensor"]


def glimpse_sensor(images: Tensor, centres: Tensor, size: int, scales: int) -> Tensor:
    """ρ(x, l): for every centre, ``scales`` square patches of sides size · 2^s (s = 0 … k − 1)
    centred there (zero outside the image), each average-pooled to size × size.

    Args:
        images: (B, C, H, W).
        centres: (L, 2) integer (row, column) pixel centres, inside the image (a patch may
            reach past its edge); a patch of even side p covers rows
            r − p/2 … r + p/2 − 1.
        size: g; scales: k.

    Returns:
        (B, L, k, C, g, g).
    """
    images = feature_map(images, "images")
    arguments.sizes(size=size, scales=scales)
    if not isinstance(centres, Tensor):
        raise TypeError(f"centres must be a torch.Tensor (L, 2), got {type(centres).__name__}")
    if centres.dtype.is_floating_point or centres.is_complex() or centres.dtype == torch.bool:
        raise TypeError(
            f"centres must be integer (row, column) pixel indices, got dtype {centres.dtype}; "
            "round them and convert with .long()"
        )
    if centres.dim() != 2 or centres.shape[-1] != 2:
        raise ValueError(f"centres must be (L, 2) (row, column), got shape {tuple(centres.shape)}")
    if centres.device != images.device:
        raise ValueError(f"centres are on {centres.device} but images on {images.device}")
    h, w = images.shape[-2:]
    limit = torch.tensor([h, w], device=centres.device)
    outside = ((centres < 0) | (centres >= limit)).any(-1)
    if bool(outside.any()):
        i = int(outside.nonzero()[0, 0])
        raise ValueError(
            f"centres must be pixels of the {h} × {w} images (row in [0, {h}), column in "
            f"[0, {w})), got centre {i} = {centres[i].tolist()}"
        )
    return _sense(images, centres, size, scales)


def _sense(images: Tensor, centres: Tensor, size: int, scales: int) -> Tensor:
    """:func:`glimpse_sensor` without the checks (the module's centres are valid by
    construction)."""
    b, c = images.shape[:2]
    largest = size * 2 ** (scales - 1)
    pad = largest  # enough for any patch around any pixel
    padded = F.pad(images, (pad, pad, pad, pad))
    out = []
    for s in range(scales):
        side = size * 2**s
        rows = centres[:, 0] - side // 2 + pad  # (L,)
        cols = centres[:, 1] - side // 2 + pad
        offsets = torch.arange(side, device=images.device)
        r_idx = (rows[:, None] + offsets)[:, :, None]  # (L, side, 1)
        c_idx = (cols[:, None] + offsets)[:, None, :]  # (L, 1, side)
        patches = padded[:, :, r_idx, c_idx]  # (B, C, L, side, side)
        patches = patches.permute(0, 2, 1, 3, 4).reshape(b * len(centres), c, side, side)
        pooled = F.avg_pool2d(patches, 2**s) if s else patches
        out.append(pooled.reshape(b, len(centres), c, size, size))
    return torch.stack(out, 2)


class GlimpseOutput(NamedTuple):
    """logits (B, n_classes); weights (B, T, G²) over the candidate locations at each glimpse;
    locations (B, T, 2) expected (row, column) in [−1, 1]; log_prob (B,) Σ_t log π(l_t) for
    stochastic alignments, else None."""

    logits: Tensor
    weights: Tensor
    locations: Tensor
    log_prob: Tensor | None

    @property
    def representation(self) -> Tensor:
        return self.logits

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("recurrent_attention")
class RecurrentAttention(nn.Module):
    """The recurrent attention model (RAM) of Mnih et al. 2014 with a G × G grid of locations.

    Args:
        image_size: H = W of the input images; channels: C.
        n_classes: outputs of the action network.
        glimpses: T.
        grid: G, candidate locations per side (cell centres).
        glimpse_size: g; scales: k patches per glimpse.
        hidden: size of the glimpse and core representations.
        align: the location policy over the G² cells ("hard" in the paper; see the module doc).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(
        self,
        image_size: int,
        n_classes: int,
        *,
        channels: int = 1,
        glimpses: int = 4,
        grid: int = 6,
        glimpse_size: int = 8,
        scales: int = 2,
        hidden: int = 128,
        align: str | nn.Module = "hard",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(image_size=image_size, n_classes=n_classes, channels=channels)
        arguments.sizes(glimpses=glimpses, grid=grid, glimpse_size=glimpse_size, scales=scales)
        arguments.sizes(hidden=hidden)
        if grid > image_size:
            raise ValueError(
                f"grid = {grid} has more cells per side than image_size = {image_size}"
            )
        kw = {"device": device, "dtype": dtype}
        self.image_size, self.channels, self.glimpses = image_size, channels, glimpses
        self.grid, self.glimpse_size, self.scales = grid, glimpse_size, scales
        cell = image_size / grid
        centres = [((i + 0.5) * cell, (j + 0.5) * cell) for i in range(grid) for j in range(grid)]
        self.register_buffer(
            "centres", torch.tensor(centres).floor().long(), persistent=False
        )  # (G², 2) pixels
        self.register_buffer(
            "coords", torch.tensor(centres, **kw) / image_size * 2 - 1, persistent=False
        )  # (G², 2) in [−1, 1]
        d_glimpse = scales * channels * glimpse_size**2
        self.what = nn.Linear(d_glimpse, hidden, **kw)  # h_g
        self.where = nn.Linear(2, hidden, **kw)  # h_l
        self.what_out = nn.Linear(hidden, hidden, **kw)
        self.where_out = nn.Linear(hidden, hidden, **kw)
        self.core = nn.LSTMCell(hidden, hidden, **kw)
        self.locate = nn.Linear(hidden, grid * grid, **kw)  # the location network's scores
        self.act = nn.Linear(hidden, n_classes, **kw)  # the action network
        self.align = checks.resolve_alignment(align, device=device, dtype=dtype)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(soft locations so that the example is differentiable end to end; 2 glimpses on a
        3 × 3 grid of an 8 × 8 image)."""
        module = cls(8, 3, glimpses=2, grid=3, glimpse_size=2, scales=2, hidden=5, align="softmax")
        return module, (example_tensor(2, 1, 8, 8),), {}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.ADDITIVE, tx.QueryType.BASIC]

    def forward(self, images: Tensor) -> GlimpseOutput:
        """images (B, C, H, W) with H = W = image_size."""
        images = feature_map(images, "images", self.channels)
        if images.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(
                f"images must be {self.image_size} × {self.image_size} (image_size), got shape "
                f"{tuple(images.shape)}"
            )
        b = images.shape[0]
        # Every candidate glimpse, once: (B, G², k·C·g·g).
        sensed = _sense(images, self.centres, self.glimpse_size, self.scales).flatten(2)
        coords = self.coords.to(images.dtype)
        h = images.new_zeros(b, self.core.hidden_size)
        state = (h, h)
        weights, locations, log_probs = [], [], []
        for _ in range(self.glimpses):
            out = self.align(self.locate(state[0]).unsqueeze(-2))
            w = out.weights.squeeze(-2)  # (B, G²)
            hooks.report(self, w)
            rho = torch.einsum("bl,blf->bf", w, sensed)  # the chosen (or expected) glimpse
            loc = w @ coords  # (B, 2)
            h_g = torch.relu(self.what(rho))
            h_l = torch.relu(self.where(loc))
            g_t = torch.relu(self.what_out(h_g) + self.where_out(h_l))
            state = self.core(g_t, state)
            weights.append(w)
            locations.append(loc)
            if out.log_prob is not None:
                log_probs.append(out.log_prob.squeeze(-1))
        log_prob = torch.stack(log_probs, -1).sum(-1) if log_probs else None
        return GlimpseOutput(
            self.act(state[0]), torch.stack(weights, 1), torch.stack(locations, 1), log_prob
        )
