"""Block masks: which (query block × key block) tiles of a sparse attention pattern hold any
allowed pair, and which hold only allowed pairs (FlexAttention's block mask, Wikipedia
"FlexAttention"), so that the chunked kernel's cost follows the pattern's density.

A pattern is a mask function ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = may attend)
evaluated on broadcastable index tensors, or a dense boolean mask. The block mask is built once;
the kernel then skips empty tiles, skips the masking work on full tiles, and evaluates the mask
function only on the partial tiles it visits (forward and backward).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from attnkit import arguments
from attnkit.inputs import broadcast_shapes

__all__ = [
    "AUTO_MAX_DENSITY",
    "AUTO_MIN_BLOCKS",
    "BlockMask",
    "MaskMod",
    "ScoreMod",
    "apply_score_mod",
    "check_type",
    "content_key",
    "from_dense_auto",
]

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

DEFAULT_BLOCK = 128
# Elements of partial tiles a block mask keeps (bool: bytes), 256 MiB.
_CACHE_ELEMENTS = 1 << 28

# A dense boolean mask is evaluated block-sparsely (:func:`from_dense_auto`) when at most this
# share of its DEFAULT_BLOCK × DEFAULT_BLOCK tiles holds an allowed pair (at least 60 % of the
# tiles empty) and it spans at least AUTO_MIN_BLOCKS blocks each way. Measured on CPU, 1 thread,
# softmax, d = 64 (benchmarks/RESULTS.md): against SDPA with the same dense mask the chunked
# kernel breaks even near density 0.45-0.5 at N = 2048 (0.6x the time at density 0.29), and
# loses below 8 blocks a side, where its per-tile work dominates.
AUTO_MAX_DENSITY = 0.4
AUTO_MIN_BLOCKS = 8


def _indices(lead: tuple[int, ...], device) -> tuple[Tensor, Tensor]:
    """b and h index tensors shaped to broadcast against (*lead, M_b, N_b)."""
    rank = len(lead) + 2
    zero = torch.zeros((1,) * rank, dtype=torch.long, device=device)
    b = h = zero
    if len(lead) >= 1:
        b = torch.arange(lead[0], device=device).view(lead[0], *([1] * (rank - 1)))
    if len(lead) >= 2:
        h = torch.arange(lead[1], device=device).view(1, lead[1], *([1] * (rank - 2)))
    return b, h


def apply_score_mod(
    score_mod: ScoreMod, e: Tensor, q0: int = 0, keys: Tensor | None = None
) -> Tensor:
    """``score_mod(e, b, h, q_idx, kv_idx)`` on scores e (*lead, M_b, N_b) whose first query is
    ``q0`` and whose keys sit at positions ``keys`` (default 0 … N_b − 1); b and h index the
    first two lead dims (0 when absent)."""
    lead = tuple(e.shape[:-2])
    b, h = _indices(lead[:2], e.device)
    rank = e.dim()
    b = b.view(*b.shape, *([1] * (rank - b.dim())))
    h = h.view(*h.shape, *([1] * (rank - h.dim())))
    q_idx = torch.arange(q0, q0 + e.shape[-2], device=e.device).view(*([1] * (rank - 2)), -1, 1)
    if keys is None:
        keys = torch.arange(e.shape[-1], device=e.device)
    kv_idx = keys.to(e.device).view(*([1] * (rank - 1)), -1)
    out = score_mod(e, b, h, q_idx, kv_idx)
    if not isinstance(out, Tensor):
        raise TypeError(
            f"score_mod must return a tensor of scores {tuple(e.shape)}, got {type(out).__name__}"
        )
    if out.dtype != e.dtype:
        raise TypeError(
            f"score_mod must return scores of the dtype it was given ({e.dtype}), got "
            f"{out.dtype}; convert the result with .to(e.dtype) (a boolean pattern belongs in "
            "block_mask= or mask=)"
        )
    if out.shape != e.shape:
        raise ValueError(
            f"score_mod must return the scores' shape {tuple(e.shape)}, got {tuple(out.shape)}"
        )
    return out


@dataclass
class BlockMask:
    """A sparse pattern over (*lead, M, N) scores, tiled in ``block_q`` × ``block_k`` blocks.

    Attributes:
        lead: the batch dims the pattern varies over (``()`` when it is the same for all; with
            mask functions ``(B, H)``, ``(B,)`` or ``()``).
        m, n: query and key lengths.
        block_q, block_k: tile size; the chunked kernel uses these blocks.
        any_allowed: (n_qblocks, n_kblocks) bool, a tile holds at least one allowed pair for some
            batch entry.
        all_allowed: (n_qblocks, n_kblocks) bool, every pair of the tile is allowed for every
            batch entry.
        has_key: (*lead, M, 1) bool, the row may attend at least one key.
    """

    lead: tuple[int, ...]
    m: int
    n: int
    block_q: int
    block_k: int
    any_allowed: Tensor
    all_allowed: Tensor
    has_key: Tensor
    mask_mod: MaskMod | None = None
    dense: Tensor | None = None
    partial: dict[tuple[int, int], Tensor] | None = None
    batch_only: bool = False  # from a mask function with ``batch=`` but no ``num_heads=``
    # The contents of ``dense`` (:func:`content_key`) when :func:`from_dense_auto` made it:
    # what the kernels derive from the mask's values is kept by this key.
    contents: tuple | None = None

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    @arguments.renamed(heads="num_heads")
    def from_mask_mod(
        cls,
        mask_mod: MaskMod,
        m: int,
        n: int,
        *,
        batch: int | None = None,
        num_heads: int | None = None,
        block_q: int = DEFAULT_BLOCK,
        block_k: int = DEFAULT_BLOCK,
        device: torch.device | str | None = None,
    ) -> BlockMask:
        """Evaluate ``mask_mod(b, h, q_idx, kv_idx)`` tile by tile (memory O(block_q·block_k)).

        ``batch``/``num_heads`` None means the pattern does not depend on them (b, h are passed
        as 0).
        """
        heads = num_heads
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        m, n = arguments.positive_int(m, "m"), arguments.positive_int(n, "n")
        block_q = arguments.positive_int(block_q, "block_q")
        block_k = arguments.positive_int(block_k, "block_k")
        if heads is not None and batch is None:
            batch = 1
        lead = tuple(
            arguments.positive_int(x, name)
            for x, name in ((batch, "batch"), (heads, "num_heads"))
            if x is not None
        )
        b, h = _indices(lead, device)
        nq, nk = -(-m // block_q), -(-n // block_k)
        any_allowed = torch.zeros(nq, nk, dtype=torch.bool)
        all_allowed = torch.zeros(nq, nk, dtype=torch.bool)
        has_key = torch.zeros(*lead, m, 1, dtype=torch.bool, device=device)
        partial: dict[tuple[int, int], Tensor] | None = {}
        kept = 0
        kv_idx = torch.arange(n, device=device)[None, :]
        for i in range(nq):  # one block row of queries against every key at once
            q0, q1 = i * block_q, min((i + 1) * block_q, m)
            q_idx = torch.arange(q0, q1, device=device)[:, None]
            row = cls._call(mask_mod, b, h, q_idx, kv_idx, (*lead, q1 - q0, n))
            has_key[..., q0:q1, :] = row.any(dim=-1, keepdim=True)
            for j in range(nk):
                tile = row[..., j * block_k : min((j + 1) * block_k, n)]
                any_allowed[i, j] = bool(tile.any())
                all_allowed[i, j] = bool(tile.all())
                if partial is not None and any_allowed[i, j] and not all_allowed[i, j]:
                    # Keep the partial tiles while they fit a budget: the kernel then reads
                    # them instead of evaluating the mask function again on every visit.
                    kept += tile.numel()
                    partial = None if kept > _CACHE_ELEMENTS else partial
                    if partial is not None:
                        partial[i, j] = tile.clone()
        return cls(
            lead,
            m,
            n,
            block_q,
            block_k,
            any_allowed,
            all_allowed,
            has_key,
            mask_mod=mask_mod,
            partial=partial,
            batch_only=len(lead) == 1 and heads is None,
        )

    @classmethod
    def from_dense(
        cls, mask: Tensor, *, block_q: int = DEFAULT_BLOCK, block_k: int = DEFAULT_BLOCK
    ) -> BlockMask:
        """From a boolean mask (*lead, M, N), True = may attend.

        The block mask holds a copy of ``mask``: it is what the mask was when the block mask
        was built (later changes to ``mask`` do not reach it; build it again after one)."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() < 2:
            got = (
                f"{mask.dtype} of shape {tuple(mask.shape)}"
                if isinstance(mask, Tensor)
                else type(mask).__name__
            )
            raise TypeError(f"mask must be a boolean tensor (…, M, N), got {got}")
        block_q = arguments.positive_int(block_q, "block_q")
        block_k = arguments.positive_int(block_k, "block_k")
        m, n = mask.shape[-2:]
        if m == 0 or n == 0:
            raise ValueError(f"mask has no queries or keys (shape {tuple(mask.shape)})")
        return cls._from_flags(mask.clone(), block_q, block_k)

    @classmethod
    def _from_flags(cls, mask: Tensor, block_q: int, block_k: int) -> BlockMask:
        """From a boolean mask (*lead, M, N) in one pass: per row and key tile, the max and the
        min of the mask (as uint8), then per tile and per row (no padded copy of the mask)."""
        lead, (m, n) = tuple(mask.shape[:-2]), mask.shape[-2:]
        nq, nk = -(-m // block_q), -(-n // block_k)
        u = mask.reshape(-1, m, n).view(torch.uint8)
        whole = (n // block_k) * block_k
        hi, lo = [], []
        if whole:
            body = u[..., :whole].reshape(u.shape[0], m, whole // block_k, block_k)
            hi.append(body.amax(-1))
            lo.append(body.amin(-1))
        if whole < n:  # a last, narrower key tile
            tail = u[..., whole:]
            hi.append(tail.amax(-1, keepdim=True))
            lo.append(tail.amin(-1, keepdim=True))
        row_any = torch.cat(hi, -1) if len(hi) > 1 else hi[0]  # (L, M, nk)
        row_all = torch.cat(lo, -1) if len(lo) > 1 else lo[0]
        pad = nq * block_q - m  # rows of the last query tile beyond M: no effect
        any_allowed = torch.nn.functional.pad(row_any, (0, 0, 0, pad), value=0)
        all_allowed = torch.nn.functional.pad(row_all, (0, 0, 0, pad), value=1)
        any_allowed = any_allowed.view(-1, nq, block_q, nk).amax(dim=(0, 2)).bool().cpu()
        all_allowed = all_allowed.view(-1, nq, block_q, nk).amin(dim=(0, 2)).bool().cpu()
        has_key = row_any.amax(-1).bool().reshape(*lead, m, 1)
        return cls(lead, m, n, block_q, block_k, any_allowed, all_allowed, has_key, dense=mask)

    @staticmethod
    def _call(mask_mod, b, h, q_idx, kv_idx, shape) -> Tensor:
        rank = len(shape)
        q = q_idx.view(*([1] * (rank - 2)), *q_idx.shape)
        kv = kv_idx.view(*([1] * (rank - 2)), *kv_idx.shape)
        out = mask_mod(b, h, q, kv)
        if not isinstance(out, Tensor) or out.dtype != torch.bool:
            raise TypeError(
                "mask_mod must return a boolean tensor, got "
                f"{type(out).__name__}{'' if not isinstance(out, Tensor) else ' ' + str(out.dtype)}"
            )
        try:
            return out.expand(shape)
        except RuntimeError:
            raise ValueError(
                f"mask_mod returned shape {tuple(out.shape)}, which does not broadcast to the "
                f"tile {shape}"
            ) from None

    # ---- use ---------------------------------------------------------------------------------

    def tile(self, q0: int, q1: int, k0: int, k1: int) -> Tensor:
        """The (*lead, q1−q0, k1−k0) boolean mask of rows [q0, q1) and keys [k0, k1)."""
        if self.dense is not None:
            return self.dense[..., q0:q1, k0:k1]
        if self._assembles(q0, q1, k0) and (k1 % self.block_k == 0 or k1 == self.n):
            return self._assemble(q0, q1, list(range(k0 // self.block_k, -(-k1 // self.block_k))))
        return self.tile_at(q0, q1, torch.arange(k0, k1, device=self.has_key.device))

    def _assembles(self, q0: int, q1: int, k0: int) -> bool:
        """Whether the kept tiles give the mask of these tile-aligned rows and keys."""
        aligned_q = q0 % self.block_q == 0 and (q1 % self.block_q == 0 or q1 == self.m)
        return self.partial is not None and aligned_q and k0 % self.block_k == 0

    def _assemble(self, q0: int, q1: int, columns: list[int]) -> Tensor:
        """The mask of rows [q0, q1) (whole query blocks) and the key tiles ``columns``, from
        the kept partial tiles and the full / empty flags."""
        assert self.partial is not None
        device = self.has_key.device
        rows = []
        for i in range(q0 // self.block_q, -(-q1 // self.block_q)):
            height = min((i + 1) * self.block_q, self.m) - i * self.block_q
            parts = []
            for j in columns:
                width = min((j + 1) * self.block_k, self.n) - j * self.block_k
                kept = self.partial.get((i, j))
                if kept is None:
                    flag = bool(self.all_allowed[i, j])
                    kept = torch.full((height, width), flag, dtype=torch.bool, device=device)
                parts.append(kept.expand(*self.lead, height, width))
            rows.append(torch.cat(parts, dim=-1))
        return torch.cat(rows, dim=-2)

    def tile_at(self, q0: int, q1: int, kv_idx: Tensor, columns: list[int] | None = None) -> Tensor:
        """The (*lead, q1−q0, len(kv_idx)) boolean mask of rows [q0, q1) at keys ``kv_idx``;
        ``columns``: the key tiles ``kv_idx`` is made of, whole and in order, when it is."""
        if self.dense is not None:
            return self.dense[..., q0:q1, :].index_select(-1, kv_idx.to(self.dense.device))
        if columns is not None and self._assembles(q0, q1, 0):
            return self._assemble(q0, q1, columns)
        assert self.mask_mod is not None
        device = self.has_key.device
        b, h = _indices(self.lead, device)
        q_idx = torch.arange(q0, q1, device=device)[:, None]
        shape = (*self.lead, q1 - q0, kv_idx.numel())
        return self._call(self.mask_mod, b, h, q_idx, kv_idx.to(device)[None, :], shape)

    def to_dense(self) -> Tensor:
        """The whole (*lead, M, N) mask (for the dense reference path)."""
        if self.dense is not None:
            return self.dense
        return self.tile(0, self.m, 0, self.n)

    @property
    def density(self) -> float:
        """Share of tiles the kernel visits."""
        return float(self.any_allowed.float().mean())

    def check(self, shape: torch.Size) -> None:
        """Raise unless this block mask fits scores of ``shape`` (B, …, M, N)."""
        if (self.m, self.n) != tuple(shape[-2:]):
            raise ValueError(
                f"block_mask is for M = {self.m}, N = {self.n} but the scores are "
                f"{tuple(shape)} (…, M, N)"
            )
        if self.batch_only and len(shape) > 3:
            # lead (B,) would line up with the scores' last batch dim (heads), not the first.
            raise ValueError(
                f"block_mask was built with batch={self.lead[0]} but no num_heads=, so it is "
                f"(B, M, N); the scores {tuple(shape)} have more batch dims: pass num_heads= "
                "(num_heads=1 when the pattern is the same for every head) so that b indexes the "
                "first dim"
            )
        try:
            ok = broadcast_shapes(tuple(self.has_key.shape[:-2]), shape[:-2]) == shape[:-2]
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"block_mask varies over batch dims {self.lead}, which do not broadcast to the "
                f"scores' {tuple(shape[:-2])}"
            )

    def __repr__(self) -> str:
        return (
            f"BlockMask(lead={self.lead}, M={self.m}, N={self.n}, blocks="
            f"{self.block_q}x{self.block_k}, density={self.density:.3f})"
        )


# The contents of a dense mask (:func:`content_key`) -> its block mask without the dense tensor,
# or None when the mask is not sparse enough; the most recently used entries.
_AUTO_CACHE: OrderedDict[tuple, BlockMask | None] = OrderedDict()
_AUTO_CACHE_SIZE = 64


def content_key(mask: Tensor) -> tuple:
    """A key of a boolean CPU ``mask`` that changes with any of its values: its shape and a
    128-bit BLAKE2 digest of its values packed eight to a byte (one pass over M·N bytes, much
    less than attention over them). Two tensors with the same values share it, whatever their
    identity, strides or version counter; a write the version counter does not see (through
    ``.numpy()`` or ``.data``) changes it."""
    packed = np.packbits(mask.detach().numpy())
    return (tuple(mask.shape), hashlib.blake2b(packed, digest_size=16).digest())


def from_dense_auto(mask: Tensor | None, shape: torch.Size) -> BlockMask | None:
    """The block mask of a dense boolean ``mask`` for scores of ``shape`` (B, …, M, N), when
    evaluating it block-sparsely pays: the mask is (…, M, N) (not broadcast along M or N), on
    the CPU, spans at least :data:`AUTO_MIN_BLOCKS` blocks of :data:`DEFAULT_BLOCK` each way,
    and at most :data:`AUTO_MAX_DENSITY` of its tiles hold an allowed pair. None otherwise.

    The tile flags come from one pass over the mask and are kept by the mask's contents
    (:func:`content_key`), so a mask shared by every layer of a model, or made again with the
    same values at each step, is converted once, and a mask changed in any way (in place,
    through ``.numpy()`` or ``.data`` included) is converted again. The block mask holds
    ``mask`` itself for its partial tiles, so attention with it equals attention with ``mask``.
    """
    if mask is None or mask.dtype != torch.bool or mask.dim() < 2 or mask.device.type != "cpu":
        return None
    m, n = shape[-2:]
    if tuple(mask.shape[-2:]) != (m, n):
        return None
    if min(-(-m // DEFAULT_BLOCK), -(-n // DEFAULT_BLOCK)) < AUTO_MIN_BLOCKS:
        return None
    key = content_key(mask)
    if key in _AUTO_CACHE:
        _AUTO_CACHE.move_to_end(key)
        kept = _AUTO_CACHE[key]
    else:
        found = BlockMask._from_flags(mask, DEFAULT_BLOCK, DEFAULT_BLOCK)
        kept = None
        if found.density <= AUTO_MAX_DENSITY:
            kept = dataclasses.replace(found, dense=None, contents=key)
        if len(_AUTO_CACHE) >= _AUTO_CACHE_SIZE:  # e.g. a mask of new values at each step
            _AUTO_CACHE.popitem(last=False)
        _AUTO_CACHE[key] = kept
    return None if kept is None else dataclasses.replace(kept, dense=mask)


def check_type(block_mask: object) -> None:
    """Raise TypeError unless ``block_mask`` is a :class:`BlockMask` (a pattern function passed
    instead is told how to build one)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"block_mask must be an attnkit.kernels.BlockMask, got {type(block_mask).__name__}"
            + (
                " (a pattern: build its block mask with attnkit.patterns.block_mask(pattern, "
                "M, N), or give it to a layer when it is built, pattern=)"
                if callable(block_mask)
                else ""
            )
        )
