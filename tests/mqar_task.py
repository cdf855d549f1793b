"""A small generated task for recurrent attention parts: multi-query associative recall (MQAR,
Arora et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language Models").

A sequence of P key–value pairs k_1 v_1 … k_P v_P (keys distinct, drawn from K key tokens;
values from V value tokens) is followed by the P keys again in another order; at each of those
query positions the model must output the value that was paired with the key. Chance is 1/V.

The model is one multi-head attention layer between token embeddings and a linear read-out. A
recall layer needs, at a value's position, the key just before it: as the short convolutions of
the gated linear-attention layers do, each position's input adds an embedding of the previous
token.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import attnkit as ak

PAIRS, KEYS, VALUES, EMBED, HEADS = 4, 8, 8, 32, 2
VOCAB = KEYS + VALUES  # keys are tokens 0 … K − 1, values K … K + V − 1
LENGTH = 3 * PAIRS


def batch(size: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """Tokens (size, 3P) and targets (size, P): the values the last P positions must recall."""
    keys = torch.stack([torch.randperm(KEYS, generator=g)[:PAIRS] for _ in range(size)])
    values = torch.randint(0, VALUES, (size, PAIRS), generator=g)
    order = torch.stack([torch.randperm(PAIRS, generator=g) for _ in range(size)])
    pairs = torch.stack([keys, values + KEYS], -1).flatten(1)
    queries = keys.gather(1, order)
    return torch.cat([pairs, queries], 1), values.gather(1, order)


class RecallModel(nn.Module):
    def __init__(self, part: nn.Module) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBED)
        self.prev = nn.Embedding(VOCAB + 1, EMBED)  # the token before (VOCAB at the start)
        self.mha = ak.MultiHeadAttention(EMBED, HEADS, attention=part)
        self.out = nn.Linear(EMBED, VALUES)

    def forward(self, tokens: Tensor) -> Tensor:
        before = torch.cat([torch.full_like(tokens[:, :1], VOCAB), tokens[:, :-1]], 1)
        x = self.tok(tokens) + self.prev(before)
        return self.out(self.mha(x).context[:, -PAIRS:])


def recall_accuracy(part: nn.Module, *, steps: int = 200, seed: int = 0) -> float:
    """Accuracy on fresh sequences after ``steps`` Adam steps of training ``part`` on MQAR."""
    torch.manual_seed(seed)
    model = RecallModel(part)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens, target = batch(64, g)
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    tokens, target = batch(512, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        return (model(tokens).argmax(-1) == target).float().mean().item()
