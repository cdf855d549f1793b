"""Ring attention as a per-head attention part, for :class:`attnkit.MultiHeadAttention`'s
``attention=`` slot: context parallelism with no change to the layer.

Each rank runs the same layer on its part of the tokens (laid out as the part's ``layout``
says); the projections are per token, so only the attention needs the other ranks' keys, and
this part fetches them around the ring (:func:`attnkit.distributed.ring_attention`).

Positions are global: with ``position=`` the part places its tokens at their positions in the
whole sequence (:mod:`attnkit.distributed.positions`), rotating its queries and keys (RoPE) and
adding position biases tile by tile (ALiBi, T5), so the layer equals the layer on the whole
sequence with that position scheme. Leave the layer's own ``position`` slot empty then: the
layer would place the tokens at their local positions.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnkit import checks
from attnkit.alignments import Alignment
from attnkit.distributed.layout import check_layout
from attnkit.distributed.positions import RingPositions, global_positions
from attnkit.distributed.ring import attend, reasons_not_supported
from attnkit.distributed.transport import Ring
from attnkit.head import HeadAttention
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.output import AttentionOutput
from attnkit.positions import PositionScheme
from attnkit.scores import Score

__all__ = ["RingAttention"]


class RingAttention(HeadAttention):
    """Score → align → weighted sum over a sequence split across the ranks of ``group``.

    Args:
        score: a :class:`attnkit.scores.Score` or the name of a parameter-free one.
        align: an alignment implementing the streaming protocol, or its name.
        group: the process group of the ring (None: the default group).
        causal: each token attends to the tokens at or before its global position. Pass this
            instead of a causal mask: a mask given to the layer covers this rank's tokens only.
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced under ``causal``); the tokens each
            rank passes to the layer must be laid out so (:func:`attnkit.distributed.shard`).
        chunk_size: key tile size.
        position: a position scheme (a :class:`attnkit.positions.PositionScheme` or its
            registered name) applied by global positions: RoPE (scaled or not), ALiBi or T5
            buckets (:mod:`attnkit.distributed.positions`); None for no positions here.

    The layer's ``mask`` may mark padded keys, (B, 1, 1, N_l) or (B, 1, N_l) as
    :func:`attnkit.masks.from_lengths` gives for this rank's tokens; a causal part also takes
    a causal mask of this rank's tokens ∧ padded keys (what a decoder layer passes: the part is
    causal by global positions already, and the mask's causal triangle adds only the padding).
    ``causal_by_mask`` (set by :func:`attnkit.distributed.context_parallel` for a layer the model
    declares causal) refuses a call of more than one query without a causal mask: the layer was
    called non-causally. A bias and weights are not offered. A refusal on one rank (a mask of
    another form, an odd part under zigzag, ...) reaches every rank of the group as the same
    ValueError. The parameters' gradients on each rank are its tokens' part: sum them over the
    group (``torch.distributed.all_reduce``) before the optimiser step.
    """

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    decodes_with_cache: ClassVar[bool] = False
    # a block mask and a score_mod over the whole sequence (global positions)
    accepts_block_mask: ClassVar[bool] = True
    accepts_score_mod: ClassVar[bool] = True
    # each rank holds its tokens' keys only: never a whole row of weights, and a row without
    # a key here has keys on other ranks
    returns_weights: ClassVar[bool] = False
    sharded: ClassVar[bool] = True

    def __init__(
        self,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        *,
        group: dist.ProcessGroup | None = None,
        causal: bool = False,
        layout: str = "contiguous",
        chunk_size: int | None = None,
        position: str | PositionScheme | None = None,
    ) -> None:
        super().__init__()
        self.score = checks.resolve_score(score)
        self.align = checks.resolve_alignment(align)
        reasons = reasons_not_supported(self.score, self.align)
        if reasons:
            raise ValueError("ring attention cannot evaluate this part: " + "; ".join(reasons))
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        self.group = group
        self.causal = causal
        self.layout = check_layout(layout)
        self.chunk_size = chunk_size
        if isinstance(position, str):
            from attnkit import positions

            position = positions.build(position)
        if position is not None and not isinstance(position, PositionScheme):
            raise TypeError(
                "position must be a per-head position scheme (attnkit.positions."
                f"PositionScheme), its registered name or None, got {type(position).__name__}"
            )
        self.position = None if position is None else RingPositions(position)
        # Set by context_parallel for a layer its model declares causal: such a layer passes a
        # causal mask with every call of more than one query, so a call without one is the
        # layer called non-causally (a decoder with causal=False), which this part is not.
        self.causal_by_mask = False

    @property
    def mask_forms(self) -> frozenset[str]:  # type: ignore[override]
        """Key padding; and a causal mask (∧ key padding) when the part is causal."""
        return frozenset({"key", "causal"}) if self.causal else frozenset({"key"})

    # The template's holes (attnkit.head.HeadAttention.forward validates, refuses a bias and
    # weights by capability, hides the keys no query of this rank attends).

    def declared_mask(self, mask: Tensor | None, m: int, who: str) -> Tensor | None:
        """The mask as given: :meth:`attend` reads it as padded keys (within the causal
        triangle for a causal part) and refuses any other form with the other ranks."""
        return mask

    def refused(self, error: Exception, q, k, v, **call) -> AttentionOutput:
        """A call the template refused on this rank: agreed on with the other ranks, which
        then raise the same error (ring.attend), instead of leaving them waiting."""
        score_mod = call["score_mod"]
        if score_mod is None and self.position is not None and self.position.has_bias:
            score_mod = self.position  # what the accepting ranks pass on (_positioned)
        return attend(
            q,
            k,
            v,
            score=self.score,
            align=self.align,
            group=self.group,
            causal=self.causal,
            key_padding_mask=_padding_as_passed(call["mask"], q, k, self.causal),
            layout=self.layout,
            block_mask=call["block_mask"],
            score_mod=score_mod,
            chunk_size=self.chunk_size,
            refusal=error,
        )

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> AttentionOutput:
        # A refusal here is agreed on with the other ranks (ring.attend), never raised alone:
        # they would wait in the ring for this rank until the group's timeout.
        refusal, pad = None, None
        try:
            if self.position is not None:
                q, k, score_mod = self._positioned(q, k, score_mod)
            if self.causal_by_mask and q.shape[-2] > 1 and (mask is None or mask.shape[-2] == 1):
                raise ValueError(
                    "this causal ring part belongs to a layer that the model declares causal, "
                    "but the layer passed no causal mask (called with causal=False?); the twin "
                    "attends causally by global positions, as the model declares"
                )
            pad = None if mask is None else _key_padding(mask, q, k, self.causal)
        except (ValueError, TypeError) as err:
            refusal = err
        return attend(
            q,
            k,
            v,
            score=self.score,
            align=self.align,
            group=self.group,
            causal=self.causal,
            key_padding_mask=pad,
            layout=self.layout,
            block_mask=block_mask,
            score_mod=score_mod,
            chunk_size=self.chunk_size,
            refusal=refusal,
        )

    def _positioned(
        self, q: Tensor, k: Tensor, score_mod: ScoreMod | None
    ) -> tuple[Tensor, Tensor, ScoreMod | None]:
        """Queries and keys rotated by their global positions, and the score_mod that adds the
        scheme's bias by global positions before ``score_mod``."""
        pos = self.position
        ring = Ring.of(self.group)
        m, n = q.shape[-2], k.shape[-2]
        total = ring.size * max(m, n)
        where = (ring.rank, ring.size)
        q = pos.rotate(q, global_positions(*where, m, self.layout, q.device), total)
        k = pos.rotate(k, global_positions(*where, n, self.layout, k.device), total)
        if pos.has_bias:
            score_mod = pos if score_mod is None else _Composed(pos, score_mod)
        return q, k, score_mod


class _Composed(nn.Module):
    """``second(first(e, …), …)``: the position bias, then the caller's score_mod (as
    :func:`attnkit.attention` adds a bias before its score_mod); the parameters of both."""

    def __init__(self, first: nn.Module, second: ScoreMod) -> None:
        super().__init__()
        self.first = first
        if isinstance(second, nn.Module):
            self.second = second
        else:
            self._second = second

    def forward(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        second = self.second if hasattr(self, "second") else self._second
        return second(self.first(e, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)


def _key_padding(mask: Tensor, q: Tensor, k: Tensor, causal: bool) -> Tensor:
    """(B, N_l) or (1, N_l) from the layer's mask: padded keys, (B, 1, …, 1, N_l), or — for a
    causal part — a causal mask of this rank's tokens ∧ padded keys, (…, M_l, N_l), as a decoder
    layer passes: the part attends causally by global positions already, and within its causal
    triangle such a mask says only which keys are padding."""
    m, n = q.shape[-2], k.shape[-2]
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        what = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"mask must be a boolean tensor, True = may attend, got {what}")
    shape = tuple(mask.shape)
    if mask.dim() >= 2 and shape[-1] == n and shape[-2] == m and m > 1:
        if not causal:
            raise ValueError(
                f"RingAttention takes a mask of padded keys only, (B, 1, …, 1, N_l) with N_l = "
                f"{n} (e.g. masks.from_lengths), got {shape}: a mask over this rank's queries × "
                "keys; for a causal mask (a decoder layer's) make the part causal: "
                "RingAttention(causal=True) attends causally by global positions "
                "(context_parallel makes a decoder's self-attention so)"
            )
        mask = _causal_keys(mask, m, n)
        shape = tuple(mask.shape)
    if mask.dim() < 2 or shape[-1] != n or shape[-2] != 1 or any(s != 1 for s in shape[1:-1]):
        raise ValueError(
            f"RingAttention takes a mask of padded keys only, (B, 1, …, 1, N_l) with N_l = {n} "
            f"(e.g. masks.from_lengths), got {shape}; pass causal=True to RingAttention for a "
            "causal mask (by global positions)"
        )
    return mask if mask.dim() == 2 else mask.reshape(shape[0], n)


def _padding_as_passed(mask: object, q: object, k: object, causal: bool) -> Tensor | None:
    """The key padding that the ranks accepting a call pass on (:func:`_key_padding`), as far
    as it can be made from a call refused on this rank, so that the agreement names the
    refusal and not a difference in the padding; None where it cannot be made."""
    try:
        return None if mask is None else _key_padding(mask, q, k, causal)
    except (ValueError, TypeError, AttributeError, IndexError, RuntimeError):
        return None


def _causal_keys(mask: Tensor, m: int, n: int) -> Tensor:
    """(…, 1, N_l): the keys a causal mask ∧ key padding (…, M_l, N_l) keeps; ValueError when,
    within the causal triangle, its rows differ otherwise."""
    if m != n:
        raise ValueError(
            f"a causal mask (…, M_l, N_l) needs as many keys as queries on each rank, got "
            f"{tuple(mask.shape)}"
        )
    below = torch.ones(m, n, dtype=torch.bool, device=mask.device).tril()
    seen = mask & below
    keep = seen.any(-2, keepdim=True)  # a key that some query at or after it may attend
    if not bool((seen == (keep & below)).all()):
        raise ValueError(
            f"RingAttention(causal=True) takes a causal mask ∧ padded keys of this rank's "
            f"tokens (a decoder layer's), got a mask of shape {tuple(mask.shape)} that varies "
            "over queries otherwise within the causal triangle (a window or a pattern: give a "
            "block_mask over the whole sequence instead)"
        )
    return keep
