"""Merging by a gate instead of by the sum alone (Galassi II-B, [93]: Shen et al.'s DiSAN).

Galassi's general model (Fig. 4) weights the values, z_i = a_i v_i (eq. 8), and merges them into
the context vector, "commonly" by summation, c = Σ_i z_i (eq. 9); "however, alternatives have
been proposed, including gating functions [93]". In [93] (DiSAN, the fusion gate) the output for
a query is a feature-wise gated mixture of the attention result s = Σ_i z_i and the query's own
representation h:

    F = σ(W⁽ᶠ¹⁾ s + W⁽ᶠ²⁾ h + b⁽ᶠ⁾) ∈ (0, 1)^d,
    u = F ⊙ h + (1 − F) ⊙ s,

so each feature of the output is taken from the attended values or kept from the query as the
gate decides, instead of always being the sum. :class:`GatedMerge` puts this gate around any
attention module (any score and alignment, single- or multi-dimensional, or a
:class:`attnkit.MultiHeadAttention`).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, inputs, masks
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive

__all__ = ["GatedMerge", "GatedMergeOutput"]


class GatedMergeOutput(NamedTuple):
    """output u (B, …, M, d); context s = Σ_i a_i v_i (B, …, M, d); gate F (B, …, M, d);
    weights a (B, …, M, N), or (B, …, M, N, d) for multi-dimensional attention."""

    output: Tensor
    context: Tensor
    gate: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("gated_merge")
class GatedMerge(nn.Module):
    """The fusion gate of [93] around an attention module: u = F ⊙ h + (1 − F) ⊙ s with
    s = attention(q, k, v).context and F = σ(W⁽ᶠ¹⁾ s + W⁽ᶠ²⁾ h + b⁽ᶠ⁾).

    Args:
        d: size of the attention's context and of h (d_v).
        attention: any module called as ``attention(q, k, v, mask=, need_weights=True)`` that
            returns an :class:`attnkit.AttentionOutput` with contexts of size d, e.g.
            ``Attention(score, align)`` or a ``MultiHeadAttention``; default
            ``Attention("scaled_dot", "softmax")``.

    ``forward(q, k, v=None, *, h=None, mask=None)``: h (B, …, M, d) is what the gate keeps
    (default: the queries themselves, as in DiSAN's token-to-token attention, which then need
    d_q = d); ``mask`` is the attention's (True = may attend).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(
        self,
        d: int,
        *,
        attention: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d = arguments.positive_int(d, "d")
        if attention is None:
            attention = Attention("scaled_dot", "softmax")
        if not isinstance(attention, nn.Module):
            raise TypeError(
                f"attention must be an attention module (e.g. attnkit.Attention), got "
                f"{type(attention).__name__}"
            )
        self.attention = attention
        kw = {"device": device, "dtype": dtype}
        self.fuse_s = nn.Linear(d, d, **kw)  # W^(f1), b^(f)
        self.fuse_h = nn.Linear(d, d, bias=False, **kw)  # W^(f2)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        q, k = example_tensor(2, 3, 4, seed=1), example_tensor(2, 5, 6, seed=2)
        v = example_tensor(2, 5, 4, seed=3)
        mask = masks.from_lengths(torch.tensor([5, 3]), 5)  # (B, 1, N)
        module = cls(4, attention=Attention(Additive(4, 6, 5), "softmax"))
        return module, (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.BASIC]

    def extra_repr(self) -> str:
        return f"d={self.d}"

    def gate(self, s: Tensor, h: Tensor) -> Tensor:
        """F = σ(W⁽ᶠ¹⁾ s + W⁽ᶠ²⁾ h + b⁽ᶠ⁾) (…, d)."""
        return torch.sigmoid(self.fuse_s(s) + self.fuse_h(h))

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor | None = None,
        *,
        h: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> GatedMergeOutput:
        """q (B, …, M, d_q), k (B, …, N, d_k), v (B, …, N, d) or None (v = k); h (B, …, M, d)
        or None (h = q); mask broadcastable to (B, …, M, N), True = may attend."""
        q = inputs.tensor(q, "q")
        if h is None:
            if q.shape[-1] != self.d:
                raise ValueError(
                    f"h defaults to the queries, so q must have d = {self.d} features, got "
                    f"shape {tuple(q.shape)}; pass h= for queries of another size"
                )
            h = q
        h = inputs.tensor(h, "h")
        inputs.part_matches(self, type(self).__name__, "h", h)
        out = self.attention(q, k, v, mask=mask, need_weights=True)
        s = out.context
        if h.shape != s.shape:
            raise ValueError(
                f"h must have the shape of the attention's context (B, …, M, d) = "
                f"{tuple(s.shape)}, got {tuple(h.shape)}"
            )
        f = self.gate(s, h)
        return GatedMergeOutput(f * h + (1 - f) * s, s, f, out.weights)
