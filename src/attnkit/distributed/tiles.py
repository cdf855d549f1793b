"""One rank's tiles of ring attention: which queries it holds, which keys a visiting block
brings, and the scores, masks and weights of a (query rows × keys) tile by global positions.

The ring passes (:mod:`attnkit.distributed.ring`) read only this; the tiles follow the chunked
kernel's conventions (:mod:`attnkit.kernels.chunked`): scores in the work dtype (float64 for
float64 inputs, else float32), the alignment's working units, −inf where masked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnkit.alignments.streaming import Streaming
from attnkit.distributed.layout import Segment, segments
from attnkit.distributed.transport import Ring
from attnkit.kernels import compiled
from attnkit.kernels.base import guarded_sum
from attnkit.kernels.block_mask import BlockMask, ScoreMod, apply_score_mod
from attnkit.scores import Score

__all__ = ["Piece", "Plan", "pieces", "rows_of"]


@dataclass(frozen=True)
class Piece:
    """Positions [start, start + length) of the sequence at local positions [local, …)."""

    start: int
    local: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length

    def rows(self, x: Tensor, dim: int = -2) -> Tensor:
        return x.narrow(dim, self.local, self.length)


def pieces(segs: tuple[Segment, ...], size: int) -> list[Piece]:
    """The segments cut into pieces of at most ``size`` positions, in local order."""
    return [
        Piece(s.start + a, s.local + a, min(size, s.length - a))
        for s in segs
        for a in range(0, s.length, size)
    ]


@dataclass
class Plan:
    """What the tiles need that is not a tensor to differentiate (one rank's view)."""

    score: Score
    align: Streaming
    ring: Ring
    layout: str
    causal: bool
    m_local: int
    n_local: int
    lead: torch.Size
    work: torch.dtype
    block_q: int
    block_k: int
    stat_k: int  # key tile width of the threshold sweeps (tiles hold every local query row)
    padded: bool  # a key padding mask travels with the keys
    guard: bool  # a masked value may be non-finite
    block_mask: BlockMask | None
    score_mod: ScoreMod | None
    device: torch.device
    q_segs: tuple[Segment, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.q_segs = segments(self.ring.rank, self.ring.size, self.m_local, self.layout)
        self.row_pieces = pieces(self.q_segs, self.block_q)
        self._keys: dict[tuple[int, int], list[Piece]] = {}

    def key_pieces(self, owner: int, size: int) -> list[Piece]:
        if (owner, size) not in self._keys:
            segs = segments(owner, self.ring.size, self.n_local, self.layout)
            self._keys[owner, size] = pieces(segs, size)
        return self._keys[owner, size]

    # ---- which tiles hold an allowed pair ---------------------------------------------------

    def visible(self, rows: Piece, keys: Piece, mb: Tensor | None) -> bool:
        """Whether any pair of the tile may be allowed (an empty tile is skipped)."""
        if self.causal and rows.stop - 1 < keys.start:
            return False
        bm = self.block_mask
        if bm is not None:
            qa, qb = rows.start // bm.block_q, -(-rows.stop // bm.block_q)
            ka, kb = keys.start // bm.block_k, -(-keys.stop // bm.block_k)
            if not bool(bm.any_allowed[qa:qb, ka:kb].any()):
                return False
        # Skipping a tile of padding only pays where the check does not stall a GPU stream.
        return mb is None or self.device.type != "cpu" or bool(keys.rows(mb, -1).any())

    def mask(self, rows: Piece, keys: Piece, mb: Tensor | None) -> Tensor | None:
        """(…, rows, keys) boolean mask of a tile (None when every pair is allowed)."""
        mask = None
        k_pos = torch.arange(keys.start, keys.stop, device=self.device)
        if self.causal and rows.start < keys.stop - 1:
            q_pos = torch.arange(rows.start, rows.stop, device=self.device)
            mask = q_pos[:, None] >= k_pos[None, :]
        if mb is not None:
            pad = keys.rows(mb, -1).bool()
            pad = pad.view(pad.shape[0], *([1] * (len(self.lead) - 1)), 1, keys.length)
            mask = pad if mask is None else mask & pad
        if self.block_mask is not None:
            pattern = self.block_mask.tile_at(rows.start, rows.stop, k_pos)
            mask = pattern if mask is None else mask & pattern
        return mask

    # ---- scores of a tile -------------------------------------------------------------------

    def tile(
        self, qp: Tensor, kb: Tensor, rows: Piece, keys: Piece, mb: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Prepared scores (…, rows, keys) in the work dtype, −inf where masked, and the mask.
        ``qp`` and ``kb`` hold just these rows and keys."""
        e = compiled.pairwise(self.score)(qp, kb, keys.start).to(self.work)
        e = e.expand(*self.lead, rows.length, keys.length)
        if self.score_mod is not None:
            pos = torch.arange(keys.start, keys.stop, device=e.device)
            e = apply_score_mod(self.score_mod, e, rows.start, pos)
        e = self.align.stream_prepare(e)
        mask = self.mask(rows, keys, mb)
        if mask is not None:
            e = e.masked_fill(~mask, float("-inf"))
        return e, mask

    def all_rows_tile(self, qp: Tensor, kb: Tensor, keys: Piece, mb: Tensor | None):
        """Prepared scores of every local query row × ``keys`` (−inf for query segments that
        the masks leave without an allowed key there), or None when no row has one."""
        parts, seen = [], False
        for seg in self.q_segs:
            rows = Piece(seg.start, seg.local, seg.length)
            if self.visible(rows, keys, mb):
                parts.append(self.tile(rows.rows(qp), keys.rows(kb), rows, keys, mb)[0])
                seen = True
            else:
                parts.append(self.empty(seg.length, keys.length))
        if not seen:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)

    def empty(self, rows: int, keys: int) -> Tensor:
        return torch.full(
            (*self.lead, rows, keys), float("-inf"), dtype=self.work, device=self.device
        )

    # ---- weights and sums -------------------------------------------------------------------

    def weights(self, e: Tensor, stat: Tensor | None, has_key: Tensor) -> Tensor:
        p = self.align.stream_weights(e, stat)
        return torch.where(has_key, p, torch.zeros((), dtype=p.dtype))

    def combine(self, p: Tensor, vb: Tensor) -> Tensor:
        vb = vb.to(self.work)
        return guarded_sum(torch.matmul, p, vb) if self.guard else torch.matmul(p, vb)

    def d_weights(self, d_out: Tensor, vb: Tensor) -> Tensor:
        vb = vb.to(self.work)
        if self.guard:
            vb = torch.where(torch.isfinite(vb), vb, torch.zeros((), dtype=vb.dtype))
        return torch.matmul(d_out, vb.transpose(-1, -2))

    def block(self, *tensors: Tensor | None) -> list[Tensor]:
        return [t for t in tensors if t is not None]

    def unpack(self, blk: list[Tensor]) -> tuple[Tensor, ...]:
        """(kp, [v], mask or None) of a travelling block."""
        return (*blk, None) if not self.padded else tuple(blk)


def rows_of(x: Tensor | None, rows: Piece) -> Tensor | None:
    return None if x is None else rows.rows(x)
