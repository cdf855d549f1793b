"""Outer product attention, OPA (Le, Tran and Venkatesh, "Self-Attentive Associative Memory",
ICML 2020; Soydaner 5.1): the extension of dot-product attention at the heart of the SAM
operator. Where dot-product attention gives each key one scalar weight and returns a vector,
OPA binds each value to a feature-wise gate and returns a matrix (a relational memory):

    A⊗(q, K, V) = Σ_i F(q ⊙ k_i) ⊗ G(v_i) ∈ ℝ^{d_qk × d_v},

with ⊙ the element-wise product, ⊗ the outer product and F, G element-wise functions; SAM uses
F = tanh (in place of the softmax: the gates are signed and not normalised) and G = identity.
With F = G = identity, summing the result over its first axis gives Σ_i (q·k_i) v_i, unnormalised
dot-product attention. OPA's gates are not distributions, so it is a function here rather than
a registered mechanism (whose weights are distributions over keys).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnkit import masks

__all__ = ["outer_product_attention"]


def outer_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    activation: Callable[[Tensor], Tensor] = torch.tanh,
) -> Tensor:
    """A⊗(q_m, K, V) = Σ_i F(q_m ⊙ k_i) ⊗ v_i for every query m.

    Args:
        q: (…, M, d_qk); k: (…, N, d_qk); v: (…, N, d_v).
        mask: boolean, True = key i is used for query m, broadcastable to (…, M, N).
        activation: F, element-wise (default tanh, as SAM).

    Returns:
        (…, M, d_qk, d_v), one memory matrix per query.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() < 2 or not x.is_floating_point():
            raise ValueError(
                f"outer_product_attention: {name} must be a floating tensor (…, L, d), got "
                f"{getattr(x, 'shape', type(x).__name__)}"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q has {q.shape[-1]} features but k has {k.shape[-1]}; need d_qk")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} need the same N")
    gates = activation(q.unsqueeze(-2) * k.unsqueeze(-3))  # (…, M, N, d_qk)
    if mask is not None:
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        masks.check(mask, torch.Size((*lead, q.shape[-2], k.shape[-2])))
        gates = torch.where(mask.unsqueeze(-1), gates, 0.0)
        v = torch.where(mask.any(-2).unsqueeze(-1), v, 0.0)  # unused keys: nothing, not NaN
    return torch.einsum("...mnd,...ne->...mde", gates, v)
