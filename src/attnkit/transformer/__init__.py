"""Transformer blocks (Vaswani et al.) from attnkit parts, with any score × alignment: multi-head
self-attention + residual + norm + feed-forward (encoder), and causal self-attention +
cross-attention (decoder). Brauwers 3.3.2 reads a stack of them as multi-head + multi-hop.

A stack may hold a different token mixing per layer (a hybrid: Gated DeltaNet and attention
layers, sliding-window and global ones, Mamba-2 mixers, ...): its ``layers`` is then a plan
(:mod:`attnkit.layer_plan`), and a decoder's cache holds each layer's own kind of state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, layer_plan, masks
from attnkit import taxonomy as tx
from attnkit.kernels.block_mask import BlockMask, MaskMod, ScoreMod
from attnkit.kv_cache import KVCache, LayerCache
from attnkit.multihead import MultiHeadAttention
from attnkit.positions import PositionScheme
from attnkit.queries.query_types import QueryTagged

__all__ = [
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]


class _FeedForward(nn.Sequential):
    def __init__(
        self, embed_dim: int, d_ff: int | None, dropout: float, activation: nn.Module, **kw: Any
    ) -> None:
        d_ff = 4 * embed_dim if d_ff is None else arguments.positive_int(d_ff, "d_ff")
        if not isinstance(activation, nn.Module):
            raise TypeError(
                f"activation must be an nn.Module (e.g. torch.nn.GELU()), got "
                f"{type(activation).__name__}"
            )
        super().__init__(
            nn.Linear(embed_dim, d_ff, **kw),
            activation,
            nn.Dropout(dropout),
            nn.Linear(d_ff, embed_dim, **kw),
        )

    def forward(self, x: Tensor) -> Tensor:
        first, activation, drop, second = self._modules.values()
        x = activation(first(x))
        if self.training and drop.p > 0:  # (no module call for a no-op, per token)
            x = drop(x)
        return second(x)


def _identity(x: Tensor) -> Tensor:
    return x


def _mixer(mixer: nn.Module | None, slots: dict[str, Any]) -> nn.Module | None:
    """``mixer`` checked: a token mixer takes the self-attention's place, so none of the
    self-attention's slots may be given with it."""
    if mixer is None:
        return None
    from attnkit.mixers import TokenMixer

    if not isinstance(mixer, TokenMixer):
        raise TypeError(
            f"mixer must be an attnkit.mixers.TokenMixer or None, got {type(mixer).__name__}"
        )
    given = [name for name, value in slots.items() if value is not None]
    if given:
        raise ValueError(
            f"mixer= replaces the self-attention, so its {', '.join(given)} cannot be given too"
        )
    return mixer


def _heads(
    embed_dim: int, num_heads: int, score: Any, align: Any, dropout: float, query: str, **kw: Any
) -> QueryTagged:
    """A multi-head attention part, tagged with where its queries come from; ``kw`` holds
    device and dtype, and for self-attention the attention and position slots."""
    mha = MultiHeadAttention(embed_dim, num_heads, score, align, dropout=dropout, **kw)
    return QueryTagged(mha, query)


class _Block(nn.Module):
    """What both layers share: validated sizes, causal or plain self-attention, feed-forward,
    and where the norms sit (``norm_first``)."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        score: Any = "scaled_dot",
        align: Any = "softmax",
        dropout: float = 0.0,
        norm_first: bool = False,
        activation: nn.Module | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        attention: nn.Module | None = None,
        position: str | PositionScheme | None = None,
        pattern: MaskMod | None = None,
        score_mod: ScoreMod | None = None,
        window: int | None = None,
        mixer: nn.Module | None = None,
        gate: str | nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(embed_dim, "embed_dim")
        arguments.positive_int(num_heads, "num_heads")
        arguments.probability(dropout, "dropout")
        self.norm_first = arguments.boolean(norm_first, "norm_first")
        self.window = arguments.optional_positive_int(window, "window")
        kw = {"device": device, "dtype": dtype}
        slots = {
            "attention": attention,
            "position": position,
            "pattern": pattern,
            "score_mod": score_mod,
            "gate": gate,
        }
        if self.window is not None and pattern is not None:
            raise ValueError(
                "window= and pattern= both restrict the self-attention's keys: give one (a "
                "causal sliding window is patterns.sliding_window(w, causal=True))"
            )
        sizes = {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        self.mixer = _mixer(mixer, {**slots, "window": window})
        self.self_attention = (
            None
            if self.mixer is not None
            else _heads(
                embed_dim,
                num_heads,
                *self._self_score(score, align, attention),
                dropout,
                "self-attentive",
                **sizes,
                **slots,
                **kw,
            )
        )
        self._build(embed_dim, num_heads, score, align, dropout, {**kw, **sizes})
        activation = nn.ReLU() if activation is None else activation
        self.ff = _FeedForward(embed_dim, d_ff, dropout, activation, **kw)
        self.drop = nn.Dropout(dropout)

    def _sublayer(self, x: Tensor, norm: nn.Module, f: Callable[[Tensor], Tensor]) -> Tensor:
        """Post-norm Norm(x + f(x)) (Vaswani et al.), or pre-norm x + f(Norm(x)) (Xiong et al.
        2020: better-behaved gradients at the start of training, no warm-up needed)."""
        drop = self.drop if self.training and self.drop.p > 0 else _identity
        if self.norm_first:
            return x + drop(f(norm(x)))
        return norm(x + drop(f(x)))

    def _build(
        self, embed_dim: int, num_heads: int, score: Any, align: Any, dropout: float, kw
    ) -> None:
        raise NotImplementedError

    def _self_score(self, score: Any, align: Any, attention: nn.Module | None) -> tuple[Any, Any]:
        """The score and alignment the self-attention is built with."""
        return score, align

    def _mix(
        self,
        y: Tensor,
        mask: Tensor | None,
        cache: LayerCache | None,
        block_mask: BlockMask | None,
        score_mod: ScoreMod | None,
    ) -> Tensor:
        """The token mixer's output on y (B, M, embed_dim); ``mask`` must be key padding."""
        who = f"{type(self).__name__} with the token mixer {type(self.mixer).__name__}"
        if block_mask is not None or score_mod is not None:
            raise ValueError(
                f"{who}: block_mask and score_mod act on attention scores, which a token mixer "
                "has none of; pass them to a stack of attention layers only"
            )
        if mask is not None and not (mask.dim() == 3 and mask.shape[-2] == 1):
            raise ValueError(
                f"{who}: the mask must be key padding (B, 1, N) (masks.from_lengths), the only "
                f"mask a token mixer honours; got shape {tuple(mask.shape)}"
            )
        padding = None if mask is None else mask[..., -y.shape[-2] :]
        return self.mixer(y, mask=padding, cache=cache)

    def _window_mask(self, m: int, n: int, causal: bool, device: torch.device) -> Tensor | None:
        """(M, N) the sliding window of the self-attention (None without one, or when every key
        is inside it): the M queries are the last of N places; causally each attends itself
        and the window − 1 places before it, else the places less than window away."""
        if self.window is None or n <= self.window:
            return None
        i = torch.arange(n - m, n, device=device)[:, None]
        d = i - torch.arange(n, device=device)[None, :]
        return (d < self.window) & (d >= 0) if causal else d.abs() < self.window


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class TransformerEncoderLayer(_Block):
    """x = Norm(x + SelfAttention(x)); x = Norm(x + FF(x)) (post-norm, Vaswani et al.), or with
    ``norm_first=True`` x = x + SelfAttention(Norm(x)); x = x + FF(Norm(x)) (pre-norm).

    ``score``/``align`` are passed to :class:`attnkit.MultiHeadAttention` (names or modules);
    ``d_ff`` (a positive int) is the feed-forward size, 4·embed_dim by default; ``activation`` the
    feed-forward's nonlinearity (an nn.Module, ReLU by default); ``num_kv_heads`` and
    ``head_dim`` as :class:`attnkit.MultiHeadAttention` (grouped-query heads, head size);
    ``device`` and ``dtype`` are the parameters'. The self-attention's slots (DESIGN 7):
    ``attention``, a per-head attention part used instead of score/align, and ``position``, a
    position scheme (a registered name or a :class:`attnkit.positions.PositionScheme`).
    ``pattern``: a sparse pattern of the self-attention (a mask function from
    :mod:`attnkit.patterns`: ``longformer``, ``bigbird``, ``strided``, ``sliding_window``, ...),
    evaluated block-sparsely so that the cost follows its density; ``score_mod``: applied to the
    self-attention's per-head scores (see :class:`attnkit.MultiHeadAttention`).
    ``window``: a sliding window of the self-attention, each query attends the keys less than
    ``window`` places away (in a decoder layer: itself and the ``window`` − 1 before it).
    ``mixer``: an :class:`attnkit.mixers.TokenMixer` that takes the self-attention's place (a
    Mamba-2 or Gated DeltaNet layer of a hybrid stack); it is called with key padding only.
    ``gate``: the self-attention's sigmoid output gate (``"elementwise"`` or ``"headwise"``,
    see :class:`attnkit.MultiHeadAttention`; Qwen3-Next's full-attention layers).
    """

    def _build(
        self, embed_dim: int, num_heads: int, score: Any, align: Any, dropout: float, kw
    ) -> None:
        kw = {"device": kw["device"], "dtype": kw["dtype"]}
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim, **kw), nn.LayerNorm(embed_dim, **kw)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> Tensor:
        """x (B, N, embed_dim); mask as :meth:`attnkit.MultiHeadAttention.forward`: (B, 1, N) from
        :func:`attnkit.masks.from_lengths`, (B, N, N) or (N, N); True = may attend.
        ``block_mask`` (over N × N) and ``score_mod`` reach the self-attention (see
        :meth:`attnkit.MultiHeadAttention.forward`)."""
        if self.mixer is not None:
            x = self._sublayer(
                x, self.norm1, lambda y: self._mix(y, mask, None, block_mask, score_mod)
            )
            return self._sublayer(x, self.norm2, self.ff)
        sparse = {"block_mask": block_mask, "score_mod": score_mod}
        n = x.shape[-2]
        own = masks.combine(self._window_mask(n, n, False, x.device), mask)
        x = self._sublayer(
            x, self.norm1, lambda y: self.self_attention(y, mask=own, **sparse).context
        )
        return self._sublayer(x, self.norm2, self.ff)


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class TransformerDecoderLayer(_Block):
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
            _heads(embed_dim, num_heads, score, align, dropout, "basic", **kw)
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
                lambda y: self._attend(y, mask, causal, cache, block_mask, score_mod),
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
    ) -> Tensor:
        m = y.shape[-2]
        n = m + (0 if cache is None else len(cache))
        # One new position after the cached ones may attend every key: no mask to build, check
        # or apply on the per-token path of decoding.
        future = masks.causal(m, n, device=y.device) if causal and m > 1 else None
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


def _final_norm(final_norm: bool | None, embed_dim: int, layer: dict) -> nn.LayerNorm | None:
    """A LayerNorm after the last layer: by default only for pre-norm stacks, whose residual
    stream is otherwise never normalised (post-norm layers end with a norm already)."""
    if final_norm is None:
        final_norm = layer.get("norm_first", False)
    if not arguments.boolean(final_norm, "final_norm"):
        return None
    kw = {k: layer[k] for k in ("device", "dtype") if k in layer}
    return nn.LayerNorm(embed_dim, **kw)


def _layers(
    cls: type[_Block],
    plan: tuple[layer_plan.LayerEntry, ...],
    embed_dim: int,
    num_heads: int,
    d_ff: int | None,
    max_len: int | None,
    layer: dict[str, Any],
) -> list[_Block]:
    """The layers of ``plan``, each of ``cls`` with the stack's arguments ``layer`` as its
    entry reads them (:func:`attnkit.layer_plan.layer_arguments`)."""
    arguments.positive_int(embed_dim, "embed_dim")
    arguments.positive_int(num_heads, "num_heads")
    crossed = cls is TransformerDecoderLayer and layer.get("cross_attention", True)
    return [
        cls(
            embed_dim,
            num_heads,
            d_ff,
            **layer_plan.layer_arguments(
                entry,
                layer,
                embed_dim=embed_dim,
                num_heads=num_heads,
                max_len=max_len,
                keeps_score=bool(crossed),
                index=i,
                depth=len(plan),
            ),
        )
        for i, entry in enumerate(plan)
    ]


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class TransformerEncoder(nn.Module):
    """A stack of ``layers`` ≥ 1 encoder layers; each layer is one hop over the refined
    features. ``layer`` holds :class:`TransformerEncoderLayer`'s keyword arguments (``score``,
    ``align``, ``dropout``, ``norm_first``, ``position``, ``pattern``, ``score_mod``, ``device``,
    ``dtype``, ...; an unknown one raises TypeError): e.g.
    ``TransformerEncoder(2, 64, 4, pattern=attnkit.patterns.bigbird(64, n))`` is a BigBird
    encoder, ``pattern=patterns.longformer(w)`` a Longformer one; a score or alignment given as
    a module is shared by every layer (give a name for one part per layer). ``final_norm`` adds
    a LayerNorm after the last layer (default: with ``norm_first=True`` only).

    ``layers`` may instead be a plan, one token mixing per layer (:mod:`attnkit.layer_plan`):
    ``"3 gated_deltanet : 1 full"``, ``"5 sliding:512 : 1 full"``, a list of names, modules or
    factories; ``num_layers`` repeats the pattern to that many layers, and ``max_len`` (the
    longest input) reaches the per-head parts of the plan that need it. The layer arguments
    above shape the ``full`` layers (and the ``sliding`` ones, but for ``pattern``)."""

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
        self.layers = nn.ModuleList(
            _layers(TransformerEncoderLayer, self.plan, embed_dim, num_heads, d_ff, max_len, layer)
        )
        self.norm = _final_norm(final_norm, embed_dim, layer)

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HOP] if len(self.layers) > 1 else []

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> Tensor:
        """x (B, N, embed_dim); mask, block_mask and score_mod as
        :meth:`TransformerEncoderLayer.forward` (the same for every layer)."""
        for layer in self.layers:
            x = layer(x, mask, block_mask=block_mask, score_mod=score_mod)
        return x if self.norm is None else self.norm(x)


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
        self.layers = nn.ModuleList(
            _layers(TransformerDecoderLayer, self.plan, embed_dim, num_heads, d_ff, max_len, layer)
        )
        self.norm = _final_norm(final_norm, embed_dim, layer)

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
            )
        return x if self.norm is None else self.norm(x)
