"""The Transformer decoder layer (Vaswani et al.): causal self-attention, cross-attention to
the encoder output (left out in a decoder-only model) and feed-forward, each with residual and
norm; it decodes incrementally from a cache of the kind its token mixing needs."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from attnkit import arguments, layer_plan, masks
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.kv_cache import LayerCache
from attnkit.transformer.block import Block, attention_heads

__all__ = ["TransformerDecoderLayer"]


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class TransformerDecoderLayer(Block):
    """Causal self-attention, then cross-attention to the encoder output (the decoder states
    are basic queries), then feed-forward; each with residual and norm (post-norm, or pre-norm
    with ``norm_first=True``). Arguments as :class:`TransformerEncoderLayer`; ``attention`` and
    ``position`` fill the self-attention's slots, and the cross-attention uses
    ``score``/``align``. ``cross_attention=False`` leaves the cross-attention out: a layer of a
    decoder-only model (GPT)."""

    # The attention submodules that attend causally (the layer passes them a causal mask), as
    # data for whoever splits the sequence: attnkit.distributed.context_parallel makes them
    # causal by global positions.
    causal_attention: ClassVar[tuple[str, ...]] = ("self_attention",)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        cross_attention: bool = True,
        **layer: Any,
    ) -> None:
        # Read by _build, which the shared constructor calls.
        self._with_cross = arguments.boolean(cross_attention, "cross_attention")
        super().__init__(embed_dim, num_heads, d_ff, **layer)

    def _self_score(self, score: Any, align: Any, attention: nn.Module | None) -> tuple[Any, Any]:
        # with a part in the self-attention's slot, score and align are the cross-attention's
        if attention is not None and self._with_cross:
            return "scaled_dot", "softmax"
        return score, align

    @property
    def keeps_state(self) -> bool:
        """Whether this layer decodes from a state of its own (a token mixer, a part that
        ``takes_cache``) rather than from the keys and values of its self-attention."""
        if self.mixer is not None:
            return True
        return bool(self.self_attention.module.attention.takes_cache)

    def new_cache(self) -> LayerCache:
        """An empty cache of the kind this layer decodes with: a token mixer's own
        (``mixer.new_cache()``), a :class:`attnkit.linear_family.RecurrentCache` for a part that
        keeps a state (``takes_cache``), for a sliding window whose position scheme reads only
        i − j the last ``window`` − 1 keys (:class:`attnkit.modern.StreamingCache` without
        sinks), else a :class:`attnkit.kv_cache.LayerCache` of every key."""
        if self.mixer is not None:
            return self.mixer.new_cache()
        mha = self.self_attention.module
        if self.keeps_state:
            from attnkit.linear_family import RecurrentCache

            return RecurrentCache()
        scheme = mha.position
        relative = scheme is None or scheme.translation_invariant
        if self.window is not None and relative and mha.score_mod is None:
            from attnkit.modern.streaming import StreamingCache

            return StreamingCache(sinks=0, window=max(self.window - 1, 1))
        return LayerCache()

    def _build(
        self, embed_dim: int, num_heads: int, score: Any, align: Any, dropout: float, kw
    ) -> None:
        self.cross_attention = (
            attention_heads(embed_dim, num_heads, score, align, dropout, "basic", **kw)
            if self._with_cross
            else None
        )
        kw = {"device": kw["device"], "dtype": kw["dtype"]}
        count = 3 if self._with_cross else 2
        self.norms = nn.ModuleList([nn.LayerNorm(embed_dim, **kw) for _ in range(count)])

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        causal: bool = True,
        cache: LayerCache | None = None,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
        shared_masks: dict | None = None,
    ) -> Tensor:
        """Args:
        x: (B, M, embed_dim) decoder states.
        memory: (B, N, embed_dim) encoder output (None without cross-attention).
        mask: the self-attention's mask, True = may attend, combined with the causal mask:
            (B, 1, M) from :func:`attnkit.masks.from_lengths` for target padding, or
            (B, M, M) / (M, M); with a cache, over all cached + M keys.
        memory_mask: (B, 1, N) from :func:`attnkit.masks.from_lengths` or (B, M, N).
        causal: mask future positions (query i attends keys j <= i).
        cache: a :class:`attnkit.kv_cache.LayerCache` for incremental decoding; x then
            holds the new positions only, placed after the cached ones. The cross-attention's
            projections of ``memory`` are kept in ``cache.memory`` on the first step; pass the
            same memory tensor at every step.
        block_mask, score_mod: the self-attention's (see
            :meth:`attnkit.MultiHeadAttention.forward`); the causal mask still applies, so a
            causal block mask (e.g. of ``patterns.sliding_window(w, causal=True)``) lets the
            tiles above the diagonal be skipped.
        shared_masks: a dict the layers of one stack's forward share, so that they build
            each (M, N) causal mask once (:func:`attnkit.masks.causal_shared`); None: this
            layer builds its own.
        """
        arguments.boolean(causal, "causal")
        if self.mixer is not None:
            if not causal:
                raise ValueError(
                    f"causal=False: this layer's token mixer {type(self.mixer).__name__} "
                    "mixes causally only"
                )
            x = self._sublayer(
                x, self.norms[0], lambda y: self._mix(y, mask, cache, block_mask, score_mod)
            )
        else:
            x = self._sublayer(
                x,
                self.norms[0],
                lambda y: self._attend(y, mask, causal, cache, block_mask, score_mod, shared_masks),
            )
        if self.cross_attention is None:
            if memory is not None or memory_mask is not None:
                raise ValueError("this decoder layer has no cross-attention: pass no memory")
        else:
            if memory is None:
                raise ValueError("memory (the encoder output) is required for cross-attention")
            cross = self.cross_attention
            fixed = None if cache is None else cache.memory  # projected once per decode
            x = self._sublayer(
                x,
                self.norms[1],
                lambda y: cross(y, memory, memory, mask=memory_mask, memory_cache=fixed).context,
            )
        return self._sublayer(x, self.norms[-1], self.ff)

    def _attend(
        self,
        y: Tensor,
        mask: Tensor | None,
        causal: bool,
        cache: LayerCache | None,
        block_mask: BlockMask | None,
        score_mod: ScoreMod | None,
        shared_masks: dict | None = None,
    ) -> Tensor:
        m = y.shape[-2]
        cached = 0 if cache is None else len(cache)
        n = m + cached
        window = self._window_block_mask(m, n, causal, y.device, cached, block_mask)
        if window is not None:  # the whole sequence, the window (and causality) block-sparse
            return self.self_attention(
                y, mask=mask, cache=cache, block_mask=window, score_mod=score_mod
            ).context
        # One new position after the cached ones may attend every key: no mask to build, check
        # or apply on the per-token path of decoding.
        future = (
            masks.causal_shared(m, n, device=y.device, shared=shared_masks)
            if causal and m > 1
            else None
        )
        window = self._window_mask(m, n, causal, y.device)
        # a window cache keeps the last keys only; a mask over every position seen
        # (layer_plan.seen) covers them in its last columns
        if (
            self.window is not None
            and mask is not None
            and cache is not None
            and mask.shape[-1] == layer_plan.seen(cache) + m > n
        ):
            mask = mask[..., -n:]
        self_mask = masks.combine(future, window, mask)
        return self.self_attention(
            y, mask=self_mask, cache=cache, block_mask=block_mask, score_mod=score_mod
        ).context
