"""An encoder-only masked language model, BERT-style (Devlin et al. 2019; Soydaner 5.2): a
bidirectional Transformer encoder trained to predict tokens hidden from its input (the Cloze
objective).

Masking (Devlin et al. 3.1): each eligible position is chosen with probability p (15%); a chosen
token is replaced by the mask token with probability 0.8, by a token drawn uniformly from the
vocabulary with probability 0.1, and kept with probability 0.1. The loss is the cross-entropy of
the original tokens at the chosen positions only.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.transformer import TransformerEncoder

__all__ = ["IGNORE", "MaskedLM", "MaskedTokens", "mask_tokens", "masked_lm_loss"]

IGNORE = -100  # the label of positions that are not predicted (cross_entropy's ignore_index)


class MaskedTokens(NamedTuple):
    """inputs (B, N) with the chosen tokens corrupted; labels (B, N): the original token where
    chosen, :data:`IGNORE` elsewhere; chosen (B, N) boolean."""

    inputs: Tensor
    labels: Tensor
    chosen: Tensor


def mask_tokens(
    tokens: Tensor,
    *,
    vocab_size: int,
    mask_id: int,
    p: float = 0.15,
    keep: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> MaskedTokens:
    """BERT's corruption of ``tokens`` (B, N) (integers in [0, vocab_size)).

    Args:
        vocab_size: V; random replacements are drawn uniformly from [0, V).
        mask_id: the mask token's id.
        p: the probability that an eligible position is chosen.
        keep: (B, N) boolean, True where a position may be chosen (False for padding and special
            tokens); default all.
        generator: for reproducible draws.
    """
    if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.long, torch.int):
        raise TypeError(f"tokens must be an integer tensor (B, N), got {tokens!r:.60}")
    arguments.positive_int(vocab_size, "vocab_size")
    p = arguments.probability(p, "p")
    if keep is not None and (keep.dtype != torch.bool or keep.shape != tokens.shape):
        raise ValueError(
            f"keep must be boolean of the tokens' shape {tuple(tokens.shape)}, got "
            f"{keep.dtype} {tuple(keep.shape)}"
        )
    kw = {"generator": generator, "device": tokens.device}
    chosen = torch.rand(tokens.shape, **kw) < p
    if keep is not None:
        chosen &= keep
    action = torch.rand(tokens.shape, **kw)  # < 0.8: mask; < 0.9: random; else keep
    randoms = torch.randint(0, vocab_size, tokens.shape, **kw).to(tokens.dtype)
    inputs = torch.where(chosen & (action < 0.8), torch.full_like(tokens, mask_id), tokens)
    inputs = torch.where(chosen & (action >= 0.8) & (action < 0.9), randoms, inputs)
    labels = torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))
    return MaskedTokens(inputs, labels, chosen)


def masked_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy of logits (B, N, V) against labels (B, N) over the chosen positions
    (labels ≠ :data:`IGNORE`); 0 when no position is chosen."""
    if not (labels != IGNORE).any():
        return logits.sum() * 0.0
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE)


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class MaskedLM(nn.Module):
    """Token embedding + learned positions → bidirectional encoder → a LayerNorm and an output
    layer tied to the token embedding (as BERT): logits (B, N, V).

    Args:
        vocab_size: V (including the mask and any special tokens).
        max_len: the longest sequence (learned positions).
        embed_dim, num_heads, layers, d_ff: the encoder's sizes.
        layer: further keyword arguments of :class:`attnkit.TransformerEncoderLayer` (``score``,
            ``align``, ``attention``, ``position``, ``norm_first``, ``dropout``, ...).
    """

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        embed_dim: int = 64,
        num_heads: int = 4,
        layers: int = 2,
        d_ff: int | None = None,
        **layer: Any,
    ) -> None:
        super().__init__()
        self.vocab_size = arguments.positive_int(vocab_size, "vocab_size")
        self.max_len = arguments.positive_int(max_len, "max_len")
        kw = {k: layer[k] for k in ("device", "dtype") if k in layer}
        self.embed = nn.Embedding(vocab_size, embed_dim, **kw)
        self.pos = nn.Embedding(max_len, embed_dim, **kw)
        self.encoder = TransformerEncoder(layers, embed_dim, num_heads, d_ff, **layer)
        self.norm = nn.LayerNorm(embed_dim, **kw)
        self.out_bias = nn.Parameter(torch.zeros(vocab_size, **kw))

    def forward(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """tokens (B, N) -> logits (B, N, V); mask (B, 1, N) from
        :func:`attnkit.masks.from_lengths` for padding (True = real token)."""
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            raise ValueError(
                f"tokens must be (B, N), got {getattr(tokens, 'shape', type(tokens).__name__)}"
            )
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens > max_len = {self.max_len}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.encoder(self.embed(tokens) + self.pos(positions), mask)
        return self.norm(h) @ self.embed.weight.T + self.out_bias
