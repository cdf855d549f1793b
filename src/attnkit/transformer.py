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
from attnkit.queries.self_attentive import QueryTagged

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
    device and dtype."""
    mha = MultiHeadAttention(d_model, heads, score, align, dropout=dropout, **kw)
    return QueryTagged(mha, query)


class TransformerEncoderLayer(nn.Module):
    """x = Norm(x + SelfAttention(x)); x = Norm(x + FF(x)) (post-norm, Vaswani et al.).

    ``score``/``align`` are passed to :class:`attnkit.MultiHeadAttention` (names or modules);
    ``d_ff`` (a positive int) is the feed-forward size, 4·d_model by default.
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        d_ff: int | None = None,
        *,
        score: Any = "scaled_dot",
        align: Any = "softmax",
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(d_model, "d_model")
        arguments.positive_int(heads, "heads")
        arguments.probability(dropout, "dropout")
        kw = {"device": device, "dtype": dtype}
        self.self_attention = _heads(d_model, heads, score, align, dropout, "self-attentive", **kw)
        self.ff = _FeedForward(d_model, d_ff, dropout, **kw)
        self.norm1, self.norm2 = nn.LayerNorm(d_model, **kw), nn.LayerNorm(d_model, **kw)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, N, d_model); mask as :meth:`attnkit.MultiHeadAttention.forward`: (B, 1, N) from
        :func:`attnkit.masks.from_lengths`, (B, N, N) or (N, N); True = may attend."""
        x = self.norm1(x + self.drop(self.self_attention(x, mask=mask).context))
        return self.norm2(x + self.drop(self.ff(x)))


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention, then cross-attention to the encoder output (the decoder states
    are basic queries), then feed-forward; each with residual and norm."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        d_ff: int | None = None,
        *,
        score: Any = "scaled_dot",
        align: Any = "softmax",
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(d_model, "d_model")
        arguments.positive_int(heads, "heads")
        arguments.probability(dropout, "dropout")
        kw = {"device": device, "dtype": dtype}
        self.self_attention = _heads(d_model, heads, score, align, dropout, "self-attentive", **kw)
        self.cross_attention = _heads(d_model, heads, score, align, dropout, "basic", **kw)
        self.ff = _FeedForward(d_model, d_ff, dropout, **kw)
        self.norms = nn.ModuleList([nn.LayerNorm(d_model, **kw) for _ in range(3)])
        self.drop = nn.Dropout(dropout)

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
    features. The other arguments are :class:`TransformerEncoderLayer`'s; a score or alignment
    given as a module is shared by every layer (give a name for one part per layer)."""

    def __init__(
        self,
        layers: int,
        d_model: int,
        heads: int,
        d_ff: int | None = None,
        *,
        score: Any = "scaled_dot",
        align: Any = "softmax",
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(layers, "layers")
        self.layers = nn.ModuleList(
            [
                TransformerEncoderLayer(
                    d_model,
                    heads,
                    d_ff,
                    score=score,
                    align=align,
                    dropout=dropout,
                    device=device,
                    dtype=dtype,
                )
                for _ in range(layers)
            ]
        )

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HOP] if len(self.layers) > 1 else []

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x (B, N, d_model); mask as :meth:`TransformerEncoderLayer.forward`."""
        for layer in self.layers:
            x = layer(x, mask)
        return x
