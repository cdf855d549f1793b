"""Adaptive attention span (Sukhbaatar, Grave, Bojanowski and Joulin, "Adaptive Attention Span
in Transformers", ACL 2019; Soydaner 5.1): every head learns how far it looks.

A head with span z ∈ [0, S] weighs the key at distance x from the query by the soft mask
(paper eq. 4)

    m_z(x) = min(max((R + z − x) / R, 0), 1),

1 up to distance z, then a linear ramp of width R down to 0, and attends with (eq. 5)

    a_ij = m_z(x_ij) exp(e_ij) / Σ_l m_z(x_il) exp(e_il),

i.e. softmax of e + log m over the keys with m > 0. z = S·p with a learned p clamped to [0, 1],
one per head; :meth:`AdaptiveSpanAttention.span_loss` is the paper's L1 penalty on the spans,
added to the training loss to make spans no longer than needed
(:meth:`AdaptiveSpanAttention.auxiliary_loss` is λ · Σ_heads z with the module's λ, which
``attnkit run`` adds to every task's loss).

The paper's *dynamic* span (its section 4, "Dynamic attention span") makes the span a function
of the current input, z_t = S·σ(vᵀx_t + b): :class:`DynamicSpanAttention`, with x_t the query
of the head at position t (the layer input seen through the head's query projection), one v and
b per head, and the L1 penalty λ Σ_t z_t on the spans of the call's queries
(``part.span_loss(part.spans(q))``).

Keys beyond z + R cost nothing: both parts evaluate attention in query blocks, each against the
band of keys within W = ⌈max z + R⌉ of its queries (:func:`span_band_attention`), so the work is
M·(block + 2W)·d rather than M·N·d and follows the span, not the sequence length (as the
paper's implementation, which crops the keys to the largest span of the layer).
Query i and key j sit at positions i and j, at distance x_ij = |i − j| (a causal model adds a
causal mask).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment, Softmax
from attnkit.efficient.span_band import span_band_attention, span_mask
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = [
    "AdaptiveSpanAttention",
    "DynamicSpanAttention",
    "span_band_attention",
    "span_mask",
]


class _SpanPart(HeadAttention):
    """What the two span parts share: their checks and the band evaluation."""

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    decodes_with_cache: ClassVar[bool] = True  # a step equals its causal rows
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    takes_q_offset: ClassVar[bool] = True  # distances i − j need the queries' positions

    num_heads: int
    ramp: float
    block: int
    align: Alignment

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.LOCAL]

    def _check(self, q, q_offset, who) -> None:
        arguments.nonnegative_int(q_offset, "q_offset")
        if q.dim() < 3 or q.shape[-3] != self.num_heads:
            raise ValueError(
                f"{who}(num_heads={self.num_heads}) needs q (…, H={self.num_heads}, M, d), got "
                f"{tuple(q.shape)}"
            )

    def _attend(self, q, k, v, spans, mask, bias, need_weights, q_offset):
        return span_band_attention(
            q,
            k,
            v,
            spans,
            self.ramp,
            self.align,
            mask=mask,
            bias=bias,
            q_offset=q_offset,
            block=self.block,
            need_weights=need_weights,
        )


def _ramp_and_block(ramp: object, block: object) -> tuple[float, int]:
    arguments.finite_float(ramp, "ramp")
    if not ramp > 0:  # type: ignore[operator]
        raise ValueError(f"ramp must be > 0, got {ramp!r}")
    return float(ramp), arguments.positive_int(block, "block")  # type: ignore[arg-type]


def _penalty(span_penalty: object) -> float:
    arguments.finite_float(span_penalty, "span_penalty")
    if span_penalty < 0:  # type: ignore[operator]
        raise ValueError(f"span_penalty must be >= 0, got {span_penalty!r}")
    return float(span_penalty)  # type: ignore[arg-type]


@REGISTRY.register("adaptive_span")
@arguments.renamed(n_heads="num_heads")
class AdaptiveSpanAttention(_SpanPart):
    """Adaptive-span attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)``
    with q (B, …, H, M, d), k (B, …, H, N, d), v (B, …, H, N, d_v): one learned span per head.

    Args:
        num_heads: H, the number of spans (the inputs' third-last dim).
        max_span: S, the largest span.
        ramp: R > 0, the width of the mask's ramp.
        init: the initial span as a fraction of S, in [0, 1].
        span_penalty: λ ≥ 0 of :meth:`auxiliary_loss`, λ · Σ_heads z (z in keys; the paper's
            2e-6 by default).
        block: queries per block of the band evaluation.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"num_heads": "num_heads", "max_span": "max_len"}

    def __init__(
        self,
        num_heads: int,
        max_span: int,
        *,
        ramp: float = 4.0,
        init: float = 0.5,
        span_penalty: float = 2e-6,
        block: int = 32,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.max_span = arguments.positive_int(max_span, "max_span")
        self.ramp, self.block = _ramp_and_block(ramp, block)
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not 0 <= init <= 1:
            raise ValueError(f"init must be a fraction of max_span in [0, 1], got {init!r}")
        self.span_penalty = _penalty(span_penalty)
        self.span_fraction = nn.Parameter(
            torch.full((num_heads,), float(init), device=device, dtype=dtype)
        )
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (13, 14, 15))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(2, 4, ramp=2.0), (q, k, v), {"mask": mask}

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, max_span={self.max_span}, ramp={self.ramp}"

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

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        q_offset: int,
    ) -> AttentionOutput:
        """``q_offset``: the position of the first query (keys sit at 0 … N−1), e.g. the number
        of cached positions in incremental decoding."""
        self._check(q, q_offset, "AdaptiveSpanAttention")
        spans = self.spans.to(q.dtype)[:, None]  # (H, 1): one span for every query of a head
        context, weights = self._attend(q, k, v, spans, mask, bias, need_weights, q_offset)
        return AttentionOutput(context, weights)


@REGISTRY.register("dynamic_span")
@arguments.renamed(n_heads="num_heads")
class DynamicSpanAttention(_SpanPart):
    """Dynamic-span attention (Sukhbaatar et al. section 4): the span of head h at query t is
    z_t = S·σ(v_hᵀ q_t + b_h), a per-head part ``part(q, k, v, *, mask, bias, need_weights)``
    with q (B, …, H, M, d), k (B, …, H, N, d), v (B, …, H, N, d_v).

    Args:
        num_heads: H (the inputs' third-last dim); head_dim: d, the size of q.
        max_span: S, the largest span.
        ramp: R > 0, the width of the mask's ramp.
        init: the initial span as a fraction of S, in (0, 1) (b = logit(init), v = 0).
        span_penalty: λ ≥ 0 of :meth:`span_loss`.
        block: queries per block of the band evaluation.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {
        "num_heads": "num_heads",
        "head_dim": "head_dim",
        "max_span": "max_len",
    }

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        max_span: int,
        *,
        ramp: float = 4.0,
        init: float = 0.5,
        span_penalty: float = 2e-6,
        block: int = 32,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.max_span = arguments.positive_int(max_span, "max_span")
        self.ramp, self.block = _ramp_and_block(ramp, block)
        if isinstance(init, bool) or not isinstance(init, (int, float)) or not 0 < init < 1:
            raise ValueError(f"init must be a fraction of max_span in (0, 1), got {init!r}")
        self.span_penalty = _penalty(span_penalty)
        kw = {"device": device, "dtype": dtype}
        self.span_weight = nn.Parameter(torch.zeros(num_heads, head_dim, **kw))  # v_h
        self.span_bias = nn.Parameter(torch.full((num_heads,), math.log(init / (1 - init)), **kw))
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (16, 17, 18))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        part = cls(2, 4, 4, ramp=2.0)
        with torch.no_grad():
            part.span_weight.copy_(0.5 * example_tensor(2, 4, seed=19))
        return part, (q, k, v), {"mask": mask}

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, max_span={self.max_span}, "
            f"ramp={self.ramp}"
        )

    def spans(self, q: Tensor) -> Tensor:
        """z_t = S·σ(v_hᵀ q_t + b_h) (B, …, H, M) for queries q (B, …, H, M, d)."""
        w, b = self.span_weight.to(q.dtype), self.span_bias.to(q.dtype)
        return self.max_span * torch.sigmoid(torch.einsum("...hmd,hd->...hm", q, w) + b[:, None])

    def span_loss(self, spans: Tensor) -> Tensor:
        """λ · Σ_t z_t averaged over the batch: the paper's L1 penalty on the spans a call
        used, ``part.spans(q)`` (the spans of a call's queries q, differentiable)."""
        return self.span_penalty * spans.reshape(spans.shape[0], -1).sum(-1).mean()

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        q_offset: int,
    ) -> AttentionOutput:
        """``q_offset``: the position of the first query (keys sit at 0 … N−1)."""
        self._check(q, q_offset, "DynamicSpanAttention")
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"DynamicSpanAttention(head_dim={self.head_dim}) got q with {q.shape[-1]} features"
            )
        spans = self.spans(q)
        context, weights = self._attend(q, k, v, spans, mask, bias, need_weights, q_offset)
        return AttentionOutput(context, weights)
