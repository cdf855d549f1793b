"""Adaptive attention span (Sukhbaatar, Grave, Bojanowski and Joulin, "Adaptive Attention Span
in Transformers", ACL 2019; Soydaner 5.1): every head learns how far it looks.

A head with span z ∈ [0, S] weighs the key at distance x from the query by the soft mask
(paper eq. 4)

    m_z(x) = min(max((R + z − x) / R, 0), 1),

1 up to distance z, then a linear ramp of width R down to 0, and attends with (eq. 5)

    a_ij = m_z(x_ij) exp(e_ij) / Σ_l m_z(x_il) exp(e_il),

i.e. softmax of e + log m over the keys with m > 0 (keys beyond z + R cost nothing). z = S·p with
a learned p clamped to [0, 1], one per head; :meth:`AdaptiveSpanAttention.span_loss` is the
paper's L1 penalty on the spans, added to the training loss to make spans no longer than needed
(:meth:`AdaptiveSpanAttention.auxiliary_loss` is λ · Σ_heads z with the module's λ, which
``attnkit run`` adds to every task's loss).
Query i and key j sit at positions i and j, at distance x_ij = |i − j| (a causal model adds a
causal mask).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.attention import Attention
from attnkit.efficient.lsh import HeadOutput, check_head_inputs
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["AdaptiveSpanAttention", "span_mask"]


def span_mask(distance: Tensor, z: Tensor, ramp: float) -> Tensor:
    """m_z(x) = min(max((R + z − x)/R, 0), 1) (Sukhbaatar et al. eq. 4), broadcasting."""
    return ((ramp + z - distance) / ramp).clamp(0.0, 1.0)


@REGISTRY.register("adaptive_span")
class AdaptiveSpanAttention(nn.Module):
    """Adaptive-span attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)``
    with q (B, …, H, M, d), k (B, …, H, N, d), v (B, …, H, N, d_v): one learned span per head.

    Args:
        n_heads: H, the number of spans (the inputs' third-last dim).
        max_span: S, the largest span.
        ramp: R > 0, the width of the mask's ramp.
        init: the initial span as a fraction of S, in [0, 1].
        span_penalty: λ ≥ 0 of :meth:`auxiliary_loss`, λ · Σ_heads z (z in keys; the paper's
            2e-6 by default).
    """

    decodes_with_cache: ClassVar[bool] = True  # a step equals its causal rows

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    takes_q_offset: ClassVar[bool] = True  # distances i − j need the queries' positions

    def __init__(
        self,
        n_heads: int,
        max_span: int,
        *,
        ramp: float = 4.0,
        init: float = 0.5,
        span_penalty: float = 2e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = arguments.positive_int(n_heads, "n_heads")
        self.max_span = arguments.positive_int(max_span, "max_span")
        arguments.finite_float(ramp, "ramp")
        if not ramp > 0:
            raise ValueError(f"ramp must be > 0, got {ramp!r}")
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not 0 <= init <= 1:
            raise ValueError(f"init must be a fraction of max_span in [0, 1], got {init!r}")
        self.ramp = float(ramp)
        arguments.finite_float(span_penalty, "span_penalty")
        if span_penalty < 0:
            raise ValueError(f"span_penalty must be >= 0, got {span_penalty!r}")
        self.span_penalty = float(span_penalty)
        self.span_fraction = nn.Parameter(
            torch.full((n_heads,), float(init), device=device, dtype=dtype)
        )
        self.attention = Attention("scaled_dot", "softmax")

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (13, 14, 15))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(2, 4, ramp=2.0), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.AlignmentKind.LOCAL]

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, max_span={self.max_span}, ramp={self.ramp}"

    @property
    def spans(self) -> Tensor:
        """z per head, (H,): S · clamp(p, 0, 1)."""
        return self.max_span * self.span_fraction.clamp(0.0, 1.0)

    def span_loss(self) -> Tensor:
        """The mean span over heads, the paper's L1 penalty (scale it by a small λ)."""
        return self.spans.mean()

    def auxiliary_loss(self) -> Tensor:
        """λ · Σ_heads z: the paper's span penalty with this module's λ (``span_penalty``), in
        the units of its eq. 4 (keys), which a training loop adds to the task loss."""
        return self.span_penalty * self.spans.sum()

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        need_weights: bool = False,
        q_offset: int = 0,
    ) -> HeadOutput:
        """``q_offset``: the position of the first query (keys sit at 0 … N−1), e.g. the number
        of cached positions in incremental decoding."""
        arguments.boolean(need_weights, "need_weights")
        arguments.nonnegative_int(q_offset, "q_offset")
        check_head_inputs(q, k, v, mask, bias, "AdaptiveSpanAttention")
        if q.dim() < 3 or q.shape[-3] != self.n_heads:
            raise ValueError(
                f"AdaptiveSpanAttention(n_heads={self.n_heads}) needs q (…, H={self.n_heads}, "
                f"M, d), got {tuple(q.shape)}"
            )
        m, n = q.shape[-2], k.shape[-2]
        i = torch.arange(q_offset, q_offset + m, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        distance = (i - j).abs().to(q.dtype)
        soft = span_mask(distance, self.spans.to(q.dtype)[:, None, None], self.ramp)  # (H, M, N)
        inside = soft > 0
        log_m = torch.where(inside, soft, 1.0).log()  # softmax(e + log m) = m·exp(e)/Σ m·exp(e)
        bias = log_m if bias is None else bias + log_m
        full_mask = inside if mask is None else mask & inside
        out = self.attention(q, k, v, mask=full_mask, bias=bias, need_weights=need_weights)
        return HeadOutput(out.context, out.weights if need_weights else None)
