"""Wiring two models' attention for a loss between them: which attention module of the trained
model answers to which of the reference model (layer mapping), which head to which (head
mapping), and one run of both that returns the matched weight pairs — the trained model's with
their graph, the reference's without.

Used by :mod:`attnkit.training.distillation` (teacher → student, same inputs) and
:mod:`attnkit.training.domain_alignment` (source model → target model, paired inputs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from attnkit.training.graph_capture import attention_modules, capture_weights

__all__ = ["Matched", "match_heads", "run_matched", "uniform_pairs"]

Heads = str | Sequence[int] | None


class Matched(NamedTuple):
    """output: what the trained model returned; pairs: (trained weights, reference weights) per
    matched call, equal shapes (B, …, H, M, N), the first with its graph."""

    output: Any
    pairs: list[tuple[Tensor, Tensor]]


def uniform_pairs(trained: nn.Module, reference: nn.Module) -> dict[str, str]:
    """Map the trained model's S attention modules onto the reference's T ≥ S, evenly, as
    TinyBERT's uniform layer mapping (Jiao et al. 2020, g(m) = m·T/S): the s-th (from 1) takes
    the (s·T // S)-th, so the last takes the last. Names as
    :func:`attnkit.training.graph_capture.attention_modules`, in module order."""
    mine, theirs = list(attention_modules(trained)), list(attention_modules(reference))
    if not mine or not theirs:
        raise ValueError(
            f"both models must hold attention modules; found {len(mine)} in the trained model "
            f"and {len(theirs)} in the reference"
        )
    if len(mine) > len(theirs):
        raise ValueError(
            f"the trained model has {len(mine)} attention modules, more than the reference's "
            f"{len(theirs)}: give pairs explicitly"
        )
    s, t = len(mine), len(theirs)
    return {name: theirs[(i + 1) * t // s - 1] for i, name in enumerate(mine)}


def match_heads(trained: Tensor, reference: Tensor, heads: Heads = None) -> tuple[Tensor, Tensor]:
    """Bring multi-head weights (B, …, H, M, N) of two models to one shape.

    Args:
        trained: (B, …, H_s, M, N).
        reference: (B, …, H_t, M, N).
        heads: None — the same heads (H_s = H_t); ``"mean"`` — both averaged over their heads
            (the mean attention map); a sequence of H_s indices — student head h against
            reference head ``heads[h]``.
    """
    if heads is None:
        if trained.shape != reference.shape:
            raise ValueError(
                f"weights of shape {tuple(trained.shape)} and {tuple(reference.shape)} differ; "
                "give heads='mean' or a head index per trained head"
            )
        return trained, reference
    if isinstance(heads, str):
        if heads != "mean":
            raise ValueError(f"heads must be None, 'mean' or a sequence of ints, got {heads!r}")
        return trained.mean(-3, keepdim=True), reference.mean(-3, keepdim=True)
    if not isinstance(heads, Sequence) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in heads
    ):
        raise TypeError(f"heads must be None, 'mean' or a sequence of ints, got {heads!r}")
    if len(heads) != trained.shape[-3]:
        raise ValueError(
            f"heads must give one reference head per trained head ({trained.shape[-3]}), got "
            f"{len(heads)}"
        )
    if not all(0 <= h < reference.shape[-3] for h in heads):
        raise ValueError(
            f"heads must index the reference's {reference.shape[-3]} heads, got {list(heads)}"
        )
    index = torch.tensor(list(heads), device=reference.device)
    return trained, reference.index_select(-3, index)


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def run_matched(
    trained: nn.Module,
    reference: nn.Module,
    inputs: Any,
    reference_inputs: Any = None,
    *,
    pairs: Mapping[str, str] | None = None,
    heads: Heads = None,
) -> Matched:
    """Run ``reference`` (without a graph) on ``reference_inputs`` (``inputs`` if None) and
    ``trained`` on ``inputs`` (a tensor or a tuple of positional arguments), and pair their
    attention weights: ``pairs`` maps a trained module's name to a reference module's name
    (default :func:`uniform_pairs`); ``heads`` as :func:`match_heads`."""
    if pairs is None:
        pairs = uniform_pairs(trained, reference)
    if not isinstance(pairs, Mapping) or not pairs:
        raise TypeError(f"pairs must be a non-empty mapping of module names, got {pairs!r}")
    for side, model, names in (
        ("trained", trained, pairs.keys()),
        ("reference", reference, pairs.values()),
    ):
        known = attention_modules(model)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(
                f"pairs names {unknown} that are not attention modules of the {side} model; "
                f"it has {list(known)}"
            )
    with torch.no_grad(), capture_weights(reference) as theirs:
        _call(reference, inputs if reference_inputs is None else reference_inputs)
    with capture_weights(trained) as mine:
        output = _call(trained, inputs)
    matched = []
    for name, ref_name in pairs.items():
        a, b = mine.get(name, []), theirs.get(ref_name, [])
        if len(a) != len(b) or not a:
            raise ValueError(
                f"{name!r} was called {len(a)} times and {ref_name!r} {len(b)} times; paired "
                "modules must be called equally often (at least once)"
            )
        matched += [match_heads(x, y, heads) for x, y in zip(a, b, strict=True)]
    return Matched(output, matched)
