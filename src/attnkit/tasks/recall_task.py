"""The ``associative-recall`` task for the neural Turing machine (Graves et al. 2014, Sec. 4.3):
read a list of items, then one of them as a query, and output the item that followed it.

An item is ``ITEM`` random bit vectors of ``WIDTH`` bits; each item is preceded by a step with
the item flag, the query by a step with the query flag, and the answer is expected after a
closing query flag. Training lists have 2 … ``MAX_TRAIN`` items; the test also measures lists of
``LONG`` items, longer than any trained on. The task's settings (:class:`RecallSettings`,
``attnkit run associative-recall --set NAME=VALUE``) change these lengths, the vectors per item,
the bits per vector and the NTM's memory locations; the module constants are their defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.memory.ntm import NeuralTuringMachine
from attnkit.tasks.base import REGISTRY, Metric, Task, at_least, setting
from attnkit.tasks.copy_task import CopyTask, LSTMBaseline
from attnkit.tasks.parts import build_alignment

__all__ = ["AssociativeRecallTask", "RecallSettings", "make_recall"]

WIDTH = 4
ITEM = 2  # vectors per item
MAX_TRAIN = 4
LONG = 6
MEMORY = 32  # memory locations of the NTM


@dataclass(frozen=True)
class RecallSettings:
    """The settings of ``associative-recall`` (``attnkit run associative-recall --set
    NAME=VALUE``)."""

    max_train: int = setting(MAX_TRAIN, "most items in a training list (from 2)")
    long: int = setting(LONG, "items in the long test lists (bit_errors_long)")
    item: int = setting(ITEM, "vectors per item")
    width: int = setting(WIDTH, "bits per vector")
    memory: int = setting(MEMORY, "memory locations of the NTM")

    def __post_init__(self) -> None:
        at_least(self, 1)
        for name in ("max_train", "long"):
            if getattr(self, name) < 2:
                raise ValueError(
                    f"setting {name} must be >= 2 (an item to query and the one after it), "
                    f"got {getattr(self, name)!r}"
                )


def _steps(items: int, item: int = ITEM) -> int:
    """(flag + item) per item, flag + query + flag, then the answer."""
    return items * (item + 1) + item + 2 + item


def make_recall(
    n: int,
    lengths: tuple[int, int],
    steps: int,
    *,
    seed: int = 0,
    item: int = ITEM,
    width: int = WIDTH,
):
    """n lists with lo … hi items of ``item`` vectors of ``width`` bits: inputs (n, steps,
    width + 2) (the last two channels are the item and query flags), targets (n, steps, width)
    and a (n, steps) mask of the answer steps."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    if _steps(hi, item) > steps:
        raise ValueError(f"steps = {steps} is too few for lists of {hi} items")
    x = torch.zeros(n, steps, width + 2)
    y = torch.zeros(n, steps, width)
    out = torch.zeros(n, steps, dtype=torch.bool)
    for i in range(n):
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        items = torch.randint(0, 2, (k, item, width), generator=g).float()
        q = int(torch.randint(0, k - 1, (1,), generator=g))  # an item that has a successor
        t = 0
        for vectors in items:
            x[i, t, width] = 1.0
            x[i, t + 1 : t + 1 + item, :width] = vectors
            t += item + 1
        x[i, t, width + 1] = 1.0
        x[i, t + 1 : t + 1 + item, :width] = items[q]
        t += item + 1
        x[i, t, width + 1] = 1.0
        y[i, t + 1 : t + 1 + item] = items[q + 1]
        out[i, t + 1 : t + 1 + item] = True
    return x, y, out


@REGISTRY.register("associative-recall")
class AssociativeRecallTask(CopyTask):
    description = "NTM associative recall: given a query item, output the item after it"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 40, "n_train": 8000, "n_test": 500, "batch_size": 16, "lr": 3e-3,
                 "d_model": 64},
        "quick": {"epochs": 8, "n_train": 3500, "n_test": 300, "batch_size": 16, "lr": 3e-3,
                  "d_model": 64},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "bit_errors": Metric(
            f"wrong bits per answer (item × width bits, chance half of them; {ITEM * WIDTH} and "
            f"{ITEM * WIDTH // 2} by default) on lists of 2-max_train items (2-{MAX_TRAIN} by "
            "default)",
            "lower",
        ),
        "bit_errors_long": Metric(
            f"wrong bits per answer on lists of long items ({LONG} by default), longer than any "
            "trained on",
            "lower",
        ),
        "sequence_accuracy": Metric(
            f"share of answers (lists of 2-max_train, 2-{MAX_TRAIN} by default) exactly right"
        ),
    }
    settings = RecallSettings
    # No gold attention (the copy task's is not inherited): the answer is read where the item
    # after the query was written, which depends on the layout the NTM chose for the list and
    # on content addressing by the query, not on a fixed location.
    gold = Task.gold
    supervised_weights = Task.supervised_weights

    def __init__(self, config) -> None:
        Task.__init__(self, config)
        s = self.settings
        sizes = {"item": s.item, "width": s.width}
        steps = _steps(s.max_train, s.item)
        self.train = make_recall(config.n_train, (2, s.max_train), steps, seed=config.seed, **sizes)
        self.splits = {
            name: make_recall(config.n_test, (2, s.max_train), steps, seed=config.seed + k, **sizes)
            for k, name in ((1, "validation"), (2, "test"))
        }
        self.long = make_recall(
            config.n_test, (s.long, s.long), _steps(s.long, s.item), seed=config.seed + 3,
            **sizes,
        )  # fmt: skip

    def build_model(self) -> nn.Module:
        width = self.settings.width
        if self.config.attention == "lstm":  # the baseline without memory
            return LSTMBaseline(width + 2, width, self.config.d_model)
        return NeuralTuringMachine(
            width + 2,
            width,
            memory_size=self.settings.memory,
            memory_width=12,
            controller_size=self.config.d_model,
            align=build_alignment(self.config.align, 12),
        )

    def objective(self, model, index: Tensor) -> Tensor:
        x, y, out = (t[index] for t in self.train)
        logits = model(x).outputs
        return F.binary_cross_entropy_with_logits(logits[out], y[out])
