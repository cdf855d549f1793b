"""The plan of a chunked evaluation: block sizes, the keys of a tile, and how a block mask's
query blocks are grouped and their key tiles merged (:class:`Plan`)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.alignments.streaming import Streaming
from attnkit.kernels import compiled
from attnkit.kernels.base import guarded_sum
from attnkit.kernels.block_mask import BlockMask, ScoreMod, apply_score_mod
from attnkit.scores import Score

__all__ = [
    "TILE_ELEMENTS",
    "WIDE_TILE_ELEMENTS",
    "Plan",
    "TileKeys",
    "block_of",
    "block_ranges",
    "default_chunk_size",
    "reasons_not_streamable",
    "sliced",
    "supports",
    "tile_width",
    "work_dtype",
]

# Query blocks of a block mask evaluated together, at most, and the most work the union of their
# key tiles may add over what each visits (a larger tile only pays when it wastes little).
MAX_GROUP = 8
GROUP_WASTE = 1.1

# Elements per (block_q, block_k, width) score tile: small tiles for cheap scores (memory),
# larger for wide ones (additive: amortise the per-tile Python overhead).
TILE_ELEMENTS = 1 << 19
WIDE_TILE_ELEMENTS = 1 << 21


def tile_width(score: Score) -> int:
    """Elements per (query, key) pair that a dense evaluation of ``score`` materialises."""
    width = getattr(score, "d_w", None) or 1
    return width * (score.d_out or 1)


def default_chunk_size(n: int, score: Score) -> int:
    """Key block size: large enough to amortise Python overhead, small enough for cache."""
    return max(16, min(n, 1024 if tile_width(score) == 1 else 128))


def reasons_not_streamable(align: Alignment) -> list[str]:
    """Why ``align`` cannot be evaluated block by block (empty when it can)."""
    if not isinstance(align, Streaming):
        return [
            f"the {type(align).__name__} alignment does not implement the streaming protocol "
            "(attnkit.alignments.streaming)"
        ]
    return align.stream_reasons()


def supports(align: Alignment) -> bool:
    """Whether the chunked kernel evaluates ``align`` exactly."""
    return not reasons_not_streamable(align)


def sliced(x: Tensor | None, dim: int, start: int, stop: int) -> Tensor | None:
    """x[..., start:stop, ...] along ``dim`` unless that dim is broadcast (size 1)."""
    if x is None or x.shape[dim] == 1:
        return x
    return x.narrow(dim, start, stop - start)


def block_of(x: Tensor | None, q0: int, q1: int, keys: TileKeys) -> Tensor | None:
    """The (…, q1−q0, keys) block of a mask or bias broadcastable to (…, M, N)."""
    if x is None or x.dim() == 0:
        return x
    if x.dim() >= 2:
        x = sliced(x, -2, q0, q1)
    return keys.take(x, -1)


def block_ranges(size: int, total: int) -> list[tuple[int, int]]:
    return [(start, min(start + size, total)) for start in range(0, total, size)]


@dataclass(frozen=True)
class TileKeys:
    """The keys of one tile: the range [k0, k1), or positions ``idx`` gathered from several
    tiles (only for scores whose value does not depend on where a key sits)."""

    k0: int
    k1: int
    idx: Tensor | None = None

    def take(self, x: Tensor | None, dim: int) -> Tensor | None:
        """These keys of ``x`` along ``dim`` (a broadcast dim of size 1 stays as it is)."""
        if x is None or x.shape[dim] == 1:
            return x
        if self.idx is None:
            return x.narrow(dim, self.k0, self.k1 - self.k0)
        return x.index_select(dim, self.idx.to(x.device))

    def add(self, target: Tensor, g: Tensor, dim: int) -> None:
        """target[these keys] += g along ``dim`` (summed over a broadcast dim of size 1)."""
        if target.shape[dim] == 1:
            target += g.sum_to_size(target.shape)
            return
        g = g.sum_to_size(self.take(target, dim).shape)
        if self.idx is None:
            target.narrow(dim, self.k0, self.k1 - self.k0).add_(g)
        else:
            target.index_add_(dim, self.idx.to(target.device), g)

    def positions(self, device) -> Tensor:
        if self.idx is None:
            return torch.arange(self.k0, self.k1, device=device)
        return self.idx.to(device)

    def tiles(self, block: int) -> list[int]:
        """The block-mask key tiles these keys come from."""
        if self.idx is None:
            return list(range(self.k0 // block, -(-self.k1 // block)))
        return sorted(set((self.idx // block).tolist()))


# (id(any_allowed of a block mask), block_q, M) -> (weak reference, its query-block groups).
_GROUPS: dict[tuple[int, int, int], tuple[weakref.ref, dict]] = {}


@dataclass
class Plan:
    """Everything the blocks need that is not a tensor to differentiate.

    Tiles are laid out (…, M_b, N_b), or (…, d_v, M_b, N_b) for a multi-dimensional score (each
    feature aligned across keys, eq. 32), so the key axis is always last for the alignment.
    """

    score: Score
    align: Streaming
    mask: Tensor | None
    has_key: Tensor | None  # (…, M, 1): rows that may attend at least one key
    lead: torch.Size  # the output's batch dims
    multi: bool
    m: int
    n: int
    block_q: int
    block_k: int
    work: torch.dtype  # dtype of statistics and sums
    guard: bool  # a masked value may be non-finite
    block_mask: BlockMask | None = None
    score_mod: ScoreMod | None = None
    span_k: int = 0  # the widest merged key range of a block-sparse tile

    def __post_init__(self) -> None:
        self.groups: dict[int, tuple[int, list[bool], list[bool]]] = {}
        self.pieces: dict[int, list[TileKeys]] = {}
        bm = self.block_mask
        if bm is None:
            return
        # The groups depend on the tile flags alone: read once per block mask (a dense mask
        # turned into a block mask on each call shares the flags of the first).
        flags = bm.any_allowed
        key = (id(flags), self.block_q, self.m)
        hit = _GROUPS.get(key)
        if hit is not None and hit[0]() is flags:
            self.groups = hit[1]
            return
        self._group(flags.tolist(), bm.all_allowed.tolist())
        _GROUPS[key] = (weakref.ref(flags), self.groups)
        weakref.finalize(flags, _GROUPS.pop, key, None)

    def _group(self, visit: list[list[bool]], full: list[list[bool]]) -> None:
        """Consecutive query blocks of the block mask evaluated together, with the union of the
        key tiles they visit, as long as the union adds at most a tenth to the work (fewer,
        larger tiles: less per-tile overhead). q0 -> (q1, visited tiles, full tiles)."""
        i = 0
        while i < len(visit):
            rows, union, inter, own = 1, list(visit[i]), list(full[i]), sum(visit[i])
            while i + rows < len(visit) and rows < MAX_GROUP:
                cand = [a or b for a, b in zip(union, visit[i + rows], strict=True)]
                cost = sum(cand) * (rows + 1)
                if cost > GROUP_WASTE * (own + sum(visit[i + rows])):
                    break
                union, own = cand, own + sum(visit[i + rows])
                inter = [a and b for a, b in zip(inter, full[i + rows], strict=True)]
                rows += 1
            q0, q1 = i * self.block_q, min((i + rows) * self.block_q, self.m)
            self.groups[q0] = (q1, union, [a and b for a, b in zip(inter, union, strict=True)])
            i += rows

    def q_blocks(self) -> list[tuple[int, int]]:
        if self.groups:
            return [(q0, g[0]) for q0, g in self.groups.items()]
        return block_ranges(self.block_q, self.m)

    def k_blocks(self, q0: int | None = None) -> list[TileKeys]:
        """Key tiles; with a block mask, only the keys the query block starting at ``q0`` needs:
        adjacent visited tiles merged, and for scores that do not depend on key positions, tiles
        apart gathered into one (fewer, larger tiles: less per-tile overhead), ``span_k`` keys
        at most."""
        if self.block_mask is None or q0 is None:
            return [TileKeys(k0, k1) for k0, k1 in block_ranges(self.block_k, self.n)]
        if q0 not in self.pieces:
            q1, visit, _ = self.groups[q0]
            self.pieces[q0] = self._pieces(visit, q1 - q0)
        return self.pieces[q0]

    def _pieces(self, visit: list[bool], rows: int) -> list[TileKeys]:
        gather = self.score.content_based and not self.score.mixes_keys
        # span_k is sized for one query block; a group of several holds proportionally fewer
        # keys per tile, so that its tiles stay within the tile budget.
        span = max(
            self.block_k, (self.span_k * self.block_q // rows) // self.block_k * self.block_k
        )
        pieces: list[list[tuple[int, int]]] = []
        width = 0
        for j, needed in enumerate(visit):
            if not needed:
                continue
            k0, k1 = j * self.block_k, min((j + 1) * self.block_k, self.n)
            last = pieces[-1] if pieces else None
            fits = last is not None and width + (k1 - k0) <= span
            if fits and (gather or last[-1][1] == k0):
                if last[-1][1] == k0:
                    last[-1] = (last[-1][0], k1)
                else:
                    last.append((k0, k1))
                width += k1 - k0
            else:
                pieces.append([(k0, k1)])
                width = k1 - k0
        # A query block with no allowed key still visits one (fully masked) tile, so that its
        # rows get the alignment's empty-row result.
        if not pieces:
            return [TileKeys(0, min(self.block_k, self.n))]
        out = []
        for runs in pieces:
            if len(runs) == 1:
                out.append(TileKeys(*runs[0]))
            else:
                idx = torch.cat([torch.arange(a, b) for a, b in runs])
                out.append(TileKeys(runs[0][0], runs[-1][1], idx))
        return out

    def raw(
        self, qb: Tensor | None, kb: Tensor, bb: Tensor | None, q0: int, q1: int, keys: TileKeys
    ):
        """Scores + bias of query rows [q0, q1) × the keys of ``kb``, in the work dtype."""
        e = compiled.pairwise(self.score)(qb, kb, keys.k0)
        if self.multi:
            e = e.movedim(-1, -3)
        e = e.to(self.work)
        if bb is not None:
            e = e + (bb.unsqueeze(-3) if self.multi else bb).to(self.work)
        rows = (q1 - q0, e.shape[-1])
        e = e.expand(*self.lead, *((e.shape[-3],) if self.multi else ()), *rows)
        if self.score_mod is not None:
            e = apply_score_mod(self.score_mod, e, q0, keys.positions(e.device))
        return e

    def tile_mask(self, q0: int, q1: int, keys: TileKeys) -> Tensor | None:
        """The mask of a tile (the call's mask and, unless every block mask tile it spans is
        full, the block mask's)."""
        mask = block_of(self.mask, q0, q1, keys)
        bm = self.block_mask
        if bm is not None:
            full = self.groups[q0][2]
            if not all(full[j] for j in keys.tiles(self.block_k)):
                if keys.idx is None:
                    pattern = bm.tile(q0, q1, keys.k0, keys.k1)
                else:
                    pattern = bm.tile_at(q0, q1, keys.idx, keys.tiles(self.block_k))
                mask = pattern if mask is None else mask & pattern
        return mask

    def prepared(self, e: Tensor, q0: int, q1: int, keys: TileKeys) -> Tensor:
        """What the alignment reads: its working units, −inf at masked keys."""
        e = self.align.stream_prepare(e)
        mask = self.tile_mask(q0, q1, keys)
        if mask is not None:
            e = e.masked_fill(~(mask.unsqueeze(-3) if self.multi else mask), float("-inf"))
        return e

    def tile(self, qp, kp, bias, q0: int, q1: int, keys: TileKeys) -> Tensor:
        qb = None if qp is None else qp[..., q0:q1, :]
        e = self.raw(qb, keys.take(kp, -2), block_of(bias, q0, q1, keys), q0, q1, keys)
        return self.prepared(e, q0, q1, keys)

    def tiles(self, qp, kp, bias, q0: int, q1: int):
        def sweep() -> Iterator[Tensor]:
            for keys in self.k_blocks(q0):
                yield self.tile(qp, kp, bias, q0, q1, keys)

        return sweep

    def weights(self, e: Tensor, stat: Tensor | None, q0: int, q1: int) -> Tensor:
        p = self.align.stream_weights(e, stat)
        if self.has_key is not None:
            hk = sliced(self.has_key, -2, q0, q1)
            p = torch.where(
                hk.unsqueeze(-3) if self.multi else hk, p, torch.zeros((), dtype=p.dtype)
            )
        return p

    # ---- layouts: per-row quantities (…, [d,] M_b, 1) and context rows (…, M_b, d_v) --------

    def to_context(self, x: Tensor) -> Tensor:
        return x.squeeze(-1).transpose(-1, -2) if self.multi else x

    def from_context(self, y: Tensor) -> Tensor:
        return y.transpose(-1, -2).unsqueeze(-1) if self.multi else y.sum(-1, keepdim=True)

    def _combine(self, p: Tensor, vb: Tensor) -> Tensor:
        if self.multi:
            return torch.einsum("...dmn,...nd->...md", p, vb)  # eq. 30
        return torch.matmul(p, vb)  # eq. 4

    def combine(self, p: Tensor, vb: Tensor) -> Tensor:
        """Σ_l p_l v_l over the block: (…, M_b, d_v)."""
        vb = vb.to(self.work)
        return guarded_sum(self._combine, p, vb) if self.guard else self._combine(p, vb)

    def d_weights(self, d_out: Tensor, vb: Tensor) -> Tensor:
        """∂loss/∂p for the block, from ∂loss/∂context."""
        vb = vb.to(self.work)
        if self.guard:
            vb = torch.where(torch.isfinite(vb), vb, torch.zeros((), dtype=vb.dtype))
        if self.multi:
            return torch.einsum("...md,...nd->...dmn", d_out, vb)
        return torch.matmul(d_out, vb.transpose(-1, -2))

    def d_values(self, p: Tensor, d_out: Tensor) -> Tensor:
        if self.multi:
            return torch.einsum("...dmn,...md->...nd", p, d_out)
        return torch.matmul(p.transpose(-1, -2), d_out)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
