"""A small generated task with a known answer for attention-slot parts: flag retrieval.

Tokens x_1 … x_N (vocabulary 8) with one position flagged; the last position (flagged as the
query) must output the flagged token. One multi-head attention layer over token + flag
embeddings solves it exactly by attending from the query to the flagged key; chance is 1/8.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import attnkit as ak

N, VOCAB, EMBED = 24, 8, 32


def batch(size: int, g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    x = torch.randint(0, VOCAB, (size, N), generator=g)
    pos = torch.randint(0, N - 1, (size,), generator=g)
    flag = torch.zeros(size, N, dtype=torch.long)
    flag[torch.arange(size), pos] = 1
    flag[:, -1] = 2
    return x, flag, x[torch.arange(size), pos]


class FlagModel(nn.Module):
    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.tok, self.flag = nn.Embedding(VOCAB, EMBED), nn.Embedding(3, EMBED)
        self.mha = ak.MultiHeadAttention(EMBED, 2, attention=part)
        self.out = nn.Linear(EMBED, VOCAB)

    def forward(self, x: Tensor, flag: Tensor) -> Tensor:
        h = self.tok(x) + self.flag(flag)
        return self.out(self.mha(h, h, h).context[:, -1])


def flag_retrieval_accuracy(part: nn.Module, steps: int = 600) -> float:
    """Accuracy on 1000 held-out sequences after ``steps`` Adam steps on batches of 64."""
    torch.manual_seed(0)
    model = FlagModel(part)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, flag, y = batch(64, g)
        loss = nn.functional.cross_entropy(model(x, flag), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, flag, y = batch(1000, torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float((model(x, flag).argmax(-1) == y).float().mean())
