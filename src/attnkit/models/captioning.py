"""Show, attend and tell (Xu et al.): a CNN feature grid attended by an LSTM decoder."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import arguments, checks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.queries.query_types import QueryTagged

__all__ = ["ImageCaptioner"]


@arguments.renamed(d="embed_dim")
class ImageCaptioner(nn.Module):
    """A small CNN gives an (h·w, embed_dim) grid of annotation vectors; an LSTM cell attends
    over it at every step with its state as query (basic), soft (softmax) or hard (sampled)
    alignment.

    The survey calls softmax attention over image regions "soft" (Brauwers 3.2.2), and this
    model reports it so.
    """

    taxonomy_final = (tx.AlignmentKind,)

    def __init__(
        self,
        vocab: int,
        embed_dim: int,
        attention: Attention,
        *,
        channels: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(vocab=vocab, embed_dim=embed_dim, channels=channels)
        if not isinstance(attention, Attention):
            raise TypeError(
                f"attention must be an attnkit Attention, got {type(attention).__name__}"
            )
        kw = {"device": device, "dtype": dtype}
        self.cnn = nn.Sequential(
            nn.Conv2d(channels, embed_dim, 3, padding=1, **kw),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(embed_dim, embed_dim, 3, padding=1, **kw),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.embed = nn.Embedding(vocab, embed_dim, **kw)
        self.cell = nn.LSTMCell(2 * embed_dim, embed_dim, **kw)
        self.attention = QueryTagged(attention, "basic")
        self.out = nn.Linear(2 * embed_dim, vocab, **kw)
        self.channels = channels

    def taxonomy_tags(self) -> list:
        align = self.attention.module.align
        return [tx.AlignmentKind.SOFT if isinstance(align, Softmax) else align.label]

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """images (B, C, H, W), tokens (B, T) -> logits (B, T, V), weights (B, T, h·w), and
        log-probabilities (B, T) of the sampled regions for hard attention (else None)."""
        images = checks.tensor(images, "images", min_dim=4)
        if images.dim() != 4 or images.shape[-3] != self.channels or min(images.shape[-2:]) < 4:
            raise ValueError(
                f"images must be (B, C, H, W) with C = {self.channels} and H, W >= 4, got shape "
                f"{tuple(images.shape)}"
            )
        vocab = self.embed.num_embeddings
        if not isinstance(tokens, Tensor) or tokens.dtype.is_floating_point or tokens.dim() != 2:
            what = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise TypeError(f"tokens must be integer token ids (B, T), got {what}")
        if tokens.shape[0] != images.shape[0] or tokens.shape[1] == 0:
            raise ValueError(
                f"tokens of shape {tuple(tokens.shape)} must have the images' batch size "
                f"{images.shape[0]} and at least one step"
            )
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise ValueError(f"tokens hold ids outside [0, {vocab})")
        checks.part_matches(self, "ImageCaptioner", "images", images)
        grid = self.cnn(images).flatten(2).transpose(1, 2)  # (B, h·w, embed_dim)
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
