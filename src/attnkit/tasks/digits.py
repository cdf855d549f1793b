"""Cluttered digits: a real handwritten digit (scikit-learn's bundled ``load_digits`` scans)
pasted at a random place on a larger canvas, with clutter cut from other digits. The gold
attention region is the pasted digit's box."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["DigitsData", "make_digits"]


@dataclass
class DigitsData:
    """Splits: images (n, 1, S, S) in [0, 1], labels (n,), boxes (n, 4) as (top, left, h, w)."""

    splits: dict[str, dict[str, Tensor]]
    canvas: int


def _upscale(img: np.ndarray, factor: int) -> np.ndarray:
    return np.kron(img, np.ones((factor, factor)))


def make_digits(
    n_train: int,
    n_test: int,
    *,
    n_validation: int = 0,
    canvas: int = 48,
    scale: int = 2,
    clutter: int = 4,
    seed: int = 0,
) -> DigitsData:
    """Deterministic given ``seed``. Train, validation and test use disjoint source scans
    (70%, 10%, 20% of them); the validation split is made only when ``n_validation > 0``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images / 16.0
    labels = digits.target
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(images))
    cut1, cut2 = int(0.7 * len(order)), int(0.8 * len(order))
    sources = {"train": order[:cut1], "validation": order[cut1:cut2], "test": order[cut2:]}
    size = 8 * scale
    out = {}
    sizes = {"train": n_train, "validation": n_validation, "test": n_test}
    for split, n in sizes.items():
        if split == "validation" and n == 0:
            continue
        pool = sources[split]
        xs = np.zeros((n, 1, canvas, canvas), dtype=np.float32)
        ys = np.zeros(n, dtype=np.int64)
        boxes = np.zeros((n, 4), dtype=np.int64)
        for i in range(n):
            idx = pool[rng.integers(len(pool))]
            # Clutter first: 6×6 pieces of other digits, then the digit on top.
            for _ in range(clutter):
                other = _upscale(images[pool[rng.integers(len(pool))]], scale)
                r, c = rng.integers(0, size - 6 * scale // 2, 2)
                piece = other[r : r + 3 * scale, c : c + 3 * scale]
                pr, pc = rng.integers(0, canvas - piece.shape[0], 2)
                region = xs[i, 0, pr : pr + piece.shape[0], pc : pc + piece.shape[1]]
                np.maximum(region, piece, out=region)
            top, left = rng.integers(0, canvas - size + 1, 2)
            region = xs[i, 0, top : top + size, left : left + size]
            np.maximum(region, _upscale(images[idx], scale), out=region)
            ys[i] = labels[idx]
            boxes[i] = (top, left, size, size)
        out[split] = {
            "images": torch.from_numpy(xs),
            "labels": torch.from_numpy(ys),
            "boxes": torch.from_numpy(boxes),
        }
    return DigitsData(out, canvas)


def box_region(boxes: Tensor, canvas: int, grid: int) -> Tensor:
    """(n, grid·grid) boolean: which cells of a grid×grid feature map overlap each box."""
    cell = canvas / grid
    rows = torch.arange(grid, dtype=torch.float32)
    top, left, h, w = (boxes[:, i : i + 1].float() for i in range(4))
    r_in = (rows * cell < top + h) & ((rows + 1) * cell > top)  # (n, grid)
    c_in = (rows * cell < left + w) & ((rows + 1) * cell > left)
    return (r_in.unsqueeze(-1) & c_in.unsqueeze(-2)).flatten(1)
