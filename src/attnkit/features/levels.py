"""Feature levels (Brauwers 3.1.2): attention-via-attention (Zhao & Zhang, Fig. 7) and
hierarchical attention (Yang et al., Fig. 8)."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import checks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.features._pooling import key_mask
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive, Score

__all__ = [
    "AttentionViaAttention",
    "HierarchicalAttention",
    "HierarchicalOutput",
    "ViaAttentionOutput",
]


class ViaAttentionOutput(NamedTuple):
    """concat(c⁽ʷ⁾, c⁽ᶜ⁾) (…, d_word + d_char), word weights (…, n_w), char weights (…, n_c)."""

    output: Tensor
    word_weights: Tensor
    char_weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"word_weights": self.word_weights, "char_weights": self.char_weights}


@REGISTRY.register("attention_via_attention")
class AttentionViaAttention(nn.Module):
    """The query attends to word-level features, giving c⁽ʷ⁾; concat(q, c⁽ʷ⁾) then attends to
    character-level features, giving c⁽ᶜ⁾; the output is concat(c⁽ʷ⁾, c⁽ᶜ⁾) (Fig. 7).

    Args:
        d_q: query size; d_word, d_char: word and character feature sizes.
        word_score, char_score: scores with d_q → d_word and (d_q + d_word) → d_char; additive
            (hidden size d_w) by default.
    """

    def __init__(
        self,
        d_q: int,
        d_word: int,
        d_char: int,
        d_w: int = 64,
        *,
        word_score: Score | None = None,
        char_score: Score | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d_q=d_q, d_word=d_word, d_char=d_char, d_w=d_w)
        self.d_q, self.d_word, self.d_char = d_q, d_word, d_char
        kw = {"device": device, "dtype": dtype}
        self.word = Attention(
            checks.optional_score(word_score, "word_score") or Additive(d_q, d_word, d_w, **kw)
        )
        self.char = Attention(
            checks.optional_score(char_score, "char_score")
            or Additive(d_q + d_word, d_char, d_w, **kw)
        )

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {
        "word_mask": ("words",),
        "char_mask": ("chars",),
    }

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(module, (query (2, 3), words (2, 4, 4), chars (2, 7, 5)), masks)."""
        words, chars = example_tensor(2, 4, 4, seed=2), example_tensor(2, 7, 5, seed=3)
        kwargs = {
            "word_mask": masks.from_lengths(torch.tensor([4, 2]), 4),
            "char_mask": masks.from_lengths(torch.tensor([3, 7]), 7),
        }
        return cls(3, 4, 5, 6), (example_tensor(2, 3, seed=1), words, chars), kwargs

    def taxonomy_tags(self) -> list:
        return [tx.FeatureLevels.ATTENTION_VIA_ATTENTION]

    def forward(
        self,
        query: Tensor,
        words: Tensor,
        chars: Tensor,
        word_mask: Tensor | None = None,
        char_mask: Tensor | None = None,
    ) -> ViaAttentionOutput:
        """query (B, M, d_q) or (B, d_q); words (B, n_w, d_word); chars (B, n_c, d_char);
        word_mask (B, n_w) or (B, 1, n_w), char_mask (B, n_c) or (B, 1, n_c) boolean (True = a
        real word / character).

        Returns (output (…, d_word + d_char), word weights, char weights).
        """
        query = checks.tensor(query, "query", min_dim=2)
        if query.dim() > 3 or query.shape[-1] != self.d_q:
            raise ValueError(
                f"query must be (B, M, d_q) or (B, d_q) with d_q = {self.d_q}, got shape "
                f"{tuple(query.shape)}"
            )
        words = checks.features(words, "words", self.d_word, what="d_word")
        chars = checks.features(chars, "chars", self.d_char, what="d_char")
        checks.same_batch(("query", query), ("words", words), ("chars", chars))
        checks.part_matches(self, "AttentionViaAttention", "query", query)
        word_mask = checks.feature_mask(word_mask, words, "word_mask", "words")
        char_mask = checks.feature_mask(char_mask, chars, "char_mask", "chars")
        words = checks.without_padding(words, word_mask)
        chars = checks.without_padding(chars, char_mask)
        squeeze = query.dim() == 2
        q = query.unsqueeze(-2) if squeeze else query
        w = self.word(q, words, mask=key_mask(word_mask), need_weights=True)
        q_c = torch.cat([q, w.context], dim=-1)
        c = self.char(q_c, chars, mask=key_mask(char_mask), need_weights=True)
        out = torch.cat([w.context, c.context], dim=-1)
        if squeeze:
            return ViaAttentionOutput(out.squeeze(-2), w.weights.squeeze(-2), c.weights.squeeze(-2))
        return ViaAttentionOutput(out, w.weights, c.weights)


class HierarchicalOutput(NamedTuple):
    """Document vector (B, d), sentence vectors (B, S, d), word weights (B, S, W), sentence
    weights (B, S)."""

    document: Tensor
    sentences: Tensor
    word_weights: Tensor
    sentence_weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.document

    def named_weights(self) -> dict[str, Tensor]:
        return {"word_weights": self.word_weights, "sentence_weights": self.sentence_weights}


@REGISTRY.register("hierarchical")
class HierarchicalAttention(nn.Module):
    """Words → sentence vectors → document vector, self-attentive at each level (Yang et al.;
    Brauwers Fig. 8): c⁽ˢ⁾ = attention over sentence s's words; c⁽ᴰ⁾ = attention over the c⁽ˢ⁾.

    Documents are (B, S, W, d) with ``word_mask`` (B, S, W): a variable number of words per
    sentence and, through empty sentences, of sentences per document. Padding never leaks: a
    sentence with no word has no weight at the document level.

    Args:
        d: feature size; d_w: hidden size of the additive self-attentive scores (eq. 33).
        word_score, sentence_score: query-free (self-attentive) scores; additive by default.
        sentence_encoder: optional module applied to the sentence vectors (B, S, d) before the
            document level (Yang et al. use a bidirectional GRU); it must keep the size d.
    """

    def __init__(
        self,
        d: int,
        d_w: int = 64,
        *,
        word_score: Score | None = None,
        sentence_score: Score | None = None,
        sentence_encoder: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d=d, d_w=d_w)
        if sentence_encoder is not None and not isinstance(sentence_encoder, nn.Module):
            raise TypeError(
                f"sentence_encoder must be an nn.Module or None, got {sentence_encoder!r}"
            )
        self.d = d
        kw = {"device": device, "dtype": dtype}
        self.word = Attention(
            checks.optional_score(word_score, "word_score") or Additive(None, d, d_w, **kw)
        )
        self.sentence = Attention(
            checks.optional_score(sentence_score, "sentence_score") or Additive(None, d, d_w, **kw)
        )
        self.sentence_encoder = sentence_encoder

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"word_mask": ("words",)}

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(module, (words (2, 3, 4, 4),), a (2, 3, 4) word mask with an empty sentence)."""
        lengths = torch.tensor([[4, 2, 1], [3, 0, 0]])
        mask = masks.from_lengths(lengths.flatten(), 4).reshape(2, 3, 4)
        return cls(4, 5), (example_tensor(2, 3, 4, 4, seed=1),), {"word_mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.FeatureLevels.HIERARCHICAL]

    def forward(self, words: Tensor, word_mask: Tensor | None = None) -> HierarchicalOutput:
        """words (B, S, W, d); word_mask (B, S, W) or (B, S, 1, W) boolean, True = a real word
        (a sentence with no real word is padding)."""
        words = checks.features(words, "words", self.d, rank=4)
        checks.part_matches(self, "HierarchicalAttention", "words", words)
        word_mask = checks.feature_mask(word_mask, words, "word_mask", "words")
        words = checks.without_padding(words, word_mask)
        # Every sentence attends over its words at once: the sentence dim is a batch dim.
        wm = None if word_mask is None else word_mask.unsqueeze(-2)  # (B, S, 1, W)
        level1 = self.word(None, words, mask=wm, need_weights=True)
        sentences = level1.context.squeeze(-2)  # (B, S, d)
        word_weights = level1.weights.squeeze(-2)  # (B, S, W)
        if self.sentence_encoder is not None:
            encoded = self.sentence_encoder(sentences)
            # RNN modules return (output, state): take the output.
            sentences = encoded[0] if isinstance(encoded, tuple) else encoded
        sm = None if word_mask is None else word_mask.any(dim=-1).unsqueeze(-2)  # (B, 1, S)
        level2 = self.sentence(None, sentences, mask=sm, need_weights=True)
        return HierarchicalOutput(
            level2.context.squeeze(-2), sentences, word_weights, level2.weights.squeeze(-2)
        )
