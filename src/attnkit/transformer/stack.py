"""What the encoder and the decoder stack share: the layers of a plan, built from the stack's
arguments, and the norm after the last layer."""

from __future__ import annotations

from typing import Any

from torch import nn

from attnkit import arguments, layer_plan
from attnkit.transformer.block import Block

__all__ = ["final_layer_norm", "plan_layers"]


def final_layer_norm(final_norm: bool | None, embed_dim: int, layer: dict) -> nn.LayerNorm | None:
    """A LayerNorm after the last layer: by default only for pre-norm stacks, whose residual
    stream is otherwise never normalised (post-norm layers end with a norm already)."""
    if final_norm is None:
        final_norm = layer.get("norm_first", False)
    if not arguments.boolean(final_norm, "final_norm"):
        return None
    kw = {k: layer[k] for k in ("device", "dtype") if k in layer}
    return nn.LayerNorm(embed_dim, **kw)


def plan_layers(
    cls: type[Block],
    plan: tuple[layer_plan.LayerEntry, ...],
    embed_dim: int,
    num_heads: int,
    d_ff: int | None,
    max_len: int | None,
    layer: dict[str, Any],
    *,
    keeps_score: bool = False,
) -> list[Block]:
    """The layers of ``plan``, each of ``cls`` with the stack's arguments ``layer`` as its
    entry reads them (:func:`attnkit.layer_plan.layer_arguments`); ``keeps_score``: the layers
    read ``score``/``align`` besides their self-attention (a decoder's cross-attention)."""
    arguments.positive_int(embed_dim, "embed_dim")
    arguments.positive_int(num_heads, "num_heads")
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
                keeps_score=keeps_score,
                index=i,
                depth=len(plan),
            ),
        )
        for i, entry in enumerate(plan)
    ]
