"""Attention rollout (Abnar & Zuidema 2020): how much each input token reaches each position of
a stack of self-attention layers, following the weights through the residual connections.

Each layer's weights A_l (N × N, averaged over heads) become Ã_l = r·I + (1 − r)·A_l with
r = 0.5 for the residual connection, rows renormalised to sum to 1; the rollout to layer L is the
product Ã_L Ã_{L−1} ⋯ Ã_1: row i says how the output at position i is made of the input tokens.
:func:`attnkit.evaluation.flow.attention_flow` reads the same graph as a flow network.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["attention_rollout", "residual_weights"]


def residual_weights(
    weights: Sequence[Tensor], *, residual: float = 0.5, head_dim: int | None = -3
) -> list[Tensor]:
    """Each layer's Ã_l = r·I + (1 − r)·mean_h A_l^h with rows renormalised (Abnar & Zuidema
    2020, eq. for the raw attention with residual): the matrices rollout and flow multiply.

    Args:
        weights: one self-attention weight tensor per layer, the layer nearest the input first,
            each (B, …, H, N, N) (as recorded at the ``weights`` point of
            :mod:`attnkit.hooks`), or (B, …, N, N) with ``head_dim=None``.
        residual: r in [0, 1], the share of the identity (the residual connection).
        head_dim: the dim of the heads, averaged over; None when there is none.

    Returns:
        One (B, …, N, N) tensor per layer. A row with no weight at all (a padding query) keeps
        only its residual: it is a row of the identity.
    """
    if isinstance(residual, bool) or not isinstance(residual, (int, float)):
        raise TypeError(f"residual must be a number in [0, 1], got {residual!r}")
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1], got {residual}")
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)):
        raise TypeError(f"head_dim must be an int or None, got {head_dim!r}")
    if isinstance(weights, Tensor) or not isinstance(weights, Sequence) or not weights:
        raise TypeError(
            "weights must be a non-empty sequence of tensors, one per layer (a list), got "
            f"{type(weights).__name__}"
        )
    out = []
    for i, a in enumerate(weights):
        if not isinstance(a, Tensor) or not a.is_floating_point():
            raise TypeError(f"weights[{i}] must be a floating-point tensor, got {a!r:.60}")
        least = 2 if head_dim is None else 3
        if a.dim() < least or a.shape[-1] != a.shape[-2]:
            want = "(…, N, N)" if head_dim is None else "(…, H, N, N)"
            raise ValueError(
                f"weights[{i}] has shape {tuple(a.shape)}; self-attention weights {want} are "
                "needed (queries and keys the same tokens)"
            )
        if head_dim is not None:
            if head_dim in (-1, -2, a.dim() - 1, a.dim() - 2) or not -a.dim() <= head_dim < a.dim():
                raise ValueError(
                    f"head_dim={head_dim} is not a dim of weights[{i}] of shape "
                    f"{tuple(a.shape)} before its last two (N, N)"
                )
            a = a.mean(head_dim)
        if out and a.shape != out[0].shape:
            raise ValueError(
                f"weights[{i}] gives shape {tuple(a.shape)} but weights[0] gives "
                f"{tuple(out[0].shape)}; every layer must attend over the same tokens"
            )
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        aug = residual * eye + (1.0 - residual) * a
        total = aug.sum(-1, keepdim=True)
        aug = torch.where(total > 0, aug / total.clamp_min(torch.finfo(a.dtype).tiny), eye)
        out.append(aug)
    return out


def attention_rollout(
    weights: Sequence[Tensor],
    *,
    residual: float = 0.5,
    head_dim: int | None = -3,
    all_layers: bool = False,
) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020): R_1 = Ã_1, R_l = Ã_l R_{l−1}.

    Args:
        weights, residual, head_dim: as :func:`residual_weights`.
        all_layers: return R_l for every layer, stacked on a new first dim.

    Returns:
        R_L (B, …, N, N), row i the share of each input token in position i's output at the
        last layer (rows sum to 1); with ``all_layers`` (L, B, …, N, N).

    Example::

        names = [f"layers.{i}.self_attention.module.weights" for i in range(len(model.layers))]
        with ak.hooks.record(model, names=names) as cache:
            model(x)
        rollout = attention_rollout([cache[n] for n in names])
    """
    if not isinstance(all_layers, bool):
        raise TypeError(f"all_layers must be a bool, got {all_layers!r}")
    layers = residual_weights(weights, residual=residual, head_dim=head_dim)
    joint = [layers[0]]
    for a in layers[1:]:
        joint.append(a @ joint[-1])
    return torch.stack(joint) if all_layers else joint[-1]
