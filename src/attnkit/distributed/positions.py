"""Position schemes under context parallelism: each rank places its tokens at their global
positions, so that a layer split over the ring equals the layer on the whole sequence.

A rank holds the positions of its layout's segments (:func:`global_positions`: one run for
``"contiguous"``, a front and a back run for ``"zigzag"``). The schemes act in two ways
(:mod:`attnkit.positions.base`), and each is evaluated where its positions are known:

- rotations of q and k (RoPE, Su et al. eq. 34; the scaled variants) are per token: this rank
  rotates its own queries and keys by their global positions before the ring
  (:meth:`RingPositions.rotate`), and the keys travel rotated;
- biases that depend on the positions only (ALiBi's −m_h·|i − j|, Press et al. 3; T5's learned
  bucket bias B[bucket(j − i), h], Raffel et al. 2.1) are added tile by tile inside the ring,
  from the global positions of the tile's queries and keys (:meth:`RingPositions.__call__`,
  a ``score_mod``), so no (M, N) bias over the whole sequence is ever made; T5's table gets its
  gradient like any parameter of the ring.

Which way a scheme acts is what it declares (``per_token``, ``bias_of_positions``,
:class:`attnkit.positions.PositionScheme`), so a scheme of one's own that declares them runs over
the ring too. Schemes whose terms depend on the contents (Transformer-XL's u, v terms, Shaw's
value term, music's skewed relative logits) declare neither and are refused, naming what they
lack.

Absolute embeddings added to the token embeddings (learned tables, sinusoids: a module with
``absolute = True`` called as ``forward(x, *, offset)``) are per token too: :class:`RingAbsolute`
adds each of this rank's segments at its global offset.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.distributed.agreement import Call, agree
from attnkit.distributed.layout import check_layout, segments
from attnkit.distributed.transport import Ring
from attnkit.positions.base import PositionScheme

__all__ = ["RingAbsolute", "RingPositions", "global_positions"]


def global_positions(
    rank: int, world_size: int, local_length: int, layout: str, device=None
) -> Tensor:
    """(local_length,) int64: the global position of each local position of ``rank`` when
    every rank of a ring of ``world_size`` holds ``local_length`` positions laid out as
    ``layout`` (:func:`attnkit.distributed.shard` cuts a sequence so)."""
    check_layout(layout)
    return torch.cat(
        [
            torch.arange(s.start, s.stop, device=device)
            for s in segments(rank, world_size, local_length, layout)
        ]
    )


class RingPositions(nn.Module):
    """A position scheme applied by global positions on one rank of a ring.

    Args:
        scheme: a per-head scheme that declares :attr:`~attnkit.positions.PositionScheme.
            per_token` (its q/k transform acts on each vector at its own position) and
            :attr:`~attnkit.positions.PositionScheme.bias_of_positions` (its bias, if any, is a
            function of the head and the positions alone): no positions, RoPE and its scalings,
            ALiBi, T5's buckets, or a scheme of one's own that declares both. Others are
            refused with the capability they lack.

    ``rotate(x, positions, total)`` places this rank's queries or keys (the scheme's
    ``transform_at``); called as a ``score_mod`` (``(e, b, h, q_idx, kv_idx)`` with global q_idx
    and kv_idx) it adds the scheme's bias (``bias_at``). ``has_bias`` says whether there is a
    bias (``adds_bias``). The scheme is a submodule, so its parameters (T5's
    table) are the layer's.
    """

    def __init__(self, scheme: PositionScheme) -> None:
        super().__init__()
        if not isinstance(scheme, PositionScheme):
            raise TypeError(f"scheme must be a PositionScheme, got {type(scheme).__name__}")
        lacks = [
            f"{name} ({why})"
            for name, why in (
                ("per_token", "its q/k transform places each vector by its own position"),
                ("bias_of_positions", "its bias is a function of the positions alone"),
            )
            if not getattr(scheme, name)
        ]
        if lacks:
            raise ValueError(
                f"position scheme {type(scheme).__name__} cannot be split over a ring: it does "
                f"not declare {' or '.join(lacks)}; a scheme that reads the contents or all "
                "keys at once cannot be evaluated part by part"
            )
        self.scheme = scheme
        self.has_bias = scheme.adds_bias

    def rotate(self, x: Tensor, positions: Tensor, total: int) -> Tensor:
        """This rank's queries or keys (…, L_l, d) placed at their global ``positions``
        (L_l,) in a sequence of ``total`` positions (the length that length-aware scalings such
        as dynamic NTK read)."""
        return self.scheme.transform_at(x, positions, total)

    def forward(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.scheme.bias_at(e, b, h, q_idx, kv_idx)


class RingAbsolute(nn.Module):
    """An absolute position embedding on one rank of a ring: this rank's tokens at their global
    positions.

    Args:
        embedding: a module declaring ``absolute = True``, called as ``forward(x, *, offset)``
            and adding P[offset + l] to position l of x (B, …, L, D); kept as a submodule, so
            its parameters are the model's.
        group: the ring's process group (None: the default group).
        layout: how the tokens are laid out over the ranks (``"contiguous"`` or ``"zigzag"``).

    ``forward(x, *, offset=0)`` with this rank's part x (B, …, L_l, D) adds the embedding at
    global positions ``offset + global_positions(rank, P, L_l, layout)``, one call per segment.
    A refusal on one rank (positions past the embedding's table, an odd part under zigzag)
    reaches every rank of the group as the same ValueError (:mod:`attnkit.distributed.agreement`).
    """

    def __init__(
        self, embedding: nn.Module, *, group: object = None, layout: str = "contiguous"
    ) -> None:
        super().__init__()
        if not getattr(type(embedding), "absolute", False):
            raise TypeError(
                "embedding must be an absolute position embedding (a module declaring "
                f"absolute = True, forward(x, *, offset)), got {type(embedding).__name__}"
            )
        self.embedding = embedding
        self.group = group
        self.layout = check_layout(layout)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        ring = Ring.of(self.group)
        refusal, out = None, x
        try:
            segs = segments(ring.rank, ring.size, x.shape[-2], self.layout)
            parts = [
                self.embedding(x.narrow(-2, s.local, s.length), offset=offset + s.start)
                for s in segs
            ]
            out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
        except (ValueError, TypeError, IndexError) as err:
            refusal = err
        call = Call()
        call.tensor("x", x)
        call.value("offset", offset if isinstance(offset, int) else -1, offset)
        call.value("layout", ("contiguous", "zigzag").index(self.layout), self.layout)
        agree(ring, call, refusal, ring.device_of(x), "the absolute position embedding")
        return out
