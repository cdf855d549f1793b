"""Attention distillation (Galassi VI-A): a student trained to reproduce a teacher's attention,
the teacher's weights serving as soft gold.

Per matched (layer, head), the loss is KL(teacher ‖ student) = Σ_j t_ij (log t_ij − log s_ij),
averaged over query rows (as MiniLM, Wang et al. 2020, on the last layer), or the mean
squared error between the maps (as TinyBERT, Jiao et al. 2020, over uniformly mapped layers).
It is added to the student's task loss. Rows where the teacher has no mass (fully masked) do
not count.

:func:`attention_distillation_loss` takes the weights; :func:`distill` runs teacher and student
on the same inputs, pairs their attention modules (:mod:`attnkit.training.weight_matching`) and
returns the student's output with the loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import checks
from attnkit.evaluation import supervised_attention_loss
from attnkit.training.weight_matching import Matched, run_matched

__all__ = ["attention_distillation_loss", "distill"]


def attention_distillation_loss(student: Tensor, teacher: Tensor, *, kind: str = "kl") -> Tensor:
    """The distance from the student's weights to the teacher's, (…, M, N) each, rows on the
    simplex; the teacher's are detached (soft gold). ``kind``: ``"kl"`` — KL(teacher ‖ student)
    per row; ``"mse"`` — mean squared error per row; averaged over the rows the teacher fills."""
    student = checks.floating(student, "student", "(…, M, N)", min_dim=2)
    teacher = checks.floating(teacher, "teacher", "(…, M, N)", min_dim=2)
    if kind not in ("kl", "mse"):
        raise ValueError(f"kind must be 'kl' or 'mse', got {kind!r}")
    return supervised_attention_loss(student, teacher.detach().to(student.dtype), kind=kind)


def distill(
    student: nn.Module,
    teacher: nn.Module,
    inputs: Any,
    *,
    pairs: Mapping[str, str] | None = None,
    heads: str | Sequence[int] | None = None,
    kind: str = "kl",
) -> tuple[Any, Tensor]:
    """Run ``teacher`` (without a graph) and ``student`` on ``inputs`` (a tensor or a tuple of
    positional arguments) and return ``(student_output, loss)``: the mean over matched
    attention calls of :func:`attention_distillation_loss`.

    Args:
        pairs: student attention module name → teacher's (names as
            :func:`attnkit.training.graph_capture.attention_modules`); default: TinyBERT's
            uniform mapping (:func:`attnkit.training.weight_matching.uniform_pairs`).
        heads: None (same heads), ``"mean"`` or a teacher head per student head (see
            :func:`attnkit.training.weight_matching.match_heads`).
        kind: ``"kl"`` or ``"mse"``.
    """
    matched: Matched = run_matched(student, teacher, inputs, pairs=pairs, heads=heads)
    losses = [attention_distillation_loss(s, t, kind=kind) for s, t in matched.pairs]
    return matched.output, torch.stack(losses).mean()
