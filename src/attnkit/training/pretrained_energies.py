"""Preliminary training (Galassi V-A1): attention energies learned beforehand — by another
model, on another task or data — fixed, and plugged into the attention of a new architecture,
which trains only its other parts.

Galassi et al.'s examples: Zhang et al. train a sentence-relevance model on rationales first;
Long et al. train a model of reading times on eye-tracking data, then use its predicted reading
time of each word as the energy score of a sentiment model's attention.

- :func:`freeze` fixes a trained module's parameters (e.g. a score module, then plugged into
  :class:`attnkit.Attention` as ``score=freeze(trained.score)``).
- :class:`PretrainedEnergies` holds a trained scorer — raw inputs (B, N, …) → energies (B, N)
  or (B, M, N) — fixed, and always in evaluation mode.
- :class:`EnergyAttention` attends with energies given from outside (eq. 3-4 with e supplied):
  a = align(e), c = Σ_l a_l v_l; with a :class:`PretrainedEnergies` it is the new
  architecture's attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import checks, hooks
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment
from attnkit.output import AttentionOutput

__all__ = ["EnergyAttention", "PretrainedEnergies", "freeze"]


def freeze(module: nn.Module) -> nn.Module:
    """Fix every parameter of ``module`` (``requires_grad=False``) and put it in evaluation
    mode; returns the same module. An optimiser built afterwards over a model holding it leaves
    it unchanged (an optimiser skips parameters without gradients)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    module.requires_grad_(False)
    return module.eval()


class PretrainedEnergies(nn.Module):
    """The energies of a scorer trained beforehand, fixed: ``e = scorer(*inputs)``.

    The scorer's parameters are frozen (:func:`freeze`) and it stays in evaluation mode when the
    model holding it is put in training mode (its dropout, if any, never acts), so the energies
    are a fixed function of the inputs. No graph is built through the scorer.

    Args:
        scorer: a trained module mapping the raw inputs to energies, (B, N) (one energy per
            element, e.g. a predicted relevance or reading time) or (B, …, M, N).
    """

    def __init__(self, scorer: nn.Module) -> None:
        super().__init__()
        self.scorer = freeze(scorer)

    def train(self, mode: bool = True) -> PretrainedEnergies:
        super().train(mode)
        self.scorer.eval()
        return self

    def forward(self, *inputs: Any, **kwargs: Any) -> Tensor:
        """The energies of ``scorer(*inputs, **kwargs)``, without a graph."""
        with torch.no_grad():
            energies = self.scorer(*inputs, **kwargs)
        if not isinstance(energies, Tensor) or not energies.is_floating_point():
            raise TypeError(
                f"the scorer must return a floating tensor of energies (B, N) or (B, …, M, N), "
                f"got {type(energies).__name__}"
            )
        return energies


class EnergyAttention(nn.Module):
    """Attention with energies given from outside: a = align(e) (Brauwers eq. 3), c = Σ_l a_l v_l
    (eq. 4). The energies come from ``energies`` (e.g. a :class:`PretrainedEnergies`), called
    on the inputs given to :meth:`forward`.

    Args:
        energies: a module mapping its inputs to energies, (B, N) or (B, …, M, N).
        align: an alignment (:mod:`attnkit.alignments`); softmax by default.
    """

    def __init__(self, energies: nn.Module, align: Alignment | str = "softmax") -> None:
        super().__init__()
        if not isinstance(energies, nn.Module):
            raise TypeError(f"energies must be an nn.Module, got {type(energies).__name__}")
        self.energies = energies
        self.align = checks.resolve_alignment(align)

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def forward(
        self, inputs: Any, values: Tensor, *, mask: Tensor | None = None
    ) -> AttentionOutput:
        """Args:
            inputs: what ``energies`` takes (a tensor, or a tuple of its positional arguments).
            values: (B, …, N, d_v).
            mask: boolean, True = may attend, broadcastable to the energies' (B, …, M, N)
                ((B, N) for one energy per element).

        Returns:
            AttentionOutput: context (B, …, M, d_v) — M = 1 for energies (B, N) — weights and
            scores (B, …, M, N).
        """
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        e = self.energies(*args)
        values = checks.floating(values, "values", "(B, …, N, d_v)", min_dim=2)
        if e.dim() == values.dim() - 1:  # one energy per element: a single query row
            e = e.unsqueeze(-2)
            if mask is not None and mask.dim() == e.dim() - 1:
                mask = mask.unsqueeze(-2)
        if e.shape[-1] != values.shape[-2]:
            raise ValueError(
                f"energies of shape {tuple(e.shape)} and values of shape "
                f"{tuple(values.shape)} disagree on N (the energies' last dim, the values' "
                "second to last)"
            )
        if mask is not None:
            mask = checks.boolean_mask(mask, "mask", tuple(e.shape))
        e = e.to(values.dtype)
        weights = self.align(e, mask).weights
        hooks.report(self, weights)
        context = torch.einsum("...mn,...nd->...md", weights, values)
        return AttentionOutput(context, weights, e)
