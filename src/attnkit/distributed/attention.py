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

import torch.distributed as dist
from torch import Tensor, nn

from attnkit import checks
from attnkit.alignments import Alignment
from attnkit.distributed.layout import check_layout
from attnkit.distributed.positions import RingPositions, global_positions
from attnkit.distributed.ring import reasons_not_supported, ring_attention
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

    The layer's ``mask`` may only mark padded keys, (B, 1, 1, N_l) or (B, 1, N_l) as
    :func:`attnkit.masks.from_lengths` gives for this rank's tokens; a bias and weights are
    not offered. The parameters' gradients on each rank are its tokens' part: sum them over the
    group (``torch.distributed.all_reduce``) before the optimiser step.
    """

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key"})

    decodes_with_cache: ClassVar[bool] = False

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

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        need_weights: bool = False,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> AttentionOutput:
        if bias is not None:
            raise ValueError("RingAttention takes no bias (a bias over the whole sequence)")
        if need_weights:
            raise ValueError(
                "RingAttention does not return weights: each rank never holds a whole row"
            )
        if self.position is not None:
            q, k, score_mod = self._positioned(q, k, score_mod)
        return ring_attention(
            q,
            k,
            v,
            score=self.score,
            align=self.align,
            group=self.group,
            causal=self.causal,
            key_padding_mask=None if mask is None else _key_padding(mask, k),
            layout=self.layout,
            block_mask=block_mask,
            score_mod=score_mod,
            chunk_size=self.chunk_size,
        )

    def _positioned(
        self, q: Tensor, k: Tensor, score_mod: ScoreMod | None
    ) -> tuple[Tensor, Tensor, ScoreMod | None]:
        """Queries and keys rotated by their global positions, and the score_mod that adds the
        scheme's bias by global positions before ``score_mod``."""
        pos = self.position
        if pos.rotates:
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


def _key_padding(mask: Tensor, k: Tensor) -> Tensor:
    """(B, N_l) from a mask that marks keys only: every dim but the batch's and the keys' 1."""
    n = k.shape[-2]
    shape = tuple(mask.shape)
    if mask.dim() < 2 or shape[-1] != n or any(s != 1 for s in shape[1:-1]) or mask.dim() < 3:
        raise ValueError(
            f"RingAttention takes a mask of padded keys only, (B, 1, …, 1, N_l) with N_l = {n} "
            f"(e.g. masks.from_lengths), got {shape}; pass causal=True to RingAttention for a "
            "causal mask (by global positions)"
        )
    return mask.reshape(shape[0], n)
