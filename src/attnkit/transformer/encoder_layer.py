"""The Transformer encoder layer (Vaswani et al.): self-attention and feed-forward, each with
residual and norm; a sliding window or a token mixer may take the self-attention's place."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.transformer.block import Block

__all__ = ["TransformerEncoderLayer"]


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class TransformerEncoderLayer(Block):
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
    ``window`` places away (in a decoder layer: itself and the ``window`` − 1 before it);
    over a whole sequence it is evaluated block-sparsely (cost and memory follow N·window).
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
        n = x.shape[-2]
        window = self._window_block_mask(n, n, False, x.device, 0, block_mask)
        if window is not None:
            sparse, own = {"block_mask": window, "score_mod": score_mod}, mask
        else:
            sparse = {"block_mask": block_mask, "score_mod": score_mod}
            own = masks.combine(self._window_mask(n, n, False, x.device), mask)
        x = self._sublayer(
            x, self.norm1, lambda y: self.self_attention(y, mask=own, **sparse).context
        )
        return self._sublayer(x, self.norm2, self.ff)
