"""The ``associative-recall`` task for the neural Turing machine (Graves et al. 2014, Sec. 4.3):
read a list of items, then one of them as a query, and output the item that followed it.

An item is ``ITEM`` random bit vectors of ``WIDTH`` bits; each item is preceded by a step with
the item flag, the query by a step with the query flag, and the answer is expected after a
closing query flag. Training lists have 2 … ``MAX_TRAIN`` items; the test also measures lists of
``LONG`` items, longer than any trained on.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.memory.ntm import NeuralTuringMachine
from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.copy_task import CopyTask, LSTMBaseline
from attnkit.tasks.parts import build_alignment

__all__ = ["AssociativeRecallTask", "make_recall"]

WIDTH = 4
ITEM = 2  # vectors per item
MAX_TRAIN = 4
LONG = 6


def _steps(items: int) -> int:
    """(flag + item) per item, flag + query + flag, then the answer."""
    return items * (ITEM + 1) + ITEM + 2 + ITEM


def make_recall(n: int, lengths: tuple[int, int], steps: int, *, seed: int = 0):
    """n lists with lo … hi items: inputs (n, steps, WIDTH + 2) (the last two channels are the
    item and query flags), targets (n, steps, WIDTH) and a (n, steps) mask of the answer steps."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    if _steps(hi) > steps:
        raise ValueError(f"steps = {steps} is too few for lists of {hi} items")
    x = torch.zeros(n, steps, WIDTH + 2)
    y = torch.zeros(n, steps, WIDTH)
    out = torch.zeros(n, steps, dtype=torch.bool)
    for i in range(n):
        k = int(torch.randint(lo, hi + 1, (1,), generator=g))
        items = torch.randint(0, 2, (k, ITEM, WIDTH), generator=g).float()
        q = int(torch.randint(0, k - 1, (1,), generator=g))  # an item that has a successor
        t = 0
        for item in items:
            x[i, t, WIDTH] = 1.0
            x[i, t + 1 : t + 1 + ITEM, :WIDTH] = item
            t += ITEM + 1
        x[i, t, WIDTH + 1] = 1.0
        x[i, t + 1 : t + 1 + ITEM, :WIDTH] = items[q]
        t += ITEM + 1
        x[i, t, WIDTH + 1] = 1.0
        y[i, t + 1 : t + 1 + ITEM] = items[q + 1]
        out[i, t + 1 : t + 1 + ITEM] = True
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
            f"wrong bits per answer ({ITEM * WIDTH} bits, chance {ITEM * WIDTH // 2}) on lists "
            f"of 2-{MAX_TRAIN} items",
            "lower",
        ),
        "bit_errors_long": Metric(
            f"wrong bits per answer on lists of {LONG} items, longer than any trained on", "lower"
        ),
        "sequence_accuracy": Metric(f"share of answers (lists of 2-{MAX_TRAIN}) exactly right"),
    }
    # No gold attention (the copy task's is not inherited): the answer is read where the item
    # after the query was written, which depends on the layout the NTM chose for the list and
    # on content addressing by the query, not on a fixed location.
    gold = Task.gold
    supervised_weights = Task.supervised_weights

    def __init__(self, config) -> None:
        Task.__init__(self, config)
        steps = _steps(MAX_TRAIN)
        self.train = make_recall(config.n_train, (2, MAX_TRAIN), steps, seed=config.seed)
        self.splits = {
            name: make_recall(config.n_test, (2, MAX_TRAIN), steps, seed=config.seed + k)
            for k, name in ((1, "validation"), (2, "test"))
        }
        self.long = make_recall(config.n_test, (LONG, LONG), _steps(LONG), seed=config.seed + 3)

    def build_model(self) -> nn.Module:
        if self.config.attention == "lstm":  # the baseline without memory
            return LSTMBaseline(WIDTH + 2, WIDTH, self.config.d_model)
        return NeuralTuringMachine(
            WIDTH + 2,
            WIDTH,
            memory_size=32,
            memory_width=12,
            controller_size=self.config.d_model,
            align=build_alignment(self.config.align, 12),
        )

    def objective(self, model, index: Tensor) -> Tensor:
        x, y, out = (t[index] for t in self.train)
        logits = model(x).outputs
        return F.binary_cross_entropy_with_logits(logits[out], y[out])
