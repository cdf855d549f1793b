"""The digits experiment: attention with a learned query over a small CNN's feature grid
(show-attend-tell style), soft or hard (REINFORCE), on cluttered handwritten digits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.attention import Attention
from attnkit.evaluation import attention_correctness, capture, entropy, uniform_weights
from attnkit.experiments.config import RunConfig
from attnkit.experiments.parts import build_attention, task_loss
from attnkit.tasks.digits import box_region, make_digits

__all__ = ["DigitsModel", "DigitsTask"]

GRID = 12  # 48 / 4


class DigitsModel(nn.Module):
    """CNN (two conv + pool stages) -> 12×12 grid of d-dim annotations; a learned query
    attends over the grid; a linear layer classifies the context."""

    def __init__(self, d: int, attention: Attention) -> None:
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, d, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(d, d, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.query = nn.Parameter(torch.randn(1, 1, d) / d**0.5)
        self.attention = attention
        self.out = nn.Linear(d, 10)

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def forward(self, images: Tensor):
        grid = self.cnn(images).flatten(2).transpose(1, 2)  # (B, 144, d)
        q = self.query.expand(grid.shape[0], 1, -1)
        out = self.attention(q, grid, need_weights=True)
        logits = self.out(out.context.squeeze(1))
        log_prob = None if out.log_prob is None else out.log_prob.squeeze(-1)
        return logits, out.weights.squeeze(1), log_prob


class DigitsTask:
    name = "digits"

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.data = make_digits(config.n_train, config.n_test, seed=config.seed)
        self.train = self.data.splits["train"]

    def build_model(self) -> DigitsModel:
        c = self.config
        d = c.d_model // 2
        return DigitsModel(d, build_attention(c.score, c.align, d))

    def n_train(self) -> int:
        return self.train["labels"].shape[0]

    def loss(self, model, index: Tensor) -> Tensor:
        logits, _, log_prob = model(self.train["images"][index])
        per_item = F.cross_entropy(logits, self.train["labels"][index], reduction="none")
        return task_loss(per_item, log_prob)

    @torch.no_grad()
    def evaluate(self, model, split_name: str = "test") -> dict[str, float]:
        model.eval()
        split = self.data.splits[split_name]
        logits, weights, _ = model(split["images"])
        acc = float((logits.argmax(-1) == split["labels"]).float().mean())
        region = box_region(split["boxes"], self.data.canvas, GRID)
        metrics = {
            "accuracy": acc,
            "attention_correctness": attention_correctness(weights, region),
            "entropy": entropy(weights),
        }
        with uniform_weights(model):
            ablated, _, _ = model(split["images"])
        metrics["uniform_ablation_accuracy"] = float(
            (ablated.argmax(-1) == split["labels"]).float().mean()
        )
        metrics["uniform_ablation_drop"] = acc - metrics["uniform_ablation_accuracy"]
        return metrics

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        model.eval()
        split = self.data.splits["test"]
        with capture(model) as records:
            logits, _, _ = model(split["images"][:n])
        weights = next(iter(records.values()))[0].squeeze(1)
        region = box_region(split["boxes"][:n], self.data.canvas, GRID)
        out = []
        for i in range(n):
            out.append(
                {
                    "title": (
                        f"label {int(split['labels'][i])}, predicted {int(logits[i].argmax())}"
                    ),
                    "weights": weights[i].reshape(GRID, GRID).numpy(),
                    "image": split["images"][i, 0].numpy(),
                    "gold": region[i].reshape(GRID, GRID).numpy(),
                }
            )
        return out
