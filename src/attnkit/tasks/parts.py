"""Score and alignment modules from the names given on the command line."""

from __future__ import annotations

from torch import Tensor

import attnkit as ak
from attnkit import alignments as al
from attnkit.attention import Attention
from attnkit.scores import Score

__all__ = ["build_alignment", "build_attention", "build_score", "task_loss"]


def build_score(name: str, d_q: int, d_k: int, d_w: int) -> Score:
    """A score for queries of size d_q and keys of size d_k (d_w for the additive family)."""
    offered = {"d_q": d_q, "d_k": d_k, "d_w": d_w}
    accepted = ak.scores.REGISTRY.accepts(name)
    return ak.scores.build(name, **{k: v for k, v in offered.items() if k in accepted})


def build_alignment(name: str, d_q: int) -> al.Alignment:
    """An alignment by name; ``local`` is Luong's predictive local alignment (D = 2)."""
    if name == "local":
        return al.Local(2, "predictive", d_q=d_q)
    return ak.alignments.build(name)


def build_attention(score: str, align: str, d: int) -> Attention:
    """Attention with queries and keys of size d (and d_w = d) from the two names."""
    return Attention(build_score(score, d, d, d), build_alignment(align, d))


def task_loss(per_item: Tensor, log_prob: Tensor | None) -> Tensor:
    """Mean task loss, plus REINFORCE for stochastic alignments (hard, reinforced): the
    reward is the negative per-item loss, with the batch mean as baseline."""
    loss = per_item.mean()
    if log_prob is not None:
        reward = -per_item.detach()
        loss = loss - ((reward - reward.mean()) * log_prob).mean()
    return loss
