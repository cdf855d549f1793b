"""Transformer blocks (Vaswani et al.) from attnkit parts, with any score × alignment: multi-head
self-attention + residual + norm + feed-forward (encoder), and causal self-attention +
cross-attention (decoder). Brauwers 3.3.2 reads a stack of them as multi-head + multi-hop."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.multihead import MultiHeadAttention
from attnkit.positions import PositionScheme
from attnkit.queries.query_types import QueryTagged

__all__ = ["TransformerDecoderLayer", "TransformerEncoder", "TransformerEncoderLayer"]


class _FeedForward(nn.Sequential):
    def __init__(self, d_model: int, d_ff: int | None, dropout: float, **kw: Any) -> None:
        d_ff = 4 * d_model if d_ff is None else arguments.positive_int(d_ff, "d_ff")
        super().__init__(
            nn.Linear(d_model, d_ff, **kw),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(d_ff, d_model, **kw),
        )


def _heads(
    d_model: int, heads: int, score: Any, align: Any, dropout: float, query: str, **kw: Any
) -> QueryTagged:
    """A multi-head attention part, tagged with where its queries come from; ``kw`` holds
    device and dtype, and for self-attention the attention and position slots."""
    mha = MultiHeadAttention(d_model, heads, score, align, dropout=dropout, **kw)
    return QueryTagged(mha, query)


class _Block(nn.Module):
    """What both layers share: validated sizes, causal or plain self-attention, feed-forward."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        d_ff: int | None = None,
        *,
        score: Any = "scaled_dot",
        align: Any = "softmax",
        dropout: float = 0.0,
        attention: nn.Module | None = None,
        position: str | PositionScheme | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(d_model, "d_model")
        arguments.positive_int(heads, "heads")
        arguments.probability(dropout, "dropout")
        kw = {"device": device, "dtype": dtype}
        slots = {"attention": attention, "position": position}
        self.self_attention = _heads(
            d_model, heads, score, align, dropout, "self-attentive", **slots, **kw
        )
        self._build(d_model, heads, score, align, dropout, kw)
        self.ff = _FeedForward(d_model, d_ff, dropout, **kw)
        self.drop = nn.Dropout(dropout)

    def _build(self, d_model: int, heads: int, score: Any, align: Any, dropout: float, kw) -> None:
        raise NotImplementedError


class TransformerEncoderLayer(_Block):
    """x = Norm(x + SelfAttention(x)); x = Norm(x + FF(x)) (post-norm, Vaswani et al.).

    ``score``/``align`` are passed to :class:`attnkit.MultiHeadAttention` (names or modules);
    ``d_ff`` (a positive int) is the feed-forward size, 4·d_model by default; ``device`` and
    ``dtype`` are the parameters'. The self-attention's slots (DESIGN 7): ``attention``, a
    per-head attention part used instead of score/align, and ``position``, a position scheme
    (a registered name or a :class:`attnkit.positions.PositionScheme`).
    """

    def _build(self, d_model: int, heads: int, score: Any, align: Any, dropout: float, kw) -> None:
        self.norm1, self.norm2 = nn.LayerNorm(d_model, **kw), nn.LayerNorm(d_model, **kw)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, N, d_model); mask as :meth:`attnkit.MultiHeadAttention.forward`: (B, 1, N) from
        :func:`attnkit.masks.from_lengths`, (B, N, N) or (N, N); True = may attend."""
        x = self.norm1(x + self.drop(self.self_attention(x, mask=mask).context))
        return self.norm2(x + self.drop(self.ff(x)))


class TransformerDecoderLayer(_Block):
    """Causal self-attention, then cross-attention to the encoder output (the decoder states
    are basic queries), then feed-forward; each with residual and norm. Arguments as
    :class:`TransformerEncoderLayer`; ``attention`` and ``position`` fill the self-attention's
    slots, and the cross-attention uses ``score``/``align``."""

    def _build(self, d_model: int, heads: int, score: Any, align: Any, dropout: float, kw) -> None:
        self.cross_attention = _heads(d_model, heads, score, align, dropout, "basic", **kw)
        self.norms = nn.ModuleList([nn.LayerNorm(d_model, **kw) for _ in range(3)])

    def forward(self, x: Tensor, memory: Tensor, *, memory_mask: Tensor | None = None) -> Tensor:
        """x (B, M, d_model) decoder states; memory (B, N, d_model) encoder output;
        memory_mask (B, 1, N) from :func:`attnkit.masks.from_lengths` or (B, M, N), True = may
        attend (the self-attention is causal)."""
        causal = masks.causal(x.shape[-2], device=x.device)
        x = self.norms[0](x + self.drop(self.self_attention(x, mask=causal).context))
        cross = self.cross_attention(x, memory, memory, mask=memory_mask).context
        x = self.norms[1](x + self.drop(cross))
        return self.norms[2](x + self.drop(self.ff(x)))


class TransformerEncoder(nn.Module):
    """A stack of ``layers`` ≥ 1 encoder layers; each layer is one hop over the refined
    features. ``layer`` holds :class:`TransformerEncoderLayer`'s keyword arguments (``score``,
    ``align``, ``dropout``, ``device``, ``dtype``; an unknown one raises TypeError); a score or
    alignment given as a module is shared by every layer (give a name for one part per
    layer)."""

    def __init__(
        self, layers: int, d_model: int, heads: int, d_ff: int | None = None, **layer: Any
    ) -> None:
        super().__init__()
        arguments.positive_int(layers, "layers")
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(d_model, heads, d_ff, **layer) for _ in range(layers)]
        )

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HOP] if len(self.layers) > 1 else []

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, N, d_model); mask as :meth:`TransformerEncoderLayer.forward`."""
        for layer in self.layers:
            x = layer(x, mask)
        return x
