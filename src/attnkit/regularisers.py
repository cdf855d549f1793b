"""Regularisers on attention weights and heads (Galassi IV-D1).

Multi-head disagreement (Li et al. 2018, "Multi-Head Attention with Disagreement
Regularization"): three terms D that grow as the H heads of a multi-head attention differ,
added to the training objective as J = L + λ·D (so a loss to minimise takes −λ·D):

- :func:`subspace_disagreement` — on the heads' projected values V^h = V W_h^V:
  D = −1/H² Σ_i Σ_j cos(V^i, V^j);
- :func:`position_disagreement` — on the heads' weights A^h (the attended positions):
  D = −1/H² Σ_i Σ_j |A^i ⊙ A^j|, the sum of the element-wise products;
- :func:`output_disagreement` — on the heads' outputs O^h (their context vectors):
  D = −1/H² Σ_i Σ_j cos(O^i, O^j).

The cosine of two sequences of vectors is taken position by position and averaged over the
(unmasked) positions, and |A^i ⊙ A^j| is averaged over the query rows (one row of normalised
weights gives at most 1), so the terms keep their range whatever the lengths. The cosine terms
lie in [−1, 0]: identical heads give −1, and two heads pointing in opposite directions give 0.
The position term is −1 for identical one-hot heads and −1/H for one-hot heads that attend
distinct keys. Each returns one value per item (B,), like the coverage penalties
(:func:`attnkit.memory.doubly_stochastic_penalty`, :func:`attnkit.memory.coverage_loss`,
re-exported here).

:func:`head_parts` runs an :class:`attnkit.MultiHeadAttention` once and returns its output
together with the per-head values, weights and outputs these terms take.

:func:`auxiliary_loss` collects the penalties that parts put on their own parameters (a module
with an ``auxiliary_loss()`` method, e.g. adaptive attention span's L1 penalty on the spans);
``attnkit run`` adds it to every task's loss.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnkit.memory.coverage import coverage_loss, doubly_stochastic_penalty
from attnkit.multihead import MultiHeadAttention

__all__ = [
    "HeadParts",
    "auxiliary_loss",
    "coverage_loss",
    "doubly_stochastic_penalty",
    "head_parts",
    "output_disagreement",
    "position_disagreement",
    "subspace_disagreement",
]


def auxiliary_loss(model: nn.Module) -> Tensor | None:
    """The sum of ``m.auxiliary_loss()`` over the submodules of ``model`` that define it (the
    penalties of their own papers, already weighted), or None when none does."""
    terms = [
        m.auxiliary_loss() for m in model.modules() if callable(getattr(m, "auxiliary_loss", None))
    ]
    if not terms:
        return None
    return torch.stack([torch.as_tensor(t).reshape(()) for t in terms]).sum()


def _heads_tensor(x: object, name: str, shape: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating tensor {shape}, got {x!r}")
    if x.dim() < 4:
        raise ValueError(f"{name} must be {shape}, got shape {tuple(x.shape)}")
    return x


def _positions_mask(mask: Tensor | None, x: Tensor, name: str) -> Tensor:
    """(B, 1, L, 1) float weights of the positions of ``x`` (B, H, L, d) to average over."""
    b, _, length, _ = x.shape
    if mask is None:
        return torch.ones(b, 1, length, 1, dtype=x.dtype, device=x.device)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a boolean tensor (B, {name}), got {mask!r}")
    if mask.numel() != b * length:
        raise ValueError(
            f"mask must hold one entry per position, (B, {name}) = ({b}, {length}) (or "
            f"(B, 1, {name}) from masks.from_lengths), got shape {tuple(mask.shape)}"
        )
    return mask.reshape(b, 1, length, 1).to(x.dtype)


def _cosine_disagreement(x: Tensor, mask: Tensor | None, name: str) -> Tensor:
    """−1/H² Σ_i Σ_j mean over positions of cos(x^i_l, x^j_l), for x (B, H, L, d)."""
    keep = _positions_mask(mask, x, name)
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny ** 0.5)
    # Σ_i Σ_j cos(x^i, x^j) = ‖Σ_h unit^h‖² at each position.
    together = (unit.sum(dim=1, keepdim=True) ** 2).sum(dim=-1, keepdim=True)  # (B, 1, L, 1)
    count = keep.sum(dim=(1, 2, 3)).clamp_min(1)
    h = x.shape[1]
    return -(together * keep).sum(dim=(1, 2, 3)) / count / (h * h)


def subspace_disagreement(values: Tensor, mask: Tensor | None = None) -> Tensor:
    """Li et al.'s disagreement on subspaces: −1/H² Σ_i Σ_j cos(V^i, V^j), per item (B,).

    Args:
        values: the heads' projected values V^h = V W_h^V, (B, H, N, d).
        mask: (B, N) or (B, 1, N), True = a real position (padding is left out of the mean).
    """
    values = _heads_tensor(values, "values", "(B, H, N, d)")
    return _cosine_disagreement(values, mask, "N")


def output_disagreement(outputs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Li et al.'s disagreement on outputs: −1/H² Σ_i Σ_j cos(O^i, O^j), per item (B,).

    Args:
        outputs: the heads' outputs (context vectors) O^h, (B, H, M, d).
        mask: (B, M) or (B, 1, M), True = a real query position.
    """
    outputs = _heads_tensor(outputs, "outputs", "(B, H, M, d)")
    return _cosine_disagreement(outputs, mask, "M")


def position_disagreement(weights: Tensor, mask: Tensor | None = None) -> Tensor:
    """Li et al.'s disagreement on positions: −1/H² Σ_i Σ_j |A^i ⊙ A^j|, per item (B,).

    |A^i ⊙ A^j| = Σ_{m,n} |A^i_mn A^j_mn|, averaged over the query rows m.

    Args:
        weights: the heads' weights A^h, (B, H, M, N).
        mask: (B, M) or (B, 1, M), True = a real query row (padded rows are left out).
    """
    weights = _heads_tensor(weights, "weights", "(B, H, M, N)")
    keep = _positions_mask(mask, weights[..., :1], "M")  # (B, 1, M, 1)
    a = weights.abs()
    # Σ_i Σ_j Σ_n A^i_mn A^j_mn = Σ_n (Σ_h A^h_mn)² for each row m.
    together = (a.sum(dim=1, keepdim=True) ** 2).sum(dim=-1, keepdim=True)  # (B, 1, M, 1)
    count = keep.sum(dim=(1, 2, 3)).clamp_min(1)
    h = weights.shape[1]
    return -(together * keep).sum(dim=(1, 2, 3)) / count / (h * h)


class HeadParts(NamedTuple):
    """One call of a multi-head attention, head by head.

    output: what the module returned (its context (B, M, E) and weights);
    values: each head's projected values V^h (B, H, N, d);
    weights: each head's weights A^h (B, H, M, N);
    outputs: each head's output O^h, the context it contributes to W^O (B, H, M, d).
    """

    output: object
    values: Tensor
    weights: Tensor
    outputs: Tensor


def head_parts(
    mha: MultiHeadAttention,
    query: Tensor,
    key: Tensor | None = None,
    value: Tensor | None = None,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
) -> HeadParts:
    """Run ``mha`` once (with weights) and collect the per-head parts the disagreement terms
    take, as they enter and leave its per-head attention and its output projection W^O."""
    if not isinstance(mha, MultiHeadAttention):
        raise TypeError(f"mha must be an attnkit.MultiHeadAttention, got {type(mha).__name__}")
    if query.dim() < 3:
        raise ValueError(f"query must be batched (B, M, E), got shape {tuple(query.shape)}")
    seen: dict[str, Tensor] = {}

    def take_values(module: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["values"] = args[2] if len(args) > 2 else kwargs["v"]

    def take_outputs(module: nn.Module, args: tuple) -> None:
        (context,) = args
        split = context.unflatten(-1, (mha.num_heads, mha.head_dim))  # (B, M, H, d)
        seen["outputs"] = split.transpose(-2, -3)

    handles = [
        mha.attention.register_forward_pre_hook(take_values, with_kwargs=True),
        mha.out_proj.register_forward_pre_hook(take_outputs),
    ]
    try:
        out = mha(query, key, value, mask=mask, bias=bias, need_weights=True)
    finally:
        for handle in handles:
            handle.remove()
    return HeadParts(out, seen["values"], out.weights, seen["outputs"])
