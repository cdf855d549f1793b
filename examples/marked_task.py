"""A task of your own for ``attnkit run``: read the token at the marked position.

Each sequence holds ``LENGTH`` tokens (``VOCAB`` kinds) with one position marked; the model must
answer the marked token. It embeds token and mark, scores every position against one learned
query (dot product), takes the softmax-weighted sum and classifies it, so the gold attention is
the marked position. Chance is 1 / ``VOCAB``.

    attnkit run --task-module examples/marked_task.py:MarkedTask --quick
    attnkit run --task-module examples/marked_task.py:MarkedTask --quick --compare lr=0.01,0.03

The class attribute ``name`` is the task's name (``marked``); without it the lowercased class
name would be used.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.tasks import Metric, Task
from attnkit.tasks.base import Unused

VOCAB, LENGTH = 8, 6


def make(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """tokens (n, LENGTH), marks (n, LENGTH) with one 1 per row, the marked positions (n,)."""
    tokens = torch.randint(0, VOCAB, (n, LENGTH), generator=generator)
    where = torch.randint(0, LENGTH, (n,), generator=generator)
    marks = torch.zeros(n, LENGTH, dtype=torch.long)
    marks[torch.arange(n), where] = 1
    return tokens, marks, where


class MarkedModel(nn.Module):
    """Token + mark embeddings, one learned query, softmax attention, a linear classifier."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.token, self.mark = nn.Embedding(VOCAB, embed_dim), nn.Embedding(2, embed_dim)
        self.query = nn.Parameter(torch.randn(embed_dim) / embed_dim**0.5)
        self.out = nn.Linear(embed_dim, VOCAB)

    def forward(self, tokens: Tensor, marks: Tensor) -> tuple[Tensor, Tensor]:
        h = self.token(tokens) + self.mark(marks)  # (B, L, d)
        weights = torch.softmax(h @ self.query, dim=-1)  # (B, L)
        return self.out((weights.unsqueeze(-1) * h).sum(1)), weights


class MarkedTask(Task):
    name = "marked"
    description = "answer the token at the marked position (8 classes) through one learned query"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 10, "batch_size": 32, "lr": 0.01, "d_model": 16, "n_train": 4000,
                 "n_test": 1000},
        "quick": {"epochs": 3, "batch_size": 32, "lr": 0.03, "d_model": 16, "n_train": 640,
                  "n_test": 200},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric(f"share of held-out sequences answered right (chance 1/{VOCAB})"),
        "gold_weight": Metric("mean attention weight on the marked position"),
    }

    @classmethod
    def unused(cls, config: Any) -> dict[str, Unused]:
        # the model has its own dot-product score and softmax: --score and --align are refused
        why = "the model scores with one learned query (dot product) and a softmax"
        return {"score": Unused("task 'marked'", why), "align": Unused("task 'marked'", why)}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        g = torch.Generator().manual_seed(config.seed)
        self.data = {
            "train": make(config.n_train, g),
            "validation": make(config.n_test // 2, g),
            "test": make(config.n_test, g),
        }

    def build_model(self) -> nn.Module:
        return MarkedModel(self.config.d_model)

    def n_train(self) -> int:
        return len(self.data["train"][0])

    def loss(self, model: nn.Module, index: Tensor) -> Tensor:
        tokens, marks, where = (t[index] for t in self.data["train"])
        logits, _ = model(tokens, marks)
        return F.cross_entropy(logits, tokens[torch.arange(len(index)), where])

    def has_split(self, name: str) -> bool:
        return name in ("validation", "test")

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: str) -> dict[str, float]:
        tokens, marks, where = self.data[split]
        logits, weights = model(tokens, marks)
        rows = torch.arange(len(tokens))
        return {
            "accuracy": float((logits.argmax(-1) == tokens[rows, where]).float().mean()),
            "gold_weight": float(weights[rows, where].mean()),
        }

    @torch.no_grad()
    def heatmaps(self, model: nn.Module, n: int = 4) -> list[dict]:
        tokens, marks, where = (t[:n] for t in self.data["test"])
        _, weights = model(tokens, marks)
        items = []
        for i in range(len(tokens)):
            gold = torch.zeros(1, LENGTH, dtype=torch.bool)
            gold[0, where[i]] = True
            marked = zip(tokens[i].tolist(), marks[i].tolist(), strict=True)
            items.append({
                "title": f"test example {i + 1}",
                "weights": weights[i : i + 1].numpy(),
                "gold": gold.numpy(),
                "x_labels": [f"{t}{'*' if m else ''}" for t, m in marked],
                "y_labels": ["answer"],
                "x_title": "input token (* marked)",
                "y_title": "query",
            })  # fmt: skip
        return items
