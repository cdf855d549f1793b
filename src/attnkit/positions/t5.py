"""T5's relative position buckets (Raffel et al. 2020, section 2.1)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.positions.base import (
    REGISTRY,
    Positioned,
    PositionScheme,
    check_qk,
    relative_distances,
)

__all__ = ["T5Relative", "t5_bucket"]


def t5_bucket(
    relative: Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """The bucket of each key offset ``relative`` = j − i (int tensor) (Raffel et al. 2.1).

    Bidirectional: half the buckets are for keys after the query (j > i), half for the others.
    Causal: keys after the query share bucket 0 with the query itself. Within a half of n
    buckets, offsets 0 … n/2 − 1 have a bucket each; larger ones share buckets whose width grows
    logarithmically up to ``max_distance``, beyond which all fall into the last bucket.
    """
    n = num_buckets
    out = torch.zeros_like(relative)
    if bidirectional:
        n //= 2
        out = out + (relative > 0).long() * n
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = n // 2
    # log-spaced buckets for exact <= distance < max_distance (clamp avoids log 0 below exact)
    scaled = torch.log(distance.clamp(min=1).double() / exact) / math.log(max_distance / exact)
    large = (exact + (scaled * (n - exact)).long()).clamp(max=n - 1)
    return out + torch.where(distance < exact, distance, large)


@REGISTRY.register("t5")
class T5Relative(PositionScheme):
    """A learned scalar bias per head and bucket of the key offset j − i, added to the scores:
    b_h(i, j) = B[bucket(j − i), h] (Raffel et al. 2.1; one table shared by all layers in T5 —
    pass one instance to every layer for that).

    Args:
        num_heads: H.
        num_buckets: 32 in T5.
        max_distance: 128 in T5; offsets beyond share the last bucket.
        bidirectional: separate buckets for keys before and after the query (encoder); False
            for a causal decoder.
    """

    translation_invariant = True  # reads only i − j
    per_token = True  # (no transform of q and k)
    adds_bias = True
    bias_of_positions = True

    def __init__(
        self,
        num_heads: int,
        num_buckets: int = 32,
        max_distance: int = 128,
        *,
        bidirectional: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.num_buckets = arguments.positive_int(num_buckets, "num_buckets")
        self.max_distance = arguments.positive_int(max_distance, "max_distance")
        self.bidirectional = arguments.boolean(bidirectional, "bidirectional")
        half = num_buckets // 2 if bidirectional else num_buckets
        if half < 2 or max_distance <= half // 2:
            raise ValueError(
                f"need num_buckets >= {4 if bidirectional else 2} and max_distance > the exact "
                f"range {half // 2}; got num_buckets={num_buckets}, max_distance={max_distance}"
            )
        self.weight = nn.Parameter(torch.empty(num_buckets, num_heads, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    # for_heads: a bias per head.
    size_arguments: ClassVar[dict[str, str]] = {"num_heads": "num_heads"}

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_qk(q, k, "t5", num_heads=self.num_heads, q_offset=q_offset, k_offset=k_offset)
        m, n = q.shape[-2], k.shape[-2]
        relative = -relative_distances(m, n, q_offset, k_offset, q.device)  # j − i
        bucket = t5_bucket(
            relative,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        bias = self.weight[bucket].permute(2, 0, 1)  # (M, N, H) -> (H, M, N)
        return Positioned(q, k, bias.to(q.dtype))

    def bias_at(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if e.dim() < 3 or e.shape[-3] != self.num_heads:
            raise ValueError(
                f"t5 has parameters for {self.num_heads} heads but got scores "
                f"{tuple(e.shape)} (heads at dim -3)"
            )
        bucket = t5_bucket(
            kv_idx - q_idx,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        return e + self.weight[bucket, h].to(e.dtype)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_buckets={self.num_buckets}, "
            f"max_distance={self.max_distance}, bidirectional={self.bidirectional}"
        )
