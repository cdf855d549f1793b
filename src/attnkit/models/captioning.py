"""Show, attend and tell (Xu et al.): a CNN feature grid attended by an LSTM decoder."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.attention import Attention
from attnkit.queries.self_attentive import QueryTagged

__all__ = ["ImageCaptioner"]


class ImageCaptioner(nn.Module):
    """A small CNN gives an (h·w, d) grid of annotation vectors; an LSTM cell attends over it at
    every step with its state as query (basic), soft (softmax) or hard (sampled) alignment.

    The survey calls softmax attention over image regions "soft" (Brauwers 3.2.2), and this
    model reports it so.
    """

    taxonomy_final = (tx.AlignmentKind,)

    def __init__(self, vocab: int, d: int, attention: Attention, *, channels: int = 1) -> None:
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(channels, d, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(d, d, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.embed = nn.Embedding(vocab, d)
        self.cell = nn.LSTMCell(2 * d, d)
        self.attention = QueryTagged(attention, "basic")
        self.out = nn.Linear(2 * d, vocab)

    def taxonomy_tags(self) -> list:
        align = self.attention.module.align
        return [tx.AlignmentKind.SOFT if isinstance(align, Softmax) else align.label]

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """images (B, C, H, W), tokens (B, T) -> logits (B, T, V), weights (B, T, h·w), and
        log-probabilities (B, T) of the sampled regions for hard attention (else None)."""
        grid = self.cnn(images).flatten(2).transpose(1, 2)  # (B, h·w, d)
        h = grid.mean(1)
        c = torch.zeros_like(h)
        context = torch.zeros_like(h)
        emb = self.embed(tokens)
        logits, weights, log_probs = [], [], []
        for t in range(tokens.shape[1]):
            h, c = self.cell(torch.cat([emb[:, t], context], -1), (h, c))
            out = self.attention(h.unsqueeze(-2), grid, need_weights=True)
            context = out.context.squeeze(-2)
            logits.append(self.out(torch.cat([h, context], -1)))
            weights.append(out.weights.squeeze(-2))
            if out.log_prob is not None:
                log_probs.append(out.log_prob.squeeze(-1))
        log_prob = torch.stack(log_probs, 1) if log_probs else None
        return torch.stack(logits, 1), torch.stack(weights, 1), log_prob
