"""The extension slots of multi-head attention and the Transformer layers (DESIGN 7).

- **attention slot**: any per-head attention part, a :class:`attnkit.HeadAttention` called as
  ``part(q, k, v, *, mask=None, bias=None, need_weights=False) -> AttentionOutput`` with q
  (B, …, H, M, d), k (B, …, H, N, d), v (B, …, H, N, d_v), a boolean mask and a float bias
  broadcastable to (B, …, H, M, N). :class:`attnkit.Attention` (score → align → weighted sum) is
  one such part and the default. A part reports its weights through :mod:`attnkit.hooks` so that
  evaluation sees them. What a part supports is class data on it (``mask_forms``,
  ``accepts_bias``, ``decodes_with_cache``, ``takes_q_offset``, ``takes_cache``,
  ``mixes_queries``, ``accepts_block_mask``, ``accepts_score_mod``; see
  :class:`attnkit.HeadAttention`): the layers read it and refuse, with the reason, a call that
  asks for something the part does not declare. A plain ``nn.Module`` is refused with a
  TypeError saying how to derive it from :class:`attnkit.HeadAttention`: its capabilities
  would be unknown.
- **position slot**: a :class:`attnkit.positions.PositionScheme`, or a registered name.
"""

from __future__ import annotations

from torch import nn

from attnkit.head import HeadAttention
from attnkit.positions import REGISTRY as POSITIONS
from attnkit.positions import AbsolutePosition, NoPosition, PositionScheme

__all__ = ["ATTENTION_KEYWORDS", "attention_part", "position_scheme"]

ATTENTION_KEYWORDS = ("mask", "bias", "need_weights")


def attention_part(part: object) -> HeadAttention:
    """``part`` if it is a per-head attention part (a :class:`attnkit.HeadAttention`); a
    TypeError saying how to make one otherwise."""
    if isinstance(part, HeadAttention):
        return part
    if isinstance(part, nn.Module):
        raise TypeError(
            f"attention part {type(part).__name__} is a plain nn.Module: derive it from "
            "attnkit.HeadAttention (forward(q, k, v, *, mask=None, bias=None, need_weights="
            "False) -> AttentionOutput) and declare what it supports as class data "
            "(mask_forms, accepts_bias, decodes_with_cache, takes_q_offset, ...), so that "
            "the layers know what they may ask of it"
        )
    if isinstance(part, type) and issubclass(part, nn.Module):
        raise TypeError(
            f"attention must be an instance of a per-head part, got the class {part.__name__}; "
            f"pass {part.__name__}(...)"
        )
    raise TypeError(
        "attention must be an attnkit.HeadAttention called as part(q, k, v, *, mask, bias, "
        f"need_weights) -> AttentionOutput (e.g. attnkit.Attention), got {type(part).__name__}"
    )


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
