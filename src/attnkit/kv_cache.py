"""Key/value caches for incremental (autoregressive) decoding.

A causal decoder that emits one token at a time recomputes, without a cache, the keys and values
of every earlier token at every step: O(N) projections and O(N²) attention per new token over a
context of N. The keys and values of earlier tokens do not change once computed (a causal layer's
state at position j depends only on tokens ≤ j), so a cache keeps them and each step projects only
the new token and attends once over the stored keys: O(1) projections and O(N) attention.

The cache holds the keys and values as projected, *before* the position scheme: a scheme such as
RoPE or ALiBi is applied afresh at every step with the new queries placed after the cached ones
(``q_offset`` = number of cached steps), so every scheme in the position slot works unchanged.
With grouped-query attention (``num_kv_heads`` < ``num_heads``) only the shared key/value heads
are stored, which divides the cache by num_heads / num_kv_heads.

A decoder layer's cross-attention reads the same encoder output at every step, so its projected
keys and values are computed once and kept in the layer's :class:`MemoryCache`
(``LayerCache.memory``); a step that passes another memory tensor is refused rather than
answered from a stale projection.

A cache belongs to one layer: the first layer that uses it claims it, and another layer that is
given it is refused (it would attend over the first layer's keys). When a layer claims a cache,
the cache reads what the layer's attention part declares (:class:`attnkit.HeadAttention`) and
refuses a part that does not declare ``decodes_with_cache`` (:meth:`LayerCache.check_part`),
naming the part and the reason.
"""

from __future__ import annotations

import weakref
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.head import HeadAttention

__all__ = ["KVCache", "LayerCache", "MemoryCache", "attention_part", "check_positions"]


def attention_part(layer: nn.Module) -> HeadAttention | None:
    """The per-head attention part in ``layer``'s attention slot (``layer.attention``), or
    None when the layer holds none."""
    part = getattr(layer, "attention", None)
    return part if isinstance(part, HeadAttention) else None


def check_positions(layer: nn.Module, who: str, remedy: str | None = None) -> None:
    """Raise ValueError when ``layer``'s position scheme declares ``reads_total_length``
    (:class:`attnkit.positions.PositionScheme`): its transform at every position changes as the
    sequence grows (dynamic NTK RoPE rescales all frequencies with the length), so a step over a
    cache equals a pass over the prefix, never the causal pass over the whole sequence; a cache
    that accepted it would decode differently from the model it caches without saying so."""
    scheme = getattr(layer, "position", None)
    if scheme is not None and scheme.reads_total_length:
        remedy = remedy or "decode without a cache (re-run the whole sequence each step)"
        raise ValueError(
            f"{who}: the position scheme {type(scheme).__name__} of {type(layer).__name__} "
            "reads the length of the whole sequence (e.g. dynamic NTK RoPE), so the outputs "
            "of earlier positions change as tokens are added and cached decoding cannot equal "
            f"one causal pass; {remedy}, or use a scaling that does not read the length (NTK, "
            "YaRN, linear, Llama 3)"
        )


class _Owned:
    """A cache that belongs to the one layer that used it first."""

    _owner: weakref.ref[nn.Module] | None = None

    def claim(self, layer: nn.Module) -> None:
        """Bind this cache to ``layer`` on its first use; raise ValueError when another layer
        (or a layer that no longer exists) owns it."""
        if self._owner is None:
            self._owner = weakref.ref(layer)
            return
        owner = self._owner()
        if owner is layer:
            return
        who = "a layer that no longer exists" if owner is None else type(owner).__name__
        raise ValueError(
            f"this {type(self).__name__} belongs to another layer ({who}, which used it first): "
            f"a cache holds one layer's keys and values, so {type(layer).__name__} would attend "
            "over that layer's; give every layer its own cache (e.g. KVCache(layers)[i])"
        )


class MemoryCache(_Owned):
    """The projected keys k (B, …, H_kv, N, d) and values v (B, …, H_kv, N, d_v) of a fixed
    memory (a cross-attention's encoder output), made on the first step and reused after. It
    belongs to the layer that uses it first (see :meth:`claim`)."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self._source: tuple[Tensor, Tensor] | None = None
        self._versions: tuple[int, int] = (0, 0)

    def __len__(self) -> int:
        """N, the number of memory positions (0 before the first step)."""
        return 0 if self.k is None else self.k.shape[-2]

    def holds(self, key: Tensor, value: Tensor) -> bool:
        """True when the projections of exactly these tensors are stored; raises ValueError if
        projections of other tensors are (the memory must stay the same over a decode)."""
        if self._source is None:
            return False
        if self._source[0] is key and self._source[1] is value:
            if self._versions == (key._version, value._version):
                return True
            raise ValueError(
                "the memory this cache holds the projections of was changed in place during "
                "the decode; start a new cache for a new memory"
            )
        raise ValueError(
            "this cache holds the projections of another memory: a decode must pass the same "
            "encoder output (the same tensor) at every step; start a new cache for a new memory"
        )

    def store(self, key: Tensor, value: Tensor, k: Tensor, v: Tensor) -> None:
        """Keep k and v, the projections of ``key`` and ``value``."""
        self._source, self.k, self.v = (key, value), k, v
        self._versions = (key._version, value._version)

    @property
    def nbytes(self) -> int:
        """Bytes held by the projected keys and values."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


class LayerCache(_Owned):
    """The keys and values of one attention layer: k (B, …, H_kv, N, d) and v (B, …, H_kv, N, d_v),
    grown along N by :meth:`append`; empty (None) until the first step. It belongs to the layer
    that uses it first (see :meth:`claim`); its ``memory`` to that of the cross-attention.

    Attributes:
        holds_placed_keys: the cache keeps each key as the layer placed it at its position,
            when the layer's position scheme transforms every token by its own position alone
            (``per_token``, such as RoPE, and not reading the total length) after a q/k chain
            that acts on each position alone: a decoding step then places only its new keys
            instead of every cached key again. Keys are kept as projected otherwise, and by a
            cache that declares False (one that moves keys to other positions, as a paged view
            of several sequences or a streaming window that re-places its keys).
    """

    holds_placed_keys: ClassVar[bool] = True
    #: The cache keeps the keys and values of every position seen, so :meth:`rollback` can
    #: drop the last k. A cache that folds positions into a state or drops some declares False
    #: (or overrides :meth:`rollback` with its own).
    keeps_every_position: ClassVar[bool] = True

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.memory = MemoryCache()  # the layer's cross-attention, if it has one

    def __len__(self) -> int:
        """N, the number of cached positions."""
        return 0 if self.k is None else self.k.shape[-2]

    def claim(self, layer: nn.Module) -> None:
        """Bind this cache to ``layer`` on its first use, after :meth:`check_part` accepted the
        layer's attention part; raise ValueError when another layer owns it."""
        if self._owner is None:
            self.check_part(attention_part(layer), layer)
            check_positions(layer, type(self).__name__)  # also for a direct call with a cache
        super().claim(layer)

    def check_part(self, part: HeadAttention | None, layer: nn.Module) -> None:
        """Raise ValueError, naming the part and the reason, when ``part`` (the attention part
        of ``layer``, None if it holds none) cannot decode with this cache: by default, when
        it does not declare ``decodes_with_cache`` (:meth:`attnkit.HeadAttention.refusal`)."""
        if part is not None:
            part.check_supported(f"{type(self).__name__} of {type(layer).__name__}", cache=True)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add the keys (…, H_kv, M, d) and values (…, H_kv, M, d_v) of M new positions; return
        all keys and values, cached ones first."""
        if self.k is None or self.v is None:
            self.k, self.v = k, v
            return k, v
        for name, new, old in (("k", k, self.k), ("v", v, self.v)):
            if new.shape[:-2] != old.shape[:-2] or new.shape[-1] != old.shape[-1]:
                raise ValueError(
                    f"cache: new {name} of shape {tuple(new.shape)} does not extend the cached "
                    f"{name} of shape {tuple(old.shape)} (same dims except the length N)"
                )
        self.k = torch.cat([self.k, k], dim=-2)
        self.v = torch.cat([self.v, v], dim=-2)
        return self.k, self.v

    def rollback(self, k: int) -> None:
        """Forget the last ``k`` cached positions, as if they had never been decoded (for
        speculative decoding, which drops the draft tokens the target rejected); the next step
        then sits at position ``len(self)``. Raises ValueError when fewer than k are cached,
        and for a cache that does not declare ``keeps_every_position`` (a recurrent state or a
        window of kept tokens cannot give back its last k positions)."""
        arguments.nonnegative_int(k, "k")
        if not self.keeps_every_position:
            raise ValueError(
                f"{type(self).__name__}.rollback: this cache does not store the keys and values "
                "of every position (it folds them into a state or drops some) and keeps no "
                "snapshots, so its last k positions cannot be removed; re-run the prefix into "
                "a new cache instead"
            )
        if k > len(self):
            raise ValueError(f"k = {k}: the cache holds only {len(self)} positions to roll back")
        if k and self.k is not None and self.v is not None:
            n = len(self) - k
            self.k, self.v = self.k[..., :n, :], self.v[..., :n, :]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached keys and values (self- and cross-attention)."""
        own = sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)
        return own + self.memory.nbytes


class KVCache:
    """One :class:`LayerCache` per layer of a decoder stack; ``cache[i]`` is layer i's."""

    def __init__(self, layers: int) -> None:
        arguments.positive_int(layers, "layers")
        self.layers = [LayerCache() for _ in range(layers)]

    def __getitem__(self, i: int) -> LayerCache:
        return self.layers[i]

    def __len__(self) -> int:
        """The number of layers."""
        return len(self.layers)

    @property
    def length(self) -> int:
        """The number of cached positions (the position offset of the next token)."""
        return len(self.layers[0])

    def rollback(self, k: int) -> None:
        """Forget the last ``k`` positions of every layer (:meth:`LayerCache.rollback`); every
        layer is checked first, so a refusal changes nothing."""
        arguments.nonnegative_int(k, "k")
        for i, layer in enumerate(self.layers):  # refuse before any layer changes
            if not callable(getattr(layer, "rollback", None)):
                raise ValueError(
                    f"KVCache.rollback: layer {i} holds a {type(layer).__name__}, which cannot "
                    "forget its last positions (it has no rollback)"
                )
            layer.rollback(0)
            if k > len(layer):
                raise ValueError(
                    f"k = {k}: a layer of the cache holds only {len(layer)} positions to roll back"
                )
        for layer in self.layers:
            layer.rollback(k)

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' cached keys and values (self- and cross-attention)."""
        return sum(layer.nbytes for layer in self.layers)
