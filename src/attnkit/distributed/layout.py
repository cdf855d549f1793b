"""How a sequence is laid out over the ranks of a ring: which global positions each rank holds.

Two layouts, for a sequence of S positions over a ring of P ranks:

- ``"contiguous"``: rank r holds positions [r·S/P, (r+1)·S/P). Simple, but under a causal mask
  the last rank attends to every key and the first to its own block only, so the work is
  unbalanced (rank r does r + ½ blocks of work).
- ``"zigzag"``: the sequence is cut into 2P chunks of S/(2P); rank r holds chunk r (its *front*)
  and chunk 2P−1−r (its *back*). Under a causal mask every rank then does the same work (for
  every visiting block, either its back chunk attends to the whole block or its whole query set
  attends to the block's front chunk), the load balancing of ring attention implementations.

:func:`shard` cuts a whole sequence into the part one rank holds and :func:`unshard` joins the
parts of every rank back, both in a single process (no communication).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LAYOUTS", "Segment", "segments", "shard", "unshard"]

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """Positions [start, start + length) of the whole sequence, held at local positions
    [local, local + length) of one rank."""

    start: int
    local: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length


def check_layout(layout: object) -> str:
    """``layout`` if it is a known layout name; otherwise a ValueError listing them."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _world(rank: int, world_size: int) -> None:
    for value, name in ((rank, "rank"), (world_size, "world_size")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def segments(rank: int, world_size: int, local_length: int, layout: str) -> tuple[Segment, ...]:
    """The segments of the sequence that ``rank`` holds when every rank holds ``local_length``
    positions (one segment for ``"contiguous"``, a front and a back one for ``"zigzag"``)."""
    _world(rank, world_size)
    check_layout(layout)
    if layout == "contiguous":
        return (Segment(rank * local_length, 0, local_length),)
    if local_length % 2:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per rank, so each rank's length must be "
            f"even; got {local_length} positions per rank"
        )
    half = local_length // 2
    back = 2 * world_size - 1 - rank
    return (Segment(rank * half, 0, half), Segment(back * half, half, half))


def _length_per_rank(total: int, world_size: int, layout: str) -> int:
    parts = world_size if layout == "contiguous" else 2 * world_size
    if total % parts:
        what = "ranks" if layout == "contiguous" else "chunks (2 per rank, zigzag layout)"
        raise ValueError(
            f"a sequence of {total} positions cannot be split evenly into {parts} {what}; "
            f"pad it to a multiple of {parts} (and mask the padding with key_padding_mask)"
        )
    return total // world_size


def shard(
    x: Tensor, rank: int, world_size: int, *, layout: str = "contiguous", dim: int = -2
) -> Tensor:
    """The part of sequence ``x`` (its positions along ``dim``) that ``rank`` holds.

    Args:
        x: a whole sequence, e.g. (B, …, S, d) with ``dim=-2`` or a padding mask (B, S) with
            ``dim=-1``.
        rank, world_size: the rank and the ring's size P.
        layout: ``"contiguous"`` (S divisible by P) or ``"zigzag"`` (S divisible by 2P).
        dim: the sequence dim.

    Returns:
        The rank's S/P positions, its segments concatenated in order.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    _world(rank, world_size)
    check_layout(layout)
    dim = _dim(x, dim)
    local = _length_per_rank(x.shape[dim], world_size, layout)
    parts = [x.narrow(dim, s.start, s.length) for s in segments(rank, world_size, local, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard(parts: Sequence[Tensor], *, layout: str = "contiguous", dim: int = -2) -> Tensor:
    """The whole sequence from the parts of ranks 0 … P−1 (the inverse of :func:`shard`)."""
    if (
        not isinstance(parts, Sequence)
        or not parts
        or not all(isinstance(p, Tensor) for p in parts)
    ):
        raise TypeError("parts must be a non-empty sequence of tensors, one per rank in order")
    check_layout(layout)
    dim = _dim(parts[0], dim)
    shapes = {tuple(p.shape) for p in parts}
    if len(shapes) != 1:
        raise ValueError(f"every rank's part must have the same shape, got {sorted(shapes)}")
    world = len(parts)
    local = parts[0].shape[dim]
    total = local * world
    out = parts[0].new_empty((*parts[0].shape[:dim], total, *parts[0].shape[dim + 1 :]))
    for rank, part in enumerate(parts):
        for s in segments(rank, world, local, layout):
            out.narrow(dim, s.start, s.length).copy_(part.narrow(dim, s.local, s.length))
    return out


def _dim(x: Tensor, dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}), got {dim!r}")
    return dim % x.dim()
