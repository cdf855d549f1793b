"""Attention parts built from the names given to ``attnkit run``, at the model's sizes.

Each registered part builds itself: a score, an alignment or a per-head attention part is made
by its class's ``for_heads(head_dim=..., num_heads=..., max_len=...)`` (:mod:`attnkit.sizing`,
:class:`attnkit.head.HeadAttention`), so a part registered in one file is usable here, with no
table to update. A part that cannot be built from sizes alone is refused with a message naming
the argument it lacks, instead of being built with guessed values.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

import attnkit as ak
from attnkit import alignments as al
from attnkit import head_registry
from attnkit.core import Attention
from attnkit.scores import Score

__all__ = [
    "build_alignment",
    "build_attention",
    "build_score",
    "build_slot_attention",
    "slot_mechanisms",
    "task_loss",
    "usable_scores",
]


def slot_mechanisms(package: str | None = None) -> list[str]:
    """Registered per-head attention parts (:mod:`attnkit.head_registry`), optionally only
    those defined in ``package`` (e.g. ``"attnkit.efficient"``). New registrations appear here
    without any list to update."""
    names = head_registry.available()  # imports the registering packages
    if package is None:
        return names
    return [n for n in names if head_registry.REGISTRY.get(n).__module__.startswith(package + ".")]


def build_slot_attention(name: str, *, head_dim: int, num_heads: int, max_len: int) -> nn.Module:
    """The registered per-head part ``name`` (:mod:`attnkit.head_registry`) for ``num_heads``
    heads of ``head_dim`` features over at most ``max_len`` keys, built by its class's
    ``for_heads``.

    Raises ValueError for an unknown name, a mechanism that is not a per-head part, or a part
    that needs an argument the sizes do not give.
    """
    if name not in head_registry.available() and name in ak.mechanisms.available():
        raise ValueError(
            f"mechanism {name!r} is not a per-head attention part (an attnkit.HeadAttention); "
            f"usable: full, {', '.join(slot_mechanisms())}"
        )
    cls = head_registry.REGISTRY.get(name)  # unknown names: ValueError listing the options
    try:
        return cls.for_heads(
            embed_dim=head_dim * num_heads, num_heads=num_heads, head_dim=head_dim, max_len=max_len
        )
    except TypeError as err:
        raise ValueError(
            f"per-head part {name!r} cannot be built from the model's sizes ({err}); build it "
            "yourself and pass it as MultiHeadAttention(attention=...)"
        ) from None


def usable_scores() -> list[str]:
    """Registered scores, all of which ``attnkit run`` can build (each by its ``for_heads``)."""
    return ak.scores.available()


def build_score(
    name: str, *, head_dim: int, max_len: int, num_heads: int | None = None, **overrides: Any
) -> Score:
    """The registered score ``name`` for queries and keys of ``head_dim`` features over at most
    ``max_len`` keys (one parameter set per head when ``num_heads`` is given), built by its
    class's ``for_heads``; ``overrides`` are constructor arguments (e.g. ``d_w=``).

    Raises ValueError for an unknown name (with the closest one), TypeError for a score that
    needs an argument the sizes do not give or an override it does not take.
    """
    cls = ak.scores.REGISTRY.get(name)  # unknown names: ValueError listing the options
    return cls.for_heads(head_dim=head_dim, num_heads=num_heads, max_len=max_len, **overrides)


def build_alignment(
    name: str, head_dim: int, *, num_heads: int | None = None, **overrides: Any
) -> al.Alignment:
    """The registered alignment ``name`` for queries of ``head_dim`` features (for alignments
    that read the query), built by its class's ``for_heads``.

    Raises ValueError for an unknown name, or for an alignment that cannot be built from the
    sizes (an argument they do not give).
    """
    cls = ak.alignments.REGISTRY.get(name)  # unknown names: ValueError listing the options
    try:
        return cls.for_heads(head_dim=head_dim, num_heads=num_heads, **overrides)
    except TypeError as err:
        raise ValueError(f"alignment {name!r} cannot be built by attnkit run: {err}") from None


def build_attention(score: str, align: str, d: int, max_len: int) -> Attention:
    """Attention with queries and keys of size d (and d_w = d) over at most ``max_len`` keys."""
    return Attention(build_score(score, head_dim=d, max_len=max_len), build_alignment(align, d))


def task_loss(per_item: Tensor, log_prob: Tensor | None) -> Tensor:
    """Mean task loss, plus REINFORCE for stochastic alignments (hard, reinforced): the
    reward is the negative per-item loss, with the batch mean as baseline."""
    loss = per_item.mean()
    if log_prob is not None:
        reward = -per_item.detach()
        loss = loss - ((reward - reward.mean()) * log_prob).mean()
    return loss
