"""The Transformer encoder stack: layers of :class:`TransformerEncoderLayer`, one per entry of
a plan (the same self-attention in each, or a hybrid of token mixings), and a final norm."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from attnkit import arguments, layer_plan
from attnkit import taxonomy as tx
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.transformer.encoder_layer import TransformerEncoderLayer
from attnkit.transformer.stack import final_layer_norm, plan_layers

__all__ = ["TransformerEncoder"]


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
        made = plan_layers(
            TransformerEncoderLayer, self.plan, embed_dim, num_heads, d_ff, max_len, layer
        )
        self.layers = nn.ModuleList(made)
        self.norm = final_layer_norm(final_norm, embed_dim, layer)

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
