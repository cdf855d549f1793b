"""Small models built from attnkit parts, shared by the explanation tests."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import attnkit as ak


class Pooled(nn.Module):
    """Embedded items (B, N, d) -> one learned query attends over them -> linear classifier.

    ``forward(x, keep)`` returns logits (B, C); ``keep`` (B, N) is the attention mask.
    """

    def __init__(self, d: int = 4, classes: int = 3, align: str = "softmax") -> None:
        super().__init__()
        self.attention = ak.Attention(ak.scores.LearnedQuery(d), align)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, classes)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        out = self.attention(None, x, torch.tanh(self.value(x)), mask=keep.unsqueeze(1))
        return self.out(out.context.squeeze(1))


def pooled(seed: int = 0, d: int = 4, classes: int = 3, **kw) -> Pooled:
    torch.manual_seed(seed)
    model = Pooled(d, classes, **kw).double()
    with torch.no_grad():  # sharper attention than at initialisation
        model.attention.score.query.mul_(4.0)
    return model.eval()
