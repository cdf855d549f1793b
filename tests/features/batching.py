"""Batch == items for mechanisms, with the padding masks the library's own helper makes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import attnkit as ak


def assert_batch_equals_items(
    run: Callable[[list[Tensor], list[Tensor | None]], Tensor],
    xs: Sequence[Tensor],
    lengths: Sequence[Sequence[int] | None],
) -> None:
    """``run(inputs, masks)`` on the whole batch, each input (B, n_i, …) padded and masked with
    ``ak.masks.from_lengths`` (B, 1, n_i), equals ``run`` on item b alone, truncated to its
    lengths and without masks. An input whose lengths are None is not masked (e.g. a query).
    """
    masks = [
        None if ls is None else ak.masks.from_lengths(torch.tensor(ls), x.shape[1])
        for x, ls in zip(xs, lengths, strict=True)
    ]
    batched = run(list(xs), masks)
    for b in range(xs[0].shape[0]):
        alone = run(
            [
                x[b : b + 1] if ls is None else x[b : b + 1, : ls[b]]
                for x, ls in zip(xs, lengths, strict=True)
            ],
            [None] * len(xs),
        )
        torch.testing.assert_close(batched[b : b + 1], alone, msg=f"batch item {b}")
