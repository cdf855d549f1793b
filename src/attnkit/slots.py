"""The extension slots of multi-head attention and the Transformer layers (DESIGN 7).

- **attention slot**: any per-head attention part, an ``nn.Module`` called as
  ``part(q, k, v, *, mask=None, bias=None, need_weights=False) -> AttentionOutput`` with q
  (B, …, H, M, d), k (B, …, H, N, d), v (B, …, H, N, d_v), a boolean mask and a float bias
  broadcastable to (B, …, H, M, N). :class:`attnkit.Attention` (score → align → weighted sum) is
  one such part and the default. A part reports its weights through :mod:`attnkit.hooks` so that
  evaluation sees them. A part whose result depends on where the queries sit (a relative
  distance, a matrix indexed by query position) sets the class attribute
  ``takes_q_offset = True`` and takes the keyword ``q_offset``: the position of the first query,
  which is the number of cached positions when decoding with a KV cache (0 otherwise). A part
  takes a KV cache only when it declares ``decodes_with_cache = True`` (a class attribute, or a
  property such as ``self.causal``): queries attending over all cached keys step by step then
  equal their rows of the part's causal pass. Parts that approximate over the whole sequence
  (hashing, sorting, landmarks, length projections) do not, and are refused. A part that keeps
  its own decoding state sets ``takes_cache = True`` and is given the layer's cache as the
  keyword ``cache`` (a :class:`attnkit.linear_family.RecurrentCache` holds a state instead of
  keys and values; the part then gets only the new keys). A part in which a
  query's result depends on the other queries (landmarks computed from all queries) sets
  ``mixes_queries = True``: in self-attention, multi-head attention then marks a token that no
  query may attend (padding) as a padded query too, an all-False row of the mask, so that the
  part can leave it out and padding equals truncation.
- **position slot**: a :class:`attnkit.positions.PositionScheme`, or a registered name.
"""

from __future__ import annotations

import inspect

from torch import nn

from attnkit.positions import REGISTRY as POSITIONS
from attnkit.positions import AbsolutePosition, NoPosition, PositionScheme

__all__ = ["ATTENTION_KEYWORDS", "attention_part", "position_scheme"]

ATTENTION_KEYWORDS = ("mask", "bias", "need_weights")


def attention_part(part: object) -> nn.Module:
    """``part`` if it follows the attention-slot protocol; a clear TypeError otherwise."""
    if not isinstance(part, nn.Module):
        raise TypeError(
            f"attention must be an nn.Module called as part(q, k, v, *, mask, bias, "
            f"need_weights) -> AttentionOutput (e.g. attnkit.Attention), got {type(part).__name__}"
        )
    params = inspect.signature(part.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [name for name in ATTENTION_KEYWORDS if name not in params and not takes_any]
    positional = [
        p
        for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if missing or len(positional) < 3:
        raise TypeError(
            f"attention part {type(part).__name__}.forward must take (q, k, v, *, mask, bias, "
            f"need_weights); it lacks {', '.join(missing) or 'three positional inputs'}"
        )
    return part


def position_scheme(
    position: object,
    *,
    head_dim: int | None = None,
    num_heads: int | None = None,
    device=None,
    dtype=None,
) -> PositionScheme:
    """A position scheme from None (no positions), a registered name or a module. A name is
    built by the scheme's ``for_heads(head_dim, num_heads)`` when the sizes are given."""
    if position is None:
        return NoPosition()
    if isinstance(position, str):
        if head_dim is None or num_heads is None:
            scheme = POSITIONS.build(position)
        else:
            scheme = POSITIONS.get(position).for_heads(
                head_dim, num_heads, device=device, dtype=dtype
            )
        return position_scheme(scheme)
    if isinstance(position, PositionScheme):
        return position
    if isinstance(position, AbsolutePosition):
        type(position).for_heads(0, 0)  # raises a TypeError saying where it belongs
    raise TypeError(
        "position must be None, a registered name "
        f"({', '.join(POSITIONS.available())}) or an attnkit.positions.PositionScheme, got "
        f"{type(position).__name__}"
    )
