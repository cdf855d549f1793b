"""The Transformer decoder stack: layers of :class:`TransformerDecoderLayer`, one per entry of
a plan, a final norm, and a cache with one slot per layer of the kind that layer decodes with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from attnkit import arguments, layer_plan
from attnkit import taxonomy as tx
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.kv_cache import KVCache
from attnkit.transformer.decoder_layer import TransformerDecoderLayer
from attnkit.transformer.stack import final_layer_norm, plan_layers

__all__ = ["TransformerDecoder"]


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class TransformerDecoder(nn.Module):
    """A stack of ``layers`` ≥ 1 decoder layers (causal self-attention, cross-attention to the
    encoder output unless ``cross_attention=False``, feed-forward); keyword arguments as
    :class:`TransformerEncoder` (``layers`` an int or a plan), ``layer`` as
    :class:`TransformerDecoderLayer`."""

    def __init__(
        self,
        layers: int | str | Sequence[Any],
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        final_norm: bool | None = None,
        num_layers: int | None = None,
        max_len: int | None = None,
        **layer: Any,
    ) -> None:
        super().__init__()
        self.plan = layer_plan.parse(layers, num_layers)
        crossed = bool(layer.get("cross_attention", True))
        made = plan_layers(
            TransformerDecoderLayer,
            self.plan,
            embed_dim,
            num_heads,
            d_ff,
            max_len,
            layer,
            keeps_score=crossed,
        )
        self.layers = nn.ModuleList(made)
        self.norm = final_layer_norm(final_norm, embed_dim, layer)

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HOP] if len(self.layers) > 1 else []

    def new_cache(self) -> KVCache:
        """An empty :class:`attnkit.kv_cache.KVCache` with one slot per layer, each of the
        kind its layer decodes with (:meth:`TransformerDecoderLayer.new_cache`)."""
        return layer_plan.stack_cache(self.layers)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        causal: bool = True,
        cache: KVCache | None = None,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> Tensor:
        """x (B, M, embed_dim); the rest as :meth:`TransformerDecoderLayer.forward`, with
        ``cache`` a :class:`attnkit.kv_cache.KVCache` from :meth:`new_cache` (one slot per
        layer): each call appends x's positions, so decoding feeds one new token at a time."""
        if cache is not None and (not isinstance(cache, KVCache) or len(cache) != len(self.layers)):
            raise ValueError(
                f"cache must be a KVCache with {len(self.layers)} layers (decoder.new_cache()), "
                f"got {cache!r}"
            )
        shared: dict = {}  # one causal mask per (M, N) for all the layers of this forward
        for i, layer in enumerate(self.layers):
            slot = None if cache is None else cache[i]
            x = layer(
                x,
                memory,
                mask=mask,
                memory_mask=memory_mask,
                causal=causal,
                cache=slot,
                block_mask=block_mask,
                score_mod=score_mod,
                shared_masks=shared,
            )
        return x if self.norm is None else self.norm(x)
