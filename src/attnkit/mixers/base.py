"""The token mixer: what one layer of today's stacks puts where self-attention sits.

A hybrid model (Qwen3-Next, Kimi Linear, Jamba, Falcon-H1, MiniMax, ...) alternates layers whose
token mixing is softmax attention with layers whose mixing is a recurrence (Mamba-2, Gated
DeltaNet, KDA, lightning attention). Each of those layers maps the residual stream
x (B, N, embed_dim) to (B, N, embed_dim) by its own projections, short convolutions, gates and
norms around a per-head kernel, and decodes from a state of its own kind. :class:`TokenMixer` is
that layer's contract:

- ``forward(x, *, mask=None, cache=None) -> Tensor``: ``mask`` is key padding (B, N) or
  (B, 1, N), True = a real position; padding equals truncation. The base's ``forward`` checks
  x, the cache and the mask and calls the layer's ``mix(x, keep, cache)``. ``cache`` is the layer's
  :class:`MixerCache` (from :meth:`TokenMixer.new_cache`); x then holds the new positions only.
- ``causal``: the mixer attends causally (every recurrent mixer does).
- ``cache_kind``: what its cache holds (``"recurrent"``: a state of constant size).
- ``state_names``: the names of the states its :class:`MixerCache` holds after a call, each
  with its shape and meaning; ``state_shapes(batch)`` gives the shapes for a batch.
- ``from_transformers(module)`` (optional): the mixer equal to a transformers module, with its
  weights copied.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import masks
from attnkit.kv_cache import LayerCache
from attnkit.registry import Registry

__all__ = [
    "REGISTRY",
    "MixerCache",
    "TokenMixer",
    "check_cache",
    "check_input",
    "check_state",
    "padding_mask",
]


class MixerCache(LayerCache):
    """The decoding state of one token-mixer layer: named tensors (a convolution's last inputs, a
    recurrent state, ...) that the mixer reads and replaces at every step, and the number of
    positions seen. It sits in a :class:`attnkit.kv_cache.KVCache` slot beside the
    :class:`attnkit.kv_cache.LayerCache` of attention layers, so one cache serves a hybrid stack.

    After a call, ``states`` holds exactly the states that the owning layer's class declares in
    :attr:`TokenMixer.state_names`, with the shapes of :meth:`TokenMixer.state_shapes`.
    """

    # positions are folded into the states
    keeps_every_position: ClassVar[bool] = False

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
    docstring for the contract. Subclasses set ``causal``, ``cache_kind`` and ``state_names``
    and implement :meth:`mix` and :meth:`state_shapes`; :meth:`new_cache` gives an empty
    :class:`MixerCache`."""

    causal: ClassVar[bool] = True
    cache_kind: ClassVar[str] = "recurrent"
    #: The states of this layer's :class:`MixerCache`, by name (the entries of
    #: ``cache.states`` after a call, no others), each with its shape and what it holds.
    state_names: ClassVar[dict[str, str]] = {}

    def state_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        """The shape of each state of :attr:`state_names` for ``batch`` sequences, from this
        layer's sizes."""
        raise NotImplementedError

    def new_cache(self) -> MixerCache:
        """An empty cache for decoding with this layer."""
        return MixerCache()

    def forward(
        self, x: Tensor, *, mask: Tensor | None = None, cache: MixerCache | None = None
    ) -> Tensor:
        """x (B, N, E) → (B, N, E); ``mask`` key padding (B, N) or (B, 1, N), True = real;
        with ``cache`` x holds the new positions only. Checks x against ``embed_dim``, claims
        the cache and reads the mask, then calls :meth:`mix`."""
        check_input(self, x, self.embed_dim)
        cache = check_cache(self, cache)
        keep = padding_mask(mask, x.shape[0], x.shape[1], type(self).__name__)
        return self.mix(x, keep, cache)

    def mix(self, x: Tensor, keep: Tensor | None, cache: MixerCache | None) -> Tensor:
        """The layer's own mixing of checked x (B, N, E): ``keep`` (B, N) marks the real
        positions (None: all), ``cache`` is this layer's cache or None."""
        raise NotImplementedError


#: The token-mixer layers by name (each module of :mod:`attnkit.mixers` registers its own).
REGISTRY: Registry[TokenMixer] = Registry("token mixer")


def check_input(layer: nn.Module, x: object, embed_dim: int) -> None:
    """Raise, naming ``layer``, unless x is a floating (B, N, embed_dim) tensor with N ≥ 1."""
    who = type(layer).__name__
    if not isinstance(x, Tensor):
        raise TypeError(f"{who}: x must be a tensor (B, N, {embed_dim}), got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{who}: x must be floating point, got dtype {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != embed_dim or x.shape[1] == 0:
        raise ValueError(
            f"{who}: x must be (B, N, embed_dim) = (B, N, {embed_dim}) with N ≥ 1, got "
            f"{tuple(x.shape)}"
        )


def check_cache(layer: TokenMixer, cache: object) -> MixerCache | None:
    """``cache`` as the layer's :class:`MixerCache` (claimed by it); TypeError for another kind,
    ValueError (from :meth:`MixerCache.claim`) when another layer owns it."""
    if cache is None:
        return None
    if not isinstance(cache, MixerCache):
        raise TypeError(
            f"{type(layer).__name__}: cache must be a MixerCache (from layer.new_cache()) or "
            f"None, got {type(cache).__name__}"
        )
    cache.claim(layer)
    return cache


def check_state(layer: nn.Module, cache: MixerCache, name: str, shape: tuple, dtype) -> None:
    """Raise ValueError when the cache's state ``name`` does not have ``shape`` and ``dtype``."""
    state = cache.states.get(name)
    if state is not None and (tuple(state.shape) != tuple(shape) or state.dtype != dtype):
        raise ValueError(
            f"{type(layer).__name__}: the cache's {name!r} state is {tuple(state.shape)} "
            f"{state.dtype}, but this step needs {tuple(shape)} {dtype} (another batch size "
            "or dtype?): start a new cache with layer.new_cache()"
        )


def padding_mask(mask: Tensor | None, batch: int, length: int, who: str) -> Tensor | None:
    """A token mixer's key-padding ``mask`` (B, N) or (B, 1, N), True = a real position, as
    (B, N); None stays None. Raises TypeError for a non-boolean mask and ValueError, naming
    ``who``, for another shape."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise masks.not_a_tensor(mask, "mask")
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{who}: mask must be boolean (True = a real position), got dtype {mask.dtype}; "
            "convert a 0/1 mask with mask.bool()"
        )
    if tuple(mask.shape) not in ((batch, length), (batch, 1, length)):
        raise ValueError(
            f"{who}: mask must be key padding of shape (B, N) = ({batch}, {length}) or "
            f"(B, 1, N) = ({batch}, 1, {length}), got {tuple(mask.shape)}"
        )
    return mask.reshape(batch, length)
