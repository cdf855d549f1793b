"""Attention alignment between a source-domain and a target-domain model (Galassi VI-D;
Kang et al. 2018, "Deep Adversarial Attention Alignment for Unsupervised Domain Adaptation").

A model trained on the source domain knows where to look; a model for the target domain is
trained so that, on paired inputs — the same content in both domains (Kang et al. pair each
source image with its translation into the target style) — its attention matches the source
model's. With few or no target labels, the attention pattern is what transfers. Kang et al.'s
distance is the L2 distance between L2-normalised attention maps, ‖a_t/‖a_t‖ − a_s/‖a_s‖‖
(after Zagoruyko & Komodakis' attention transfer); here per query row, averaged over the rows.

:func:`attention_alignment_loss` takes the weights; :func:`align_attention` runs both models on
their paired inputs and returns the target model's output with the loss (module and head
pairing as :mod:`attnkit.training.weight_matching`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import checks
from attnkit.evaluation import supervised_attention_loss
from attnkit.training.weight_matching import run_matched

__all__ = ["align_attention", "attention_alignment_loss"]


def attention_alignment_loss(target: Tensor, source: Tensor, *, kind: str = "l2") -> Tensor:
    """Distance between the target model's weights and the source model's (detached), both
    (…, M, N). ``kind``: ``"l2"`` — ‖a_t/‖a_t‖₂ − a_s/‖a_s‖₂‖₂ per row (Kang et al.), averaged
    over rows where the source has mass; ``"kl"`` — KL(source ‖ target) per row."""
    target = checks.floating(target, "target", "(…, M, N)", min_dim=2)
    source = checks.floating(source, "source", "(…, M, N)", min_dim=2)
    checks.same_shape(("target", target), ("source", source))
    source = source.detach().to(target.dtype)
    if kind == "kl":
        return supervised_attention_loss(target, source)
    if kind != "l2":
        raise ValueError(f"kind must be 'l2' or 'kl', got {kind!r}")
    tiny = torch.finfo(target.dtype).tiny ** 0.5
    s_norm = source.norm(dim=-1, keepdim=True)
    t_unit = target / target.norm(dim=-1, keepdim=True).clamp_min(tiny)
    per_row = (t_unit - source / s_norm.clamp_min(tiny)).norm(dim=-1)
    rows = s_norm.squeeze(-1) > 0
    if not bool(rows.any()):
        return target.sum() * 0
    return per_row[rows].mean()


def align_attention(
    target_model: nn.Module,
    source_model: nn.Module,
    target_inputs: Any,
    source_inputs: Any,
    *,
    pairs: Mapping[str, str] | None = None,
    heads: str | Sequence[int] | None = None,
    kind: str = "l2",
) -> tuple[Any, Tensor]:
    """Run ``source_model`` (without a graph) on ``source_inputs`` and ``target_model`` on the
    paired ``target_inputs`` (tensors, or tuples of positional arguments; item b of one is the
    counterpart of item b of the other, with the same M and N), and return
    ``(target_output, loss)``: the mean over matched attention calls of
    :func:`attention_alignment_loss`. ``pairs`` (target module name → source's) and ``heads`` as
    :func:`attnkit.training.weight_matching.run_matched`."""
    matched = run_matched(
        target_model, source_model, target_inputs, source_inputs, pairs=pairs, heads=heads
    )
    losses = [attention_alignment_loss(t, s, kind=kind) for t, s in matched.pairs]
    return matched.output, torch.stack(losses).mean()
