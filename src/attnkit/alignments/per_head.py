"""A different alignment per head (Galassi IV-D1): local heads beside global heads.

In :class:`attnkit.MultiHeadAttention` the alignment receives every head's scores at once,
(B, …, H, M, N). :class:`PerHead` applies alignment g to the heads of group g, so one layer can
hold, e.g., two local heads and six global ones (Yang et al. 2018 combine local and global
heads this way) without any change to the multi-head module::

    align = PerHead([Local(2), Softmax()], counts=[2, 6])
    mha = MultiHeadAttention(64, 8, align=align)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnkit import arguments, inputs
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput

__all__ = ["PerHead"]


def _resolve(align: object) -> Alignment:
    if isinstance(align, str):
        return REGISTRY.build(align)
    if not isinstance(align, Alignment):
        raise TypeError(f"aligns must hold Alignment modules or names, got {align!r}")
    return align


class PerHead(Alignment):
    """Alignment g on the heads of group g; the scores are (…, H, M, N), heads on dim −3.

    Args:
        aligns: one alignment (module or registered name) per group.
        counts: how many consecutive heads each group has (default one head per alignment);
            H = sum(counts).

    The query (…, H, M, d_q) and a per-head mask are split the same way. Capabilities follow
    the parts: normalised if every part is, stochastic or position-based if any part is.
    A stochastic part's ``log_prob`` (…, h_g, M) is joined with zeros for deterministic ones.
    """

    def __init__(
        self, aligns: Sequence[str | Alignment], counts: Sequence[int] | None = None
    ) -> None:
        super().__init__()
        if isinstance(aligns, (str, Alignment)) or not isinstance(aligns, Sequence):
            raise TypeError(f"aligns must be a sequence of alignments, got {aligns!r}")
        if not aligns:
            raise ValueError("aligns must hold at least one alignment")
        parts = [_resolve(a) for a in aligns]
        if counts is None:
            counts = [1] * len(parts)
        if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
            raise TypeError(f"counts must be a sequence of ints, got {counts!r}")
        if len(counts) != len(parts):
            raise ValueError(
                f"counts has {len(counts)} entries but there are {len(parts)} alignments"
            )
        self.counts = tuple(arguments.positive_int(c, "counts[i]") for c in counts)
        self.num_heads = sum(self.counts)
        self.aligns = nn.ModuleList(parts)
        self.normalized = all(a.normalized for a in parts)
        self.stochastic = any(a.stochastic for a in parts)  # type: ignore[misc]
        self.position_based = any(a.position_based for a in parts)  # type: ignore[misc]
        self.query_position_based = any(a.query_position_based for a in parts)  # type: ignore[misc]

    def taxonomy_tags(self) -> list:
        tags: list = []
        for a in self.aligns:
            tags += [t for t in a.taxonomy_tags() if t not in tags]
        return tags

    def extra_repr(self) -> str:
        return f"counts={self.counts}"

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        """Weights (…, H, M, N) from scores (…, H, M, N)."""
        scores = inputs.alignment_inputs(self, scores, mask)
        if scores.dim() < 3 or scores.shape[-3] != self.num_heads:
            raise ValueError(
                f"PerHead has {self.num_heads} heads (counts {self.counts}) and needs scores "
                f"(…, H, M, N) with H = {self.num_heads} on dim −3, got {tuple(scores.shape)}"
            )
        if mask is not None and mask.dim() >= 3 and mask.shape[-3] != 1:
            mask = mask.expand(*mask.shape[:-3], self.num_heads, *mask.shape[-2:])
        split_query = query is not None and query.dim() >= 3 and query.shape[-3] == self.num_heads
        weights, log_probs = [], []
        start = 0
        for align, count in zip(self.aligns, self.counts, strict=True):
            heads = slice(start, start + count)
            start += count
            part_mask = mask
            if mask is not None and mask.dim() >= 3 and mask.shape[-3] != 1:
                part_mask = mask[..., heads, :, :]
            part_query = query[..., heads, :, :] if split_query else query  # type: ignore[index]
            out = align(scores[..., heads, :, :], part_mask, query=part_query)
            weights.append(out.weights)
            log_probs.append(out.log_prob)
        log_prob = None
        if any(lp is not None for lp in log_probs):
            log_prob = torch.cat(
                [
                    torch.zeros(w.shape[:-1], dtype=w.dtype, device=w.device) if lp is None else lp
                    for w, lp in zip(weights, log_probs, strict=True)
                ],
                dim=-2,
            )
        return AlignOutput(torch.cat(weights, dim=-3), log_prob)
