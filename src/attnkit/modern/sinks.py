"""A learned attention sink per head: softmax with one extra logit that has no value (as in
GPT-OSS; Xiao et al. 2023 observe that trained models dump surplus attention on the first tokens,
and a learned sink gives that mass a place of its own; Sun et al. 2024 and Miller's
"softmax + 1" are the same idea with a fixed logit).

For a query row with scores e_1 … e_N (after bias and mask) and head h's sink logit s_h,

    a_j = exp(e_j) / (exp(s_h) + Σ_l exp(e_l)),        context = Σ_j a_j v_j,

i.e. softmax over the N keys and one extra column s_h whose weight is dropped. The weights sum to
Σ_j a_j = σ(logsumexp_j e_j − s_h) < 1, so a head can attend to nothing in particular (its output
shrinks towards 0) instead of being forced to spread a unit of mass over the keys. A row with no
key gets weights 0 and context 0 (all mass on the sink), as attnkit's convention asks.

:class:`SinkSoftmax` is the alignment (scores (…, H, M, N) → weights); :class:`SinkAttention` is
the per-head part for ``MultiHeadAttention(attention=...)``, scaled dot product by default.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment, AlignOutput
from attnkit.core import Attention
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["SinkAttention", "SinkSoftmax", "sink_softmax"]


def sink_softmax(scores: Tensor, sink: Tensor, mask: Tensor | None = None) -> Tensor:
    """Softmax over the last dim with an extra column of logit ``sink`` whose weight is dropped.

    Args:
        scores: (…, M, N).
        sink: a logit broadcastable to (…, M, 1), e.g. (H, 1, 1) for scores (B, H, M, N).
        mask: boolean, True = may attend, broadcastable to ``scores``.

    Returns:
        weights (…, M, N), each row summing to σ(logsumexp e − s) < 1; 0 where masked.
    """
    sink = sink.to(scores.dtype)
    filled = scores if mask is None else scores.masked_fill(~mask, float("-inf"))
    # The shift includes the sink: exp never overflows and a row with no key is exp(s − s) = 1
    # in the denominator, 0 above it.
    top = torch.maximum(filled.amax(-1, keepdim=True), sink.expand(*filled.shape[:-1], 1))
    top = top.detach()
    ex = torch.exp(filled - top)
    return ex / (ex.sum(-1, keepdim=True) + torch.exp(sink - top))


class SinkSoftmax(Alignment):
    """Softmax with a learned sink logit per head (the GPT-OSS form), for scores (…, H, M, N).

    Args:
        num_heads: H, the size of the scores' third dimension from the end.
        init: the sinks' initial logit.
        device, dtype: of the sink logits.
    """

    label = tx.AlignmentKind.GLOBAL
    normalized = False  # rows sum to less than 1: the rest is on the sink

    def __init__(
        self,
        num_heads: int,
        *,
        init: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.sinks = nn.Parameter(
            torch.full(
                (self.num_heads,),
                arguments.finite_float(init, "init"),
                device=device,
                dtype=dtype,
            )
        )

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        if scores.dim() < 3 or scores.shape[-3] != self.num_heads:
            raise ValueError(
                f"SinkSoftmax(num_heads={self.num_heads}) needs scores (…, H, M, N) with "
                f"H = {self.num_heads}, got shape {tuple(scores.shape)}"
            )
        return AlignOutput(sink_softmax(scores, self.sinks[:, None, None], mask))


@REGISTRY.register("sink")
class SinkAttention(HeadAttention):
    """Attention with a learned sink logit per head, a per-head part
    ``part(q, k, v, *, mask, bias, need_weights)`` with q (B, …, H, M, d), k (B, …, H, N, d),
    v (B, …, H, N, d_v) → context (B, …, H, M, d_v); weights (B, …, H, M, N) sum to less than 1.

    Args:
        num_heads: H (one sink logit per head).
        score: a score module or registered name (scaled dot product by default, as GPT-OSS).
        init: the sinks' initial logit.
        device, dtype: of the sink logits.

    ``MultiHeadAttention(E, H, attention=SinkAttention(H))`` is GPT-OSS's attention given its
    projections and rotary positions (``position="rope"``); a causal or sliding-window mask is
    passed as ``mask``. Each query attends over the keys it is given, so it decodes with a KV
    cache.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"num_heads": "num_heads"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    decodes_with_cache: ClassVar[bool] = True

    def __init__(
        self,
        num_heads: int,
        *,
        score: str | Score = "scaled_dot",
        init: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.attention = Attention(
            score, SinkSoftmax(num_heads, init=init, device=device, dtype=dtype)
        )

    @property
    def num_heads(self) -> int:
        return self.attention.align.num_heads

    @property
    def sinks(self) -> nn.Parameter:
        """The sink logits s_h, (H,)."""
        return self.attention.align.sinks

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 6, 4, seed=s) for s in (21, 22, 23))
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)[:, None].expand(2, 2, 1, 6)
        return cls(2, init=0.5), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.AlignmentKind.GLOBAL]

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:
        out = self.attention(q, k, v, mask=mask, bias=bias, need_weights=need_weights)
        return AttentionOutput(out.context, out.weights if need_weights else None)
