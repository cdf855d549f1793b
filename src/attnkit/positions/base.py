"""The position slot: how a scheme injects token order into attention, and its registry.

Attention by itself is permutation-invariant over keys (Soydaner 5.1): without position
information a Transformer cannot tell "dog bites man" from "man bites dog". A position scheme
plugs into :class:`attnkit.MultiHeadAttention` (``position=``) and the Transformer layers, and
acts on the per-head queries and keys in one or both of two ways:

- transform q and k per position (rotary embeddings rotate them), and/or
- add a bias to the scores (ALiBi's linear distance penalty, T5's relative buckets).

Absolute embeddings added to the token embeddings before attention (sinusoidal, learned) act on
the model's input instead and need no slot here.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor, nn

from attnkit.registry import Registry

__all__ = ["REGISTRY", "PositionScheme", "Positioned"]


class Positioned(NamedTuple):
    """Queries (…, M, d) and keys (…, N, d) after the scheme, and a bias broadcastable to the
    scores (…, M, N), or None."""

    q: Tensor
    k: Tensor
    bias: Tensor | None = None


REGISTRY: Registry[PositionScheme] = Registry("position scheme")


class PositionScheme(nn.Module):
    """A position scheme: ``forward(q, k, *, q_offset=0, k_offset=0) -> Positioned``.

    ``q`` is (B, …, M, d) and ``k`` (B, …, N, d), per head. Query i sits at position
    ``q_offset + i`` and key j at ``k_offset + j``: a decoder that caches keys passes the number
    of cached steps as ``q_offset`` so that a new query is placed after them.
    """

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        raise NotImplementedError
