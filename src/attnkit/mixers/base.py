"""The token mixer: what one layer of today's stacks puts where self-attention sits.

A hybrid model (Qwen3-Next, Kimi Linear, Jamba, Falcon-H1, MiniMax, ...) alternates layers whose
token mixing is softmax attention with layers whose mixing is a recurrence (Mamba-2, Gated
DeltaNet, KDA, lightning attention). Each of those layers maps the residual stream
x (B, N, embed_dim) to (B, N, embed_dim) by its own projections, short convolutions, gates and
norms around a per-head kernel, and decodes from a state of its own kind. :class:`TokenMixer` is
that layer's contract:

- ``forward(x, *, mask=None, cache=None) -> Tensor``: ``mask`` is key padding (B, N) or
  (B, 1, N), True = a real position; padding equals truncation. ``cache`` is the layer's
  :class:`MixerCache` (from :meth:`TokenMixer.new_cache`); x then holds the new positions only.
- ``causal``: the mixer attends causally (every recurrent mixer does).
- ``cache_kind``: what its cache holds (``"recurrent"``: a state of constant size).
- ``from_transformers(module)`` (optional): the mixer equal to a transformers module, with its
  weights copied.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn

from attnkit.kv_cache import LayerCache
from attnkit.registry import Registry

__all__ = ["REGISTRY", "MixerCache", "TokenMixer"]


class MixerCache(LayerCache):
    """The decoding state of one token-mixer layer: named tensors (a convolution's last inputs, a
    recurrent state, ...) that the mixer reads and replaces at every step, and the number of
    positions seen. It sits in a :class:`attnkit.kv_cache.KVCache` slot beside the
    :class:`attnkit.kv_cache.LayerCache` of attention layers, so one cache serves a hybrid stack.
    """

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, Tensor] = {}
        self._seen = 0

    def __len__(self) -> int:
        """The number of positions seen (the position of the next token)."""
        return self._seen

    def advance(self, positions: int, **states: Tensor) -> None:
        """Store the states after ``positions`` more positions."""
        self.states.update(states)
        self._seen += positions

    def claim(self, layer: nn.Module) -> None:
        """Bind this cache to ``layer``, which must be a :class:`TokenMixer` (an attention layer
        holds keys and values, not this state)."""
        if not isinstance(layer, TokenMixer):
            raise ValueError(
                f"a MixerCache holds the state of a token mixer, not of {type(layer).__name__}: "
                "give an attention layer an attnkit.kv_cache.LayerCache"
            )
        super(LayerCache, self).claim(layer)  # no attention part to check

    @property
    def nbytes(self) -> int:
        """Bytes held by the states."""
        return sum(t.numel() * t.element_size() for t in self.states.values())


class TokenMixer(nn.Module):
    """The base of token-mixer layers: x (B, N, embed_dim) -> (B, N, embed_dim), see the module
    docstring for the contract. Subclasses set ``causal`` and ``cache_kind`` and implement
    :meth:`forward`; :meth:`new_cache` gives an empty :class:`MixerCache`."""

    causal: ClassVar[bool] = True
    cache_kind: ClassVar[str] = "recurrent"

    def new_cache(self) -> MixerCache:
        """An empty cache for decoding with this layer."""
        return MixerCache()

    def forward(  # pragma: no cover - the subclass's
        self, x: Tensor, *, mask: Tensor | None = None, cache: MixerCache | None = None
    ) -> Tensor:
        raise NotImplementedError


#: The token-mixer layers by name (each module of :mod:`attnkit.mixers` registers its own).
REGISTRY: Registry[TokenMixer] = Registry("token mixer")
