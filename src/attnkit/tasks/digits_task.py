"""The ``digits`` task: attention with a learned query over a small CNN's feature grid
(show-attend-tell style), soft or hard (REINFORCE), on cluttered handwritten digits; with
``--attention vit``, a Vision Transformer on 4×4 patches (the same 12×12 grid) instead; with
``--attention ram``, the recurrent attention model of Mnih et al. 2014 (a sequence of glimpses,
the location policy trained by REINFORCE), and ``--attention ram_centre`` the same model with
every glimpse at the canvas centre (its centre-crop baseline)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import alignments, arguments, hooks
from attnkit import taxonomy as tx
from attnkit.alignments.base import Alignment, AlignOutput
from attnkit.core import Attention
from attnkit.evaluation import attention_correctness, capture, entropy, uniform_weights
from attnkit.models.vit import ViT
from attnkit.tasks.base import REGISTRY, Metric, Task, Unused
from attnkit.tasks.digits import box_region, make_digits
from attnkit.tasks.parts import build_attention, task_loss
from attnkit.vision import RecurrentAttention

__all__ = ["DigitsModel", "DigitsRAM", "DigitsTask", "DigitsViT"]

GRID = 12  # 48 / 4
RAM_GRID = 7  # glimpse centres: 7 × 7 cells about 7 pixels wide; row and column 3: the centre


@arguments.renamed(d="embed_dim")
class DigitsModel(nn.Module):
    """CNN (two conv + pool stages) -> 12×12 grid of ``embed_dim``-dim annotations; a learned
    query attends over the grid; a linear layer classifies the context."""

    def __init__(self, embed_dim: int, attention: Attention) -> None:
        super().__init__()
        self.cnn = nn.Sequential(
            nn.Conv2d(1, embed_dim, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(embed_dim, embed_dim, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.query = nn.Parameter(torch.randn(1, 1, embed_dim) / embed_dim**0.5)
        self.attention = attention
        self.out = nn.Linear(embed_dim, 10)

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def forward(self, images: Tensor):
        grid = self.cnn(images).flatten(2).transpose(1, 2)  # (B, 144, d)
        q = self.query.expand(grid.shape[0], 1, -1)
        out = self.attention(q, grid, need_weights=True)
        logits = self.out(out.context.squeeze(1))
        log_prob = None if out.log_prob is None else out.log_prob.squeeze(-1)
        return logits, out.weights.squeeze(1), log_prob


@arguments.renamed(d="embed_dim", heads="num_heads")
class DigitsViT(nn.Module):
    """A ViT (:class:`attnkit.models.vit.ViT`) on 4×4 patches of the 48×48 canvas: 12×12 patches,
    the grid of :class:`DigitsModel`. Its weights for the metrics are the class token's attention
    over the patches in the last layer, averaged over heads and renormalised over the patches
    (its weight on itself left out). ``score`` and ``align`` are its heads' (names); ViT's own
    is ``scaled_dot`` with ``softmax``."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int = 4,
        layers: int = 2,
        *,
        score: str = "scaled_dot",
        align: str = "softmax",
    ) -> None:
        super().__init__()
        self.vit = ViT(
            4 * GRID, 4, 1, 10, embed_dim=embed_dim, num_heads=num_heads, layers=layers,
            d_ff=2 * embed_dim,
            score=score, align=align,
        )  # fmt: skip

    def forward(self, images: Tensor):
        if self.training and not hooks.listening():  # training reads the logits only (SDPA)
            return self.vit(images).logits, None, None
        with hooks.listen() as reports:  # the layers' weights, read here, not by the caller
            logits = self.vit(images).logits
        last = reports[-1].weights  # (B, H, 1 + P, 1 + P), detached
        cls = last[:, :, 0, 1:].mean(1)
        weights = cls / cls.sum(-1, keepdim=True).clamp_min(torch.finfo(cls.dtype).tiny)
        hooks.report(self, weights)
        return logits, weights, None


class _CentreCell(Alignment):
    """Every glimpse at one fixed cell (the canvas centre), whatever the scores: the glimpse
    model that cannot move its eyes, the centre-crop baseline of ``--attention ram_centre``."""

    label = tx.AlignmentKind.GLOBAL

    def __init__(self, cell: int) -> None:
        super().__init__()
        self.cell = cell

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        weights = F.one_hot(torch.full(scores.shape[:-1], self.cell), scores.shape[-1])
        return AlignOutput(weights.to(scores.dtype) + 0 * scores)  # keeps the graph connected


class DigitsRAM(nn.Module):
    """The recurrent attention model (:class:`attnkit.vision.RecurrentAttention`, Mnih et al.
    2014) on the 48×48 canvas: ``glimpses`` glimpses of ``glimpse_size``² pixels at ``scales``
    scales (12, 24, 48: from the centre cell the coarsest covers the whole canvas, and the middle
    one sees the 16×16 digit at its scan's resolution), centred on a :data:`RAM_GRID`² grid of
    cells chosen by the hard (sampled in training, most probable in evaluation) location policy.
    Returns (logits, weights (B, T, cells), log π summed over the glimpses).

    Departures from the paper: the policy is categorical over the cells (the module's), not a
    Gaussian; the first glimpse is chosen by the policy from the zero state (one learned place
    for all images), not fixed; the task's loss gives REINFORCE the reward −cross-entropy with
    the batch mean as baseline (:func:`attnkit.tasks.parts.task_loss`), not 0/1 with a learned
    baseline. ``centre_only``: every glimpse at the centre cell (no location policy), the
    baseline that sees the same retina without moving it."""

    def __init__(
        self,
        hidden: int,
        *,
        glimpses: int = 4,
        grid: int = RAM_GRID,
        glimpse_size: int = 12,
        scales: int = 3,
        centre_only: bool = False,
    ) -> None:
        super().__init__()
        align = _CentreCell((grid // 2) * (grid + 1)) if centre_only else "hard"
        self.ram = RecurrentAttention(
            4 * GRID, 10, glimpses=glimpses, grid=grid, glimpse_size=glimpse_size,
            scales=scales, hidden=hidden, align=align,
        )  # fmt: skip

    def forward(self, images: Tensor):
        out = self.ram(images)
        return out.logits, out.weights, out.log_prob

    def inside(self, boxes: Tensor) -> Tensor:
        """(n, cells) boolean: which cells' glimpse centres (pixels) lie inside each box."""
        centres = self.ram.centres  # (cells, 2) (row, column)
        top, left, h, w = (boxes[:, i : i + 1] for i in range(4))
        rows, cols = centres[:, 0], centres[:, 1]
        return (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)


@REGISTRY.register("digits")
class DigitsTask(Task):
    description = "classify a handwritten digit pasted among clutter; gold region = its box"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 10, "n_train": 6000, "n_test": 1000, "batch_size": 64, "lr": 3e-3,
                 "d_model": 64},
        # The attention first has to find the digit (a plateau of a few epochs at lr 3e-3);
        # 6 epochs at 5e-3 get clearly above chance in about 20 s.
        "quick": {"epochs": 6, "n_train": 2400, "n_test": 300, "batch_size": 32, "lr": 5e-3,
                  "d_model": 64},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric("share of test images whose digit is classified right (chance 0.1)"),
        "attention_correctness": Metric(
            "attention weight that falls on grid cells overlapping the digit's box (ram: share "
            "of the glimpses after the first centred inside the box)"
        ),
        "entropy": Metric("mean entropy of the attention weights in nats (lower: sharper)", None),
        "uniform_ablation_accuracy": Metric(
            "accuracy when the attention is replaced by uniform weights", None
        ),
        "uniform_ablation_drop": Metric(
            "accuracy lost under uniform weights: how much the model relies on its attention",
            None,
        ),
    }

    def __init__(self, config) -> None:
        super().__init__(config)
        self.data = make_digits(
            config.n_train, config.n_test, n_validation=max(1, config.n_test // 2), seed=config.seed
        )
        self.train = self.data.splits["train"]

    attentions: ClassVar[tuple[str, ...]] = ("vit", "ram", "ram_centre")

    @classmethod
    def unused(cls, config) -> dict[str, Unused]:
        if not config.attention.startswith("ram"):
            return {}
        why = (
            "the recurrent attention model places each glimpse by its own location policy (hard, "
            "REINFORCE, Mnih et al. 2014; ram_centre: always the centre), without a score "
            "function or a choice of alignment"
        )
        return {key: Unused(f"--attention {config.attention}", why) for key in ("score", "align")}

    @classmethod
    def validate(cls, config: Any) -> None:
        if config.supervise_attention > 0 and config.attention != "default":
            raise ValueError(
                f"supervise_attention {config.supervise_attention}: attention "
                f"{config.attention!r} has no single weight row over the feature grid to compare "
                "with the digit's box; supervise the default model (attention 'default')"
            )
        if config.attention.startswith("ram") and config.align not in ("softmax", "hard"):
            raise ValueError(
                f"attention {config.attention!r} places each glimpse by its own location policy "
                f"(hard, REINFORCE, Mnih et al. 2014; ram_centre: always the centre); align "
                f"{config.align!r} is not used by it: leave align at its default"
            )
        if config.attention == "vit" and alignments.REGISTRY.get(config.align).stochastic:
            raise ValueError(
                f"align {config.align!r} samples its weights; the ViT (attention=vit) trains by "
                "back-propagation and needs a deterministic alignment"
            )

    def build_model(self) -> nn.Module:
        if self.config.attention == "vit":
            c = self.config
            return DigitsViT(c.d_model, score=c.score, align=c.align)
        if self.config.attention in ("ram", "ram_centre"):
            return DigitsRAM(2 * self.config.d_model, centre_only=self.config.attention != "ram")
        d = self.config.d_model // 2
        return DigitsModel(d, build_attention(self.config.score, self.config.align, d, GRID * GRID))

    def has_split(self, name: str) -> bool:
        return name in self.data.splits

    def n_train(self) -> int:
        return self.train["labels"].shape[0]

    def objective(self, model, index: Tensor) -> Tensor:
        logits, _, log_prob = model(self.train["images"][index])
        per_item = F.cross_entropy(logits, self.train["labels"][index], reduction="none")
        return task_loss(per_item, log_prob)

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, GRID²) bool: the grid cells overlapping the digit's box."""
        boxes = self.data.splits[split]["boxes"][index]
        return box_region(boxes, self.data.canvas, GRID)

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, GRID²): the learned query's weights over the feature grid."""
        return model(self.data.splits[split]["images"][index])[1]

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.data.splits[split]
        logits, weights, _ = model(data["images"])
        acc = float((logits.argmax(-1) == data["labels"]).float().mean())
        if isinstance(model, DigitsRAM):
            # The share of glimpses after the first (a fixed place before anything is seen) whose
            # centre falls inside the digit's box; weights are one-hot in evaluation.
            region = model.inside(data["boxes"]).unsqueeze(1)
            weights = weights[:, 1:]
        else:
            region = box_region(data["boxes"], self.data.canvas, GRID)
        metrics = {
            "accuracy": acc,
            "attention_correctness": attention_correctness(weights, region),
            "entropy": entropy(weights),
        }
        with uniform_weights(model):
            ablated, _, _ = model(data["images"])
        metrics["uniform_ablation_accuracy"] = float(
            (ablated.argmax(-1) == data["labels"]).float().mean()
        )
        metrics["uniform_ablation_drop"] = acc - metrics["uniform_ablation_accuracy"]
        return metrics

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        model.eval()
        split = self.data.splits["test"]
        if isinstance(model, DigitsRAM):
            return self._glimpse_maps(model, split, n)
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
                    "x_title": "grid column (4 pixels each)",
                    "y_title": "grid row",
                    "weights": weights[i].reshape(GRID, GRID).numpy(),
                    "image": split["images"][i, 0].numpy(),
                    "gold": region[i].reshape(GRID, GRID).numpy(),
                }
            )
        return out

    def _glimpse_maps(self, model: DigitsRAM, split: dict[str, Tensor], n: int) -> list[dict]:
        """RAM: how many of the glimpses after the first were centred in each cell."""
        logits, weights, _ = model(split["images"][:n])
        g = model.ram.grid
        region = box_region(split["boxes"][:n], self.data.canvas, g)
        cell = self.data.canvas / g
        return [
            {
                "title": f"label {int(split['labels'][i])}, predicted {int(logits[i].argmax())}",
                "x_title": f"glimpse centre column (cells of {cell:.1f} pixels)",
                "y_title": "glimpse centre row",
                "weights": weights[i, 1:].sum(0).reshape(g, g).numpy(),
                "image": split["images"][i, 0].numpy(),
                "gold": region[i].reshape(g, g).numpy(),
            }
            for i in range(n)
        ]
