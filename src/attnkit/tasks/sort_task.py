"""The ``sort`` task for pointer networks (Vinyals et al. 2015, Sec. 4): read 5 to 20 numbers
drawn uniformly from [0, 1) and output them in increasing order, by pointing at the inputs.

The answer is the permutation argsort(x); the gold attention of output step i is the input
holding the i-th smallest number (:meth:`SortTask.gold`). Training uses teacher forcing;
evaluation decodes greedily, each input at most once. ``--supervise-attention`` is refused: a
pointer network's attention is its output, so the supervision would repeat the objective's
likelihood term.

The task's settings (:class:`SortSettings`, ``attnkit run sort --set NAME=VALUE``) change the
list lengths and the range of the numbers; the lists of exactly 5 and 20 numbers of the metrics
``sequence_accuracy_5`` and ``sequence_accuracy_20`` stay (outside the training lengths they
measure length generalisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit as ak
from attnkit import masks
from attnkit.queries.pointer import PointerNetwork
from attnkit.tasks.base import REGISTRY, Metric, Task, setting
from attnkit.tasks.parts import build_alignment, build_score

__all__ = ["SortSettings", "SortTask", "make_sort"]

MIN_LEN, MAX_LEN = 5, 20
FIXED = (5, 20)  # the lengths of the fixed-length test lists (sequence_accuracy_5, _20)


@dataclass(frozen=True)
class SortSettings:
    """The settings of ``sort`` (``attnkit run sort --set NAME=VALUE``)."""

    min_len: int = setting(MIN_LEN, "fewest numbers in a list")
    max_len: int = setting(MAX_LEN, "most numbers in a list")
    high: float = setting(1.0, "the numbers are drawn uniformly from [0, high)")

    def __post_init__(self) -> None:
        if self.min_len < 1:
            raise ValueError(f"setting min_len must be a positive int, got {self.min_len!r}")
        if self.max_len < self.min_len:
            raise ValueError(
                f"setting max_len ({self.max_len}) must be >= min_len ({self.min_len})"
            )
        if not (math.isfinite(self.high) and self.high > 0):
            raise ValueError(f"setting high must be a finite number > 0, got {self.high!r}")


def make_sort(n: int, lengths: tuple[int, int], *, seed: int = 0, high: float = 1.0):
    """n lists with lengths in [lo, hi] of numbers from [0, high): values x (n, hi, 1) (0 where
    padded), a (n, hi) mask of the real values, and targets (n, hi): the indices in increasing
    order of value (0 where padded)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    length = torch.randint(lo, hi + 1, (n,), generator=g)
    keep = masks.from_lengths(length, hi).squeeze(-2)
    x = torch.rand(n, hi, generator=g)
    if high != 1.0:
        x = x * high
    order = x.masked_fill(~keep, float("inf")).argsort(-1)  # padded values sort last
    targets = torch.where(keep, order, torch.zeros((), dtype=torch.long))
    return (x * keep).unsqueeze(-1), keep, targets


@REGISTRY.register("sort")
class SortTask(Task):
    description = "pointer network: sort 5-20 numbers by pointing at them (Vinyals et al.)"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 40, "n_train": 20000, "n_test": 1000, "batch_size": 64, "lr": 5e-3,
                 "d_model": 64},
        "quick": {"epochs": 8, "n_train": 4000, "n_test": 400, "batch_size": 64, "lr": 1e-2,
                  "d_model": 32},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "sequence_accuracy": Metric(f"share of test lists (min_len-max_len numbers, "
                                    f"{MIN_LEN}-{MAX_LEN} by default) sorted exactly"),
        "position_accuracy": Metric("share of output positions holding the right number"),
        "sequence_accuracy_5": Metric("share of lists of 5 numbers sorted exactly"),
        "sequence_accuracy_20": Metric("share of lists of 20 numbers sorted exactly"),
    }  # fmt: skip
    settings = SortSettings

    @classmethod
    def validate(cls, config: Any) -> None:
        if config.supervise_attention > 0:
            raise ValueError(
                f"supervise_attention {config.supervise_attention}: a pointer network's "
                "attention is its output, so KL(gold ‖ weights) is the objective's negative "
                "log-likelihood again; the supervision would only scale the loss (which Adam "
                "undoes): train without it"
            )
        if ak.alignments.REGISTRY.get(config.align).stochastic:
            raise ValueError(
                f"align {config.align!r} samples its weights; the sort task trains the output "
                "distribution by its likelihood and needs a deterministic alignment"
            )

    def __init__(self, config) -> None:
        super().__init__(config)
        s = self.settings
        lengths, high = (s.min_len, s.max_len), s.high
        self.train = make_sort(config.n_train, lengths, seed=config.seed, high=high)
        self.splits = {
            "validation": make_sort(max(config.n_test // 2, 1), lengths, seed=config.seed + 1,
                                    high=high),
            "test": make_sort(config.n_test, lengths, seed=config.seed + 2, high=high),
        }  # fmt: skip
        self.fixed = {
            n: make_sort(config.n_test, (n, n), seed=config.seed + 3 + n, high=high) for n in FIXED
        }

    def build_model(self) -> PointerNetwork:
        d = self.config.d_model
        longest = max(self.settings.max_len, *FIXED)
        score = build_score(self.config.score, head_dim=d, max_len=longest)
        return PointerNetwork(
            1, d, score=score, align=build_alignment(self.config.align, d), exclusive=True
        )

    def has_split(self, name: str) -> bool:
        return name in self.splits

    def n_train(self) -> int:
        return self.train[0].shape[0]

    def _split(self, split: str) -> tuple[Tensor, Tensor, Tensor]:
        return self.train if split == "train" else self.splits[split]

    def objective(self, model, index: Tensor) -> Tensor:
        x, keep, targets = (t[index] for t in self.train)
        return model(x, keep, targets).nll(targets, keep)

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, n, n) bool: output step i points at the input holding the i-th smallest number
        (no gold on the padded steps)."""
        _, keep, targets = (t[index] for t in self._split(split))
        return F.one_hot(targets, keep.shape[-1]).bool() & keep.unsqueeze(-1)

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, n, n): the pointer distribution of every output step, teacher-forced. It is the
        network's output: KL(gold ‖ weights) is the objective's negative log-likelihood."""
        x, keep, targets = (t[index] for t in self._split(split))
        return model(x, keep, targets).weights

    @staticmethod
    @torch.no_grad()
    def _right(model, data) -> tuple[Tensor, Tensor]:
        """(right pointers (B, n) counting only real steps, real steps (B, n))."""
        x, keep, targets = data
        pointers = model(x, keep).pointers
        return (pointers == targets) & keep, keep

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        right, keep = self._right(model, self.splits[split])
        out = {
            "sequence_accuracy": float((right == keep).all(-1).float().mean()),
            "position_accuracy": float(right.sum() / keep.sum()),
        }
        for n, data in self.fixed.items():
            r, k = self._right(model, data)
            out[f"sequence_accuracy_{n}"] = float((r == k).all(-1).float().mean())
        return out

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        model.eval()
        x, keep, targets = (t[:n] for t in self.splits["test"])
        w = model(x, keep).weights
        maps = []
        for i in range(min(n, x.shape[0])):
            length = int(keep[i].sum())
            values = x[i, :length, 0]
            gold = torch.zeros(length, length, dtype=torch.bool)
            gold[torch.arange(length), targets[i, :length]] = True
            maps.append(
                {
                    "title": f"list {i}: output step (row) points at an input (column)",
                    "weights": w[i, :length, :length].numpy(),
                    "gold": gold.numpy(),
                    "x_labels": [f"{v:.2f}" for v in values.tolist()],
                    "y_labels": [str(j + 1) for j in range(length)],
                    "x_title": "input number",
                    "y_title": "output position",
                }
            )
        return maps
