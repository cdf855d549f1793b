"""The model and examples an explanation suite probes (:class:`Probe`), read by
:mod:`attnkit.evaluation.suite` and :mod:`attnkit.evaluation.diagnostics`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["Probe"]


@dataclass
class Probe:
    """A classifier and examples to explain.

    Attributes:
        model: the model (eval mode); its alignment parts are edited by the counterfactuals.
        logits: ``(inputs (B, N, d), keep (B, N) bool) -> logits (B, C)``, the model run from
            its embeddings, an item with ``keep`` False removed.
        inputs: the examples' embeddings (B, N, d).
        keep: (B, N) True for real items (not padding).
        attention: (B, N) the attention weights over the items (one attention row per example).
        labels: (B,) true classes, or None.
        gold: (B, N) boolean gold rationale, or None.
        tokens: per example, the item labels for plots (optional).
        attention_part: the name of the attention part the counterfactuals edit (as
            :func:`attnkit.evaluation.capture` names it); None: every alignment part.
    """

    model: nn.Module
    logits: Callable[[Tensor, Tensor], Tensor]
    inputs: Tensor
    keep: Tensor
    attention: Tensor
    labels: Tensor | None = None
    gold: Tensor | None = None
    tokens: list[list[str]] | None = None
    attention_part: str | None = None
