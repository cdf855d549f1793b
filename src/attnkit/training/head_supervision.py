"""Head-specific supervision inside a Transformer stack (Galassi V-A2; Strubell et al. 2018,
LISA: "Linguistically-Informed Self-Attention").

LISA trains one attention head of one layer to attend from each token to its syntactic parent,
as an auxiliary task beside the main one: with a_ij the head's weights, the parse loss is the
cross-entropy −Σ_i log a_{i, parent(i)} (Strubell et al., Sec. 2.2), added to the task loss.
The other heads stay free.

:func:`parent_loss` is that loss on given weights; :func:`head_supervision_loss` runs a stack
and returns its output with the loss on one head of one layer (through
:func:`attnkit.training.graph_capture.stack_head_weights`, which keeps the graph);
:func:`parent_accuracy` is the share of tokens whose head's argmax is the gold parent.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import checks
from attnkit.evaluation import supervised_attention_loss
from attnkit.training.graph_capture import stack_head_weights

__all__ = ["head_supervision_loss", "parent_accuracy", "parent_loss"]


def _parents(parents: object, weights: Tensor) -> Tensor:
    if not isinstance(parents, Tensor) or parents.dtype not in (torch.int32, torch.int64):
        raise TypeError(
            f"parents must be an integer tensor (…, M) of key indices (−1 = no parent), got "
            f"{parents!r}"
        )
    if tuple(parents.shape) != tuple(weights.shape[:-1]):
        raise ValueError(
            f"parents must have one entry per query row, shape {tuple(weights.shape[:-1])}, "
            f"got {tuple(parents.shape)}"
        )
    n = weights.shape[-1]
    bad = (parents < -1) | (parents >= n)
    if bool(bad.any()):
        raise ValueError(
            f"parents must be key indices in [0, {n}) or −1 (no parent), got {int(parents[bad][0])}"
        )
    return parents.long()


def parent_loss(weights: Tensor, parents: Tensor) -> Tensor:
    """LISA's attention loss: the mean over rows with a parent of −log a_{i, parent(i)}.

    Args:
        weights: one head's weights (…, M, N), rows on the simplex.
        parents: (…, M) the index of each query's parent among the N keys; −1 for a row that
            has none (left out of the mean).

    Equal to the KL divergence from the one-hot parent distribution
    (:func:`attnkit.evaluation.supervised_attention_loss`), which computes it.
    """
    weights = checks.floating(weights, "weights", "(…, M, N)", min_dim=2)
    parents = _parents(parents, weights)
    has = parents >= 0
    gold = nn.functional.one_hot(parents.clamp_min(0), weights.shape[-1]).bool()
    return supervised_attention_loss(weights, gold & has.unsqueeze(-1))


def parent_accuracy(weights: Tensor, parents: Tensor) -> float:
    """The share of rows with a parent whose largest weight falls on the parent (NaN if no row
    has one)."""
    weights = checks.floating(weights, "weights", "(…, M, N)", min_dim=2)
    parents = _parents(parents, weights)
    has = parents >= 0
    hits = (weights.argmax(-1) == parents) & has
    return float(hits.sum()) / int(has.sum()) if bool(has.any()) else float("nan")


def head_supervision_loss(
    stack: nn.Module,
    x: Tensor,
    parents: Tensor,
    *,
    layer: int,
    head: int,
    attention: str = "self_attention",
    **forward: Any,
) -> tuple[Tensor, Tensor]:
    """Run ``stack`` on ``x`` and return ``(output, loss)``: the stack's output and
    :func:`parent_loss` of head ``head`` of layer ``layer`` against ``parents`` (B, M).
    ``attention`` and ``forward`` (the stack's other arguments, e.g. ``mask=``) as
    :func:`attnkit.training.graph_capture.stack_head_weights`. Add ``λ·loss`` to the task loss.
    """
    out, weights = stack_head_weights(
        stack, x, layer=layer, head=head, attention=attention, **forward
    )
    return out, parent_loss(weights, parents)
