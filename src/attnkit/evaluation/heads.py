"""Attention heads: which matter, and how each attends (Michel et al. 2019, "Are sixteen heads
really better than one?"; Clark et al. 2019, "What does BERT look at?"; Galassi VI).

- :func:`head_gates`: a gate ξ_h on each head's output of every
  :class:`attnkit.MultiHeadAttention` (Michel et al. eq. 1: MHAtt = Σ_h ξ_h Att_h W^O_h).
- :func:`head_importance_by_masking`: the metric lost when one head is masked (ξ_h = 0).
- :func:`head_importance_by_gradient`: Michel et al.'s proxy I_h = |∂L/∂ξ_h| at ξ = 1 (eq. 2).
- :func:`pruning_curve`: heads removed one by one in increasing importance, the metric after each.
- :func:`head_statistics`: per-head entropy, mean attention distance and maximum weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import checks
from attnkit.multihead import MultiHeadAttention

__all__ = [
    "PruningCurve",
    "head_gates",
    "head_importance_by_gradient",
    "head_importance_by_masking",
    "head_statistics",
    "heads_of",
    "pruning_curve",
]


def heads_of(model: nn.Module) -> dict[str, int]:
    """Name -> number of heads of every :class:`attnkit.MultiHeadAttention` in ``model``."""
    return {
        name: m.num_heads for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)
    }


@contextmanager
def head_gates(model: nn.Module, gates: Mapping[str, Tensor]) -> Iterator[nn.Module]:
    """Inside the block, head h of the multi-head attention called ``name`` contributes
    ``gates[name][h]`` times its output (0: masked). ``gates[name]`` is (H,); layers not named
    keep all heads. Gates may require grad (see :func:`head_importance_by_gradient`)."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    handles = []
    for name, gate in gates.items():
        if name not in layers:
            raise ValueError(
                f"gates: {name!r} is not a MultiHeadAttention of the model; it has {list(layers)}"
            )
        mha = layers[name]
        if not isinstance(gate, Tensor) or gate.shape != (mha.num_heads,):
            raise ValueError(
                f"gates[{name!r}] must be a Tensor of shape ({mha.num_heads},), got "
                f"{tuple(gate.shape) if isinstance(gate, Tensor) else type(gate).__name__}"
            )

        def scale(module: nn.Module, args: tuple, *, gate=gate, mha=mha) -> tuple:
            # the heads' outputs, concatenated head after head, enter W^O here
            (context,) = args
            split = context.unflatten(-1, (mha.num_heads, mha.head_dim))
            return ((split * gate.to(context).unsqueeze(-1)).flatten(-2),)

        handles.append(mha.out_proj.register_forward_pre_hook(scale))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _ones(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    heads = heads_of(model)
    if not heads:
        raise ValueError("the model has no attnkit.MultiHeadAttention")
    return {name: torch.ones(h, dtype=dtype) for name, h in heads.items()}


@torch.no_grad()
def head_importance_by_masking(model: nn.Module, metric: Callable[[], float]) -> dict[str, Tensor]:
    """``metric()`` (higher is better, e.g. accuracy on a held-out set) with all heads minus
    ``metric()`` with head h of layer ``name`` masked: name -> (H,). Positive: the head helps."""
    return masking_drops(_ones(model), lambda gates: head_gates(model, gates), metric)


def masking_drops(
    ones: Mapping[str, Tensor],
    gated: Callable[[Mapping[str, Tensor]], Any],
    metric: Callable[[], float],
) -> dict[str, Tensor]:
    """``metric()`` minus ``metric()`` with one head gated off at a time: for every layer name of
    ``ones`` (its (H,) gates of 1) -> (H,) float64. ``gated(gates)`` is the context manager that
    applies gates to the model (attnkit layers here, Hugging Face layers in ``bert_heads``)."""
    base = float(metric())
    out = {}
    for name, gate in ones.items():
        drops = []
        for h in range(gate.numel()):
            g = gate.clone()
            g[h] = 0
            with gated({name: g}):
                drops.append(base - float(metric()))
        out[name] = torch.tensor(drops, dtype=torch.float64)
    return out


def head_importance_by_gradient(model: nn.Module, loss: Callable[[], Tensor]) -> dict[str, Tensor]:
    """Michel et al. (2019, eq. 2): I_h = |∂L/∂ξ_h| at ξ = 1, for a scalar ``loss()`` (their
    expectation over examples: pass the mean loss over a set). name -> (H,)."""
    gates = {n: g.double().requires_grad_(True) for n, g in _ones(model).items()}
    with torch.enable_grad(), head_gates(model, gates):
        value = loss()
        if not isinstance(value, Tensor) or value.dim() != 0:
            raise ValueError("loss() must return a scalar Tensor")
        grads = torch.autograd.grad(value, list(gates.values()), allow_unused=True)
    return {
        n: (torch.zeros_like(g) if d is None else d.abs()).detach()
        for (n, g), d in zip(gates.items(), grads, strict=True)
    }


@dataclass(frozen=True)
class PruningCurve:
    """``pruned[i]`` heads removed (``order[:pruned[i]]``, (layer, head) pairs) give
    ``metric[i]``; ``fraction[i]`` = pruned[i] / all heads (Michel et al. Fig. 3)."""

    pruned: list[int]
    fraction: list[float]
    metric: list[float]
    order: list[tuple[str, int]]


@torch.no_grad()
def pruning_curve(
    model: nn.Module,
    metric: Callable[[], float],
    importance: Mapping[str, Tensor],
    *,
    keep_last: bool = True,
) -> PruningCurve:
    """Mask heads one at a time from the least important (``importance``: name -> (H,), e.g.
    from :func:`head_importance_by_masking`) and measure ``metric()`` after each, as Michel et al.
    (2019, Sec. 4). With ``keep_last`` the last head is never removed."""
    gates = _ones(model)
    for name, scores in importance.items():
        if name not in gates or scores.shape != gates[name].shape:
            raise ValueError(
                f"importance[{name!r}] must be ({gates.get(name, torch.ones(0)).numel()},) for a "
                f"multi-head layer of the model; layers: {list(gates)}"
            )
    if set(importance) != set(gates):
        raise ValueError(f"importance must cover every multi-head layer: {sorted(gates)}")
    ranked = sorted(
        ((float(importance[n][h]), n, h) for n in gates for h in range(gates[n].numel())),
        key=lambda t: t[0],
    )
    order = [(n, h) for _, n, h in ranked]
    total = len(order)
    pruned, metrics = [0], [float(metric())]
    for i, (name, h) in enumerate(order[: total - 1 if keep_last else total], start=1):
        gates[name][h] = 0
        with head_gates(model, gates):
            metrics.append(float(metric()))
        pruned.append(i)
    return PruningCurve(pruned, [p / total for p in pruned], metrics, order)


def head_statistics(weights: Tensor, mask: Tensor | None = None) -> dict[str, Tensor]:
    """Per-head summaries of self-attention weights (B, H, M, N), averaged over examples and
    query rows that may attend some key:

    - ``entropy``: −Σ_j a_ij log a_ij (nats);
    - ``distance``: Σ_j a_ij |i − j|, the mean attention distance (Clark et al. 2019; Vig &
      Belinkov 2019), query i and key j by position;
    - ``max_weight``: max_j a_ij.

    ``mask`` broadcastable to the weights (True = may attend) selects the rows that count.
    Returns name -> (H,) float64.
    """
    if not isinstance(weights, Tensor) or weights.dim() != 4:
        raise ValueError(
            "weights must be (B, H, M, N), got "
            f"{tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__}"
        )
    checks.floating(weights, "weights", "(B, H, M, N)")
    checks.nonnegative(weights, "weights")
    if mask is not None:
        checks.boolean_mask(mask, "mask", tuple(weights.shape))
    w = weights.double()
    m, n = w.shape[-2:]
    rows = w.sum(-1) > 0
    if mask is not None:
        rows = rows & mask.expand_as(w).any(-1)
    logs = torch.where(w > 0, w.clamp_min(1e-300).log(), torch.zeros_like(w))
    distance = (torch.arange(m).view(m, 1) - torch.arange(n).view(1, n)).abs().double()
    per_row = {
        "entropy": -(w * logs).sum(-1),
        "distance": (w * distance).sum(-1),
        "max_weight": w.max(-1).values,
    }
    r = rows.double()
    count = r.sum((0, 2)).clamp_min(1)
    return {k: (v * r).sum((0, 2)) / count for k, v in per_row.items()}
