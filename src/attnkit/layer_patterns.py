"""Sparse patterns and score_mods in the layers: what :class:`attnkit.MultiHeadAttention` (and the
Transformer layers built on it) does with ``pattern=``, ``block_mask=`` and ``score_mod=``.

- A **pattern** (a mask function, :mod:`attnkit.patterns`) given to a layer is turned into a
  :class:`attnkit.kernels.BlockMask` for each (M, N) it meets, built once and kept (a small
  cache shared by every layer holding the same pattern), so the chunked kernel's cost follows
  the pattern's density. While decoding with a KV cache the step's rows of the pattern (queries
  after the cached positions) become a dense mask: one row against N keys is cheap.
- A **score_mod** ``(e, b, h, q_idx, kv_idx) -> e'`` sees the per-head scores (B, H, M, N): b
  indexes the batch and h the head. With a KV cache, q_idx counts the cached positions.
- Only a per-head part whose scores exist as a matrix declares ``accepts_block_mask`` /
  ``accepts_score_mod`` (:class:`attnkit.Attention`); any other part is refused with the reason.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from attnkit import inputs, score_mods
from attnkit.kernels.block_mask import BlockMask, MaskMod, ScoreMod, check_type

__all__ = [
    "arguments",
    "check_call",
    "check_part",
    "combine_mods",
    "pattern_block_mask",
    "pattern_rows",
]

# (pattern, M, N, device) -> its block mask; a few lengths of a few patterns.
_BLOCK_MASKS: OrderedDict[tuple, BlockMask] = OrderedDict()
_BLOCK_MASKS_SIZE = 16


def check_part(part: nn.Module, *, block_mask: bool, score_mod: bool, what: str) -> None:
    """Raise ValueError unless ``part`` declares that it honours a block mask / a score_mod (the
    ones asked for)."""
    for wanted, flag, name in (
        (block_mask, "accepts_block_mask", "a block mask (pattern= / block_mask=)"),
        (score_mod, "accepts_score_mod", "a score_mod"),
    ):
        if wanted and not getattr(part, flag, False):
            raise ValueError(
                f"{what}: attention part {type(part).__name__} does not declare {flag} = True, "
                f"so it cannot honour {name}: its scores are not a score x alignment matrix that "
                "can be restricted tile by tile or rewritten. Pass the pattern as a dense boolean "
                "mask= (e.g. attnkit.patterns.dense(pattern, M, N)) or use attnkit.Attention"
            )


def check_call(
    block_mask: object, score_mod: object, query: Tensor, *, cached: int, has_pattern: bool
) -> None:
    """Validate ``block_mask`` / ``score_mod`` of a multi-head call at its public entry."""
    if block_mask is not None:
        check_type(block_mask)
        if has_pattern:
            raise ValueError(
                "this layer was built with pattern=, which sets its block mask; pass further "
                "restrictions as mask="
            )
        if cached:
            raise ValueError(
                "block_mask with cache=: a block mask covers the rows of a whole sequence, not "
                "the new rows of a decoding step; build the layer with pattern= (its rows are "
                "taken at every step) or pass mask="
            )
        if block_mask.lead and query.dim() > 3:
            raise ValueError(
                f"block_mask varies over batch dims {block_mask.lead}, which line up with "
                f"(B, H) of the per-head scores only for a query (B, M, E); got query "
                f"{tuple(query.shape)}"
            )
    if score_mod is not None:
        inputs.score_mod(score_mod)
        if query.dim() > 3:
            raise ValueError(
                "score_mod reads b as the batch index and h as the head: give a query (B, M, E) "
                f"or (M, E), got {tuple(query.shape)}"
            )


def pattern_block_mask(pattern: MaskMod, m: int, n: int, device: torch.device) -> BlockMask:
    """The block mask of ``pattern`` over M queries × N keys (b = h = 0), built once per
    (pattern, M, N, device) and kept while it is among the most recently used."""
    key = (pattern, m, n, str(device))
    found = _BLOCK_MASKS.get(key)
    if found is None:
        found = BlockMask.from_mask_mod(pattern, m, n, device=device)
        if len(_BLOCK_MASKS) >= _BLOCK_MASKS_SIZE:
            _BLOCK_MASKS.popitem(last=False)
        _BLOCK_MASKS[key] = found
    else:
        _BLOCK_MASKS.move_to_end(key)
    return found


def pattern_rows(pattern: MaskMod, q0: int, m: int, n: int, device: torch.device) -> Tensor:
    """The (M, N) boolean mask of ``pattern`` for queries at positions q0 … q0 + M − 1 and keys
    0 … N − 1 (b = h = 0): the rows of a decoding step."""
    q_idx = torch.arange(q0, q0 + m, device=device)[:, None]
    kv_idx = torch.arange(n, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    out = pattern(zero, zero, q_idx, kv_idx)
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        raise TypeError(f"pattern must return a boolean tensor, got {type(out).__name__}")
    return out.expand(m, n)


def combine_mods(own: ScoreMod | None, call: ScoreMod | None, offset: int) -> ScoreMod | None:
    """The score_mod of one call: the layer's own, then the call's, with q_idx counting
    ``offset`` cached positions. Declared forms (:mod:`attnkit.score_mods`) stay declared: a
    composition of additive (relative) ones is additive (relative), and so is its shift."""
    mod = own if call is None else call if own is None else score_mods.compose(own, call)
    if mod is None or offset == 0:
        return mod
    return score_mods.shifted(mod, offset)


def arguments(
    pattern: MaskMod | None,
    own_mod: ScoreMod | None,
    block_mask: BlockMask | None,
    score_mod: ScoreMod | None,
    mask: Tensor | None,
    m: int,
    n: int,
    *,
    offset: int,
    decoding: bool,
    device: torch.device,
) -> tuple[Tensor | None, dict]:
    """The mask and the ``block_mask`` / ``score_mod`` keywords of a per-head call over M
    queries (after ``offset`` cached positions) × N keys, from a layer's own ``pattern`` and
    score_mod and the call's (validated by :func:`check_call`)."""
    sparse: dict = {}
    if pattern is not None:
        if decoding:  # a decoding step: the pattern's rows of the new queries
            rows = pattern_rows(pattern, offset, m, n, device)
            mask = rows if mask is None else mask & rows
        else:
            sparse["block_mask"] = pattern_block_mask(pattern, m, n, device)
    elif block_mask is not None:
        sparse["block_mask"] = block_mask
    mod = combine_mods(own_mod, score_mod, offset)
    if mod is not None:
        sparse["score_mod"] = mod
    return mask, sparse
