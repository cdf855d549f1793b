"""The position slot: how a scheme injects token order into attention, and its registry.

Attention by itself is permutation-invariant over keys (Soydaner 5.1): without position
information a Transformer cannot tell "dog bites man" from "man bites dog". A position scheme
plugs into :class:`attnkit.MultiHeadAttention` (``position=``) and the Transformer layers, and
acts on the per-head queries and keys in one or both of two ways:

- transform q and k per position (rotary embeddings rotate them), and/or
- add a bias to the scores (ALiBi's linear distance penalty, T5's relative buckets).

and, for schemes that also act on the values (Shaw et al.'s a^V), return a value term: a function
of the attention weights whose result is added to each head's context.

Absolute embeddings added to the token embeddings before attention (sinusoidal, learned) act on
the model's input instead: they are :class:`AbsolutePosition` modules, ``forward(x, offset=0)``,
registered in the same registry but refused by the attention slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.registry import Registry
from attnkit.sizing import EXAMPLE, Sized, Sizes, build, example_sizes

__all__ = [
    "REGISTRY",
    "AbsolutePosition",
    "PositionScheme",
    "Positioned",
    "check_offsets",
    "check_qk",
    "relative_distances",
]


class Positioned(NamedTuple):
    """Queries (…, M, d) and keys (…, N, d) after the scheme, a bias broadcastable to the
    scores (…, M, N) or None, and a value term or None: ``values(weights)`` maps the attention
    weights (…, M, N) to a term (…, M, d_v) that multi-head attention adds to each head's context
    (Shaw et al. eq. 3: z_i = Σ_j α_ij (v_j + a^V_ij))."""

    q: Tensor
    k: Tensor
    bias: Tensor | None = None
    values: Callable[[Tensor], Tensor] | None = None


REGISTRY: Registry[Any] = Registry("position scheme")


def relative_distances(m: int, n: int, q_offset: int, k_offset: int, device=None) -> Tensor:
    """(M, N) int64 i − j of query i at ``q_offset + i`` and key j at ``k_offset + j``."""
    i = torch.arange(q_offset, q_offset + m, device=device)
    j = torch.arange(k_offset, k_offset + n, device=device)
    return i[:, None] - j[None, :]


class PositionScheme(Sized, nn.Module):
    """A position scheme: ``forward(q, k, *, q_offset=0, k_offset=0) -> Positioned``.

    ``q`` is (B, …, M, d) and ``k`` (B, …, N, d), per head. Query i sits at position
    ``q_offset + i`` and key j at ``k_offset + j``: a decoder that caches keys passes the number
    of cached steps as ``q_offset`` so that a new query is placed after them.

    ``for_heads(head_dim, num_heads, *, max_len=None, **overrides)`` builds a scheme from its
    registered name for multi-head attention with H heads of size d
    (:class:`attnkit.sizing.Sized`; ``device=``/``dtype=`` are overrides): a scheme without
    parameters takes no sizes, one with parameters per head or per feature declares them in
    ``size_arguments`` (e.g. ``{"num_heads": "num_heads"}``). ``example()`` builds one for 2
    heads of 4 features.
    """

    absolute: ClassVar[bool] = False
    part_kind: ClassVar[str] = "position scheme"
    example_sizes: ClassVar[Sizes] = dataclasses.replace(EXAMPLE, num_heads=2)

    # Capabilities, read by the caches and kernels instead of a list of types. The defaults claim
    # nothing that would let a cache run a scheme it cannot; a scheme (or an instance, through a
    # property) declares what holds for it.
    #: The result depends on the query and key positions only through i − j: shifting every
    #: position by the same amount changes nothing. A paged cache, whose sequences sit at
    #: other offsets in its batch view, needs it.
    translation_invariant: ClassVar[bool] = False
    #: The transform at a position depends on the length of the whole sequence (dynamic NTK
    #: RoPE rescales every frequency as the sequence grows), so a prefix's outputs change when
    #: tokens are added after it and cached decoding cannot equal one pass over the whole
    #: sequence: key/value caches refuse it.
    reads_total_length: ClassVar[bool] = False
    #: q and k are transformed token by token, each vector by its own position alone (a
    #: rotation), or not at all: :meth:`transform_at` gives the transform at any positions, so
    #: a part of the sequence can be placed at its global positions (ring attention).
    per_token: ClassVar[bool] = False
    #: The scheme adds a bias to the scores.
    adds_bias: ClassVar[bool] = False
    #: The bias, if any, is a function of the head and the query and key positions alone
    #: (ALiBi's distance penalty, T5's buckets): :meth:`bias_at` gives it as a ``score_mod``,
    #: evaluated tile by tile (ring attention) without an (M, N) bias over the whole sequence.
    bias_of_positions: ClassVar[bool] = False
    #: The scheme does the same to every head and takes keys with fewer heads than the queries
    #: (no per-head parameters, no bias): grouped-query layers then place each key/value head
    #: once, not once per query head that reads it.
    same_for_every_head: ClassVar[bool] = False

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        raise NotImplementedError

    def transform_at(self, x: Tensor, positions: Tensor, total: int) -> Tensor:
        """Queries or keys x (…, L, d) placed at ``positions`` (L,) of a sequence of ``total``
        positions (the length a length-aware scheme reads); x itself by default. Declared by
        :attr:`per_token`."""
        return x

    def bias_at(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The scores e with the scheme's bias added for head ``h`` between positions ``q_idx``
        and ``kv_idx`` (a ``score_mod``; broadcast index tensors); e itself by default.
        Declared by :attr:`bias_of_positions`."""
        return e


class AbsolutePosition(nn.Module):
    """An absolute position embedding added to the token embeddings: ``forward(x, *, offset=0)``
    maps x (B, …, L, D) to x + P[offset : offset + L] (Vaswani et al. 3.5).

    Not a per-head scheme: ``for_heads`` refuses it. ``for_model(embed_dim, *, max_len=None,
    **overrides)`` builds it for a model of width ``embed_dim`` (``size_arguments`` says which
    constructor argument takes which size, as for :class:`attnkit.sizing.Sized`), and
    ``example()`` for width 8 and 16 positions.
    """

    absolute: ClassVar[bool] = True
    part_kind: ClassVar[str] = "position embedding"
    size_arguments: ClassVar[Mapping[str, str]] = {"embed_dim": "embed_dim"}
    example_sizes: ClassVar[Sizes] = dataclasses.replace(EXAMPLE, embed_dim=8)

    @classmethod
    def for_model(
        cls, embed_dim: int, *, max_len: int | None = None, **overrides: Any
    ) -> AbsolutePosition:
        """This embedding for a model of width ``embed_dim`` over at most ``max_len``
        positions; ``overrides`` are constructor arguments (e.g. ``device=``)."""
        arguments.positive_int(embed_dim, "embed_dim")
        return build(cls, Sizes(embed_dim=embed_dim, max_len=max_len), overrides)

    @classmethod
    def example(cls, **sizes: int | None) -> AbsolutePosition:
        """A small instance: ``for_model`` at :attr:`example_sizes`, which ``sizes`` replace."""
        s = example_sizes(cls.example_sizes, **sizes)
        assert s.embed_dim is not None  # set in example_sizes
        return cls.for_model(s.embed_dim, max_len=s.max_len)

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, AbsolutePosition]:
        """The example under ``""``."""
        return {"": cls.example(**sizes)}

    @classmethod
    def for_heads(cls, head_dim: int, num_heads: int | None = None, **sizes: Any) -> Any:
        raise TypeError(
            f"position scheme {getattr(cls, 'registered_name', cls.__name__)!r} is an absolute "
            "embedding added to the token embeddings, not a per-head scheme of the attention "
            "slot: add it to the model's inputs (e.g. "
            "attnkit.positions.build(name, embed_dim=D)(x))"
        )

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:
        raise NotImplementedError


def check_offsets(q_offset: object, k_offset: object) -> None:
    """Raise unless both offsets are ints >= 0 (positions count from 0; a bool is refused)."""
    from attnkit import arguments

    arguments.nonnegative_int(q_offset, "q_offset")
    arguments.nonnegative_int(k_offset, "k_offset")


def check_qk(
    q: Tensor,
    k: Tensor,
    scheme: str,
    *,
    num_heads: int | None = None,
    q_offset: int = 0,
    k_offset: int = 0,
) -> None:
    """Raise for queries and keys a per-head scheme cannot take: floating tensors (…, M, d) and
    (…, N, d) with the same d and dtype, and with ``num_heads`` given, H = ``num_heads`` at
    dim −3; and for offsets that are not ints >= 0 (:func:`check_offsets`)."""
    from attnkit import inputs

    check_offsets(q_offset, k_offset)
    min_dim = 2 if num_heads is None else 3
    inputs.tensor(q, "q", min_dim=min_dim)
    inputs.tensor(k, "k", min_dim=min_dim)
    if q.shape[-1] != k.shape[-1] or q.dtype != k.dtype:
        raise ValueError(
            f"{scheme}: q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} need the "
            "same size d and dtype"
        )
    if num_heads is not None and (q.shape[-3] != num_heads or k.shape[-3] != num_heads):
        raise ValueError(
            f"{scheme} has parameters for {num_heads} heads but got q {tuple(q.shape)} and k "
            f"{tuple(k.shape)} (heads at dim -3)"
        )
