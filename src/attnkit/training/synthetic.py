"""Small generated tasks with a known relation, for the examples and checks of
:mod:`attnkit.training`: each planted relation is what a trained attention should find.

- :func:`parent_sequences` — token sequences where each token's *parent* is the nearest earlier
  anchor token (a stand-in for a syntactic head, as LISA's parse parent).
- :func:`signal_sequences` — sequences with one signal token among distractors; the label is
  the signal (attention should fall on it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import arguments

__all__ = ["ParentTask", "SignalTask", "parent_sequences", "signal_sequences"]


class ParentTask(NamedTuple):
    """tokens (n, L) in [0, vocab); parents (n, L): the index of each token's parent, −1 for
    the first token (which has none)."""

    tokens: Tensor
    parents: Tensor


class SignalTask(NamedTuple):
    """tokens (n, L); position (n,): where the signal token is; label (n,): the signal token,
    in [0, classes)."""

    tokens: Tensor
    position: Tensor
    label: Tensor


def _generator(generator: torch.Generator | None) -> torch.Generator | None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {generator!r}")
    return generator


def parent_sequences(
    n: int,
    length: int,
    *,
    vocab: int = 12,
    anchors: int = 3,
    anchor_rate: float = 0.3,
    generator: torch.Generator | None = None,
) -> ParentTask:
    """``n`` sequences of ``length`` tokens in [0, vocab); tokens below ``anchors`` are anchors
    (each position after the first is one with probability ``anchor_rate``; the first always
    is). The parent of position i ≥ 1 is the nearest anchor at a position j < i."""
    arguments.sizes(n=n, length=length, vocab=vocab, anchors=anchors)
    if anchors >= vocab:
        raise ValueError(f"anchors must be < vocab ({vocab}), got {anchors}")
    rate = arguments.finite_float(anchor_rate, "anchor_rate", positive=True)
    if rate > 1:
        raise ValueError(f"anchor_rate must be in (0, 1], got {anchor_rate!r}")
    g = _generator(generator)
    is_anchor = torch.rand(n, length, generator=g) < rate
    is_anchor[:, 0] = True
    anchor_ids = torch.randint(0, anchors, (n, length), generator=g)
    other_ids = torch.randint(anchors, vocab, (n, length), generator=g)
    tokens = torch.where(is_anchor, anchor_ids, other_ids)
    positions = torch.arange(length).expand(n, length)
    # the latest anchor at or before each position, then shifted by one: strictly before
    latest = torch.where(is_anchor, positions, torch.full_like(positions, -1)).cummax(-1).values
    parents = torch.cat([torch.full((n, 1), -1, dtype=torch.long), latest[:, :-1]], dim=1)
    return ParentTask(tokens, parents)


def signal_sequences(
    n: int,
    length: int,
    *,
    vocab: int = 16,
    classes: int = 4,
    generator: torch.Generator | None = None,
) -> SignalTask:
    """``n`` sequences of ``length`` tokens: one signal token in [0, classes) at a random
    position, distractors in [classes, vocab) elsewhere; the label is the signal token."""
    arguments.sizes(n=n, length=length, vocab=vocab, classes=classes)
    if classes >= vocab:
        raise ValueError(f"classes must be < vocab ({vocab}), got {classes}")
    g = _generator(generator)
    tokens = torch.randint(classes, vocab, (n, length), generator=g)
    position = torch.randint(0, length, (n,), generator=g)
    label = torch.randint(0, classes, (n,), generator=g)
    tokens[torch.arange(n), position] = label
    return SignalTask(tokens, position, label)
