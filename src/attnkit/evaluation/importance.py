"""Importance of each input item for a model's output: the references attention weights are
compared with in the "is attention explanation?" debate (Jain & Wallace 2019, Sec. 3; Serrano &
Smith 2019; Brauwers 4.2.2; Galassi VI).

Every measure takes the same thing: a function ``f(inputs, keep) -> (B,)`` giving one scalar per
example (e.g. the logit or log-probability of the predicted class), ``inputs`` (B, N, d) the
embedded items it attends over, and ``keep`` (B, N) boolean, True for items that are present
(False: padding, or an item left out). Any model built from attnkit parts is used this way by
starting its forward at the embeddings and passing ``keep`` as the attention mask (see
:func:`attnkit.masks.from_lengths`). Each measure returns (B, N) with 0 at items not kept.

``f`` must treat examples independently (no batch statistics): the gradient of the summed
output is then each example's own gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = [
    "Forward",
    "gradient",
    "input_x_gradient",
    "integrated_gradients",
    "leave_one_out",
]

Forward = Callable[[Tensor, Tensor], Tensor]
"""``f(inputs (B, N, d), keep (B, N) bool) -> (B,)``: one scalar output per example."""


def check_inputs(inputs: Tensor, keep: Tensor | None) -> Tensor:
    """Validate ``inputs`` (B, N, d) floating and ``keep`` (B, N) boolean; return ``keep``
    (all True when None)."""
    if not isinstance(inputs, Tensor):
        raise TypeError(f"inputs must be a Tensor, got {type(inputs).__name__}")
    if inputs.dim() != 3:
        raise ValueError(f"inputs must be (B, N, d), got shape {tuple(inputs.shape)}")
    if not inputs.is_floating_point():
        raise TypeError(f"inputs must be floating point (embeddings), got {inputs.dtype}")
    if keep is None:
        return torch.ones(inputs.shape[:2], dtype=torch.bool, device=inputs.device)
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        raise TypeError(f"keep must be a boolean Tensor (B, N), got {getattr(keep, 'dtype', keep)}")
    if keep.shape != inputs.shape[:2]:
        raise ValueError(
            f"keep must be (B, N) = {tuple(inputs.shape[:2])} like inputs, got {tuple(keep.shape)}"
        )
    return keep


def evaluate(f: Forward, inputs: Tensor, keep: Tensor) -> Tensor:
    """``f(inputs, keep)``, checked to be one scalar per example."""
    out = f(inputs, keep)
    if not isinstance(out, Tensor) or out.shape != inputs.shape[:1]:
        raise ValueError(
            "f(inputs, keep) must return one scalar per example, shape "
            f"({inputs.shape[0]},), got {tuple(out.shape) if isinstance(out, Tensor) else out!r}"
        )
    return out


def _grad(f: Forward, inputs: Tensor, keep: Tensor) -> Tensor:
    x = inputs.detach().requires_grad_(True)
    with torch.enable_grad():
        out = evaluate(f, x, keep)
        (g,) = torch.autograd.grad(out.sum(), x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def gradient(f: Forward, inputs: Tensor, keep: Tensor | None = None) -> Tensor:
    """Gradient importance (saliency; Simonyan et al. 2014, as used by Jain & Wallace 2019):
    ``‖∂f/∂x_i‖₂``, the norm over the features of item i. (B, N), ≥ 0."""
    keep = check_inputs(inputs, keep)
    return _grad(f, inputs, keep).norm(dim=-1) * keep


def input_x_gradient(f: Forward, inputs: Tensor, keep: Tensor | None = None) -> Tensor:
    """Input × gradient (Shrikumar et al. 2016): ``Σ_d x_id ∂f/∂x_id``, signed. For one-hot
    inputs followed by an embedding this is Jain & Wallace's gradient of the output with respect
    to the token. (B, N)."""
    keep = check_inputs(inputs, keep)
    return (inputs.detach() * _grad(f, inputs, keep)).sum(-1) * keep


def integrated_gradients(
    f: Forward,
    inputs: Tensor,
    keep: Tensor | None = None,
    *,
    baseline: Tensor | None = None,
    steps: int = 32,
) -> Tensor:
    """Integrated gradients (Sundararajan et al. 2017, eq. 1), summed over each item's features:
    ``IG_i = Σ_d (x_id − x'_id) ∫₀¹ ∂f(x' + α(x − x'))/∂x_id dα``, the integral by the trapezoid
    rule with ``steps`` intervals.

    Completeness (their Proposition 1): ``Σ_i IG_i = f(x) − f(x')`` up to the quadrature error,
    which vanishes as ``steps`` grows (and is exact for f quadratic in x).

    Args:
        baseline: x' (B, N, d) or broadcastable; zeros when None.
        steps: number of trapezoid intervals (≥ 1).
    """
    keep = check_inputs(inputs, keep)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int ≥ 1, got {steps!r}")
    x = inputs.detach()
    base = torch.zeros_like(x) if baseline is None else baseline.detach().to(x).expand_as(x)
    total = torch.zeros_like(x)
    for s in range(steps + 1):
        alpha = s / steps
        weight = 0.5 if s in (0, steps) else 1.0
        total = total + weight * _grad(f, base + alpha * (x - base), keep)
    return ((x - base) * total / steps).sum(-1) * keep


@torch.no_grad()
def leave_one_out(f: Forward, inputs: Tensor, keep: Tensor | None = None) -> Tensor:
    """Leave-one-out importance (Jain & Wallace 2019, Sec. 3): ``f(x) − f(x without item i)``,
    the item removed by turning its ``keep`` entry off (for softmax attention: its weight set
    to 0 and the rest renormalised). One forward pass per position. (B, N), signed."""
    keep = check_inputs(inputs, keep)
    full = evaluate(f, inputs, keep)
    out = torch.zeros(keep.shape, dtype=full.dtype, device=full.device)
    for i in range(keep.shape[1]):
        if not bool(keep[:, i].any()):
            continue
        without = keep.clone()
        without[:, i] = False
        out[:, i] = full - evaluate(f, inputs, without)
    return out * keep
