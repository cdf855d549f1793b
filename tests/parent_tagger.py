"""A small tagging model for the checks of attnkit.training: a two-layer Transformer encoder that
tags each token with its parent's anchor class (the parent relation of
:func:`attnkit.training.synthetic.parent_sequences`), and its training with LISA's supervision
on head 0 of layer 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnkit.training.head_supervision import head_supervision_loss
from attnkit.training.synthetic import ParentTask, parent_sequences
from attnkit.transformer import TransformerEncoder

LENGTH, VOCAB, ANCHORS, D, HEADS = 8, 12, 3, 16, 4


class Tagger(nn.Module):
    """Embeddings (token + learned position) → encoder → a class per token."""

    def __init__(self, layers: int = 2, heads: int = HEADS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.position = nn.Parameter(torch.randn(LENGTH, D) * 0.5)
        self.encoder = TransformerEncoder(layers, D, heads, 2 * D, norm_first=True)
        self.out = nn.Linear(D, ANCHORS)

    def inputs(self, tokens: Tensor) -> Tensor:
        return self.embed(tokens) + self.position

    def forward(self, tokens: Tensor) -> Tensor:
        return self.out(self.encoder(self.inputs(tokens)))


def parent_class(task: ParentTask) -> Tensor:
    """The label of each token: its parent's token (an anchor, in [0, ANCHORS)); −100 (ignored
    by cross-entropy) for the first token."""
    cls = task.tokens.gather(1, task.parents.clamp_min(0))
    return torch.where(task.parents >= 0, cls, torch.full_like(cls, -100))


def tag_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def accuracy(logits: Tensor, labels: Tensor) -> float:
    keep = labels >= 0
    return float((logits.argmax(-1) == labels)[keep].float().mean())


@dataclass
class Trained:
    model: Tagger
    train: ParentTask
    test: ParentTask


def train_lisa_tagger() -> Trained:
    """A :class:`Tagger` trained with the tagging loss + LISA's parent loss on layer 0, head 0;
    deterministic, about a second on one CPU core."""
    g = torch.Generator().manual_seed(0)
    train, test = (
        parent_sequences(512, LENGTH, generator=g),
        parent_sequences(256, LENGTH, generator=g),
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Tagger()
        optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
        labels = parent_class(train)
        for _ in range(120):
            i = torch.randint(0, 512, (32,), generator=g)
            hidden, parse = head_supervision_loss(
                model.encoder, model.inputs(train.tokens[i]), train.parents[i], layer=0, head=0
            )
            loss = tag_loss(model.out(hidden), labels[i]) + parse
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
    return Trained(model.eval(), train, test)
