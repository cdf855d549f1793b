"""The ``copy`` task for the neural Turing machine (Graves et al. 2014, Sec. 4.1): read a
sequence of random bit vectors and a delimiter, then write the sequence back from memory.

Training sequences have 1 … ``MAX_TRAIN`` vectors; the test also measures sequences of
``LONG`` vectors, longer than any seen in training (does the learned algorithm generalise?).
Sequences are padded to a fixed number of steps; only the output steps are scored. The task's
settings (:class:`CopySettings`, ``attnkit run copy --set NAME=VALUE``) change these lengths,
the bits per vector and the NTM's memory locations; the module constants are their defaults.

``attention="lstm"`` (``attnkit run copy --attention lstm``) trains the paper's baseline instead:
an LSTM of the same controller size with no memory and no attention.

Gold attention (``--supervise-attention``, NTM only): the write weighting of input step t on
memory location t and the read weighting of output step t on location t (:func:`copy_gold`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.memory.ntm import NeuralTuringMachine
from attnkit.tasks.base import REGISTRY, Metric, Task, Unused, at_least, setting
from attnkit.tasks.parts import build_alignment

__all__ = ["CopySettings", "CopyTask", "LSTMBaseline", "copy_gold", "make_copy"]

WIDTH = 4  # bits per vector
MAX_TRAIN = 5
LONG = 8
MEMORY = 16  # memory locations of the NTM


@dataclass(frozen=True)
class CopySettings:
    """The settings of ``copy`` (``attnkit run copy --set NAME=VALUE``)."""

    max_train: int = setting(MAX_TRAIN, "longest training sequence, in vectors (from 1)")
    long: int = setting(LONG, "length of the long test sequences (bit_errors_long)")
    width: int = setting(WIDTH, "bits per vector")
    memory: int = setting(MEMORY, "memory locations of the NTM")

    def __post_init__(self) -> None:
        at_least(self, 1)
        if self.memory < self.max_train:
            raise ValueError(
                f"setting memory ({self.memory}) must be >= max_train ({self.max_train}): one "
                "location per vector of a training sequence"
            )


def make_copy(n: int, lengths: tuple[int, int], steps: int, *, seed: int = 0, width: int = WIDTH):
    """n sequences with lengths in [lo, hi]: inputs (n, steps, width + 1) (the last channel is
    the delimiter), targets (n, steps, width), and a (n, steps) mask of the output steps."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    if 2 * hi + 1 > steps:
        raise ValueError(f"steps = {steps} is too few for sequences of length {hi}")
    length = torch.randint(lo, hi + 1, (n,), generator=g)
    bits = torch.randint(0, 2, (n, hi, width), generator=g).float()
    x = torch.zeros(n, steps, width + 1)
    y = torch.zeros(n, steps, width)
    out = torch.zeros(n, steps, dtype=torch.bool)
    for i, n_i in enumerate(length.tolist()):
        x[i, :n_i, :width] = bits[i, :n_i]
        x[i, n_i, width] = 1.0
        y[i, n_i + 1 : 2 * n_i + 1] = bits[i, :n_i]
        out[i, n_i + 1 : 2 * n_i + 1] = True
    return x, y, out


def copy_gold(x: Tensor, out: Tensor, memory_size: int) -> Tensor:
    """The gold memory addressing of the copy task, in one canonical layout: input vector t is
    written to location t, and output step t reads location t (the NTM reads the memory before
    the step's write, Graves et al. Sec. 3). Any layout in which the reads retrace the writes
    copies; this one fixes it, as Graves et al.'s trained NTM wrote consecutive locations.

    Args:
        x: (B, T, WIDTH + 1) inputs, the delimiter in the last channel; out: (B, T) the output
            steps. memory_size: the number of locations.

    Returns:
        (B, 2T, memory_size) bool: rows 0 … T − 1 the write weighting of each step (gold on the
        n input steps only), rows T … 2T − 1 the read weighting of each step (gold on the n
        output steps only); the delimiter and padding steps have no gold.
    """
    b, steps = out.shape
    length = x[..., -1].argmax(-1)  # the delimiter's step: the sequence's length n
    t = torch.arange(steps)
    write_at = t.expand(b, -1)  # step t < n writes location t
    writes = (t < length.unsqueeze(-1)).unsqueeze(-1) & (
        torch.arange(memory_size) == write_at.unsqueeze(-1)
    )
    read_at = (t - length.unsqueeze(-1) - 1).clamp_min(0)  # step n + 1 + j reads location j
    reads = out.unsqueeze(-1) & (torch.arange(memory_size) == read_at.unsqueeze(-1))
    return torch.cat([writes, reads], 1)


class BaselineOutput(NamedTuple):
    outputs: Tensor  # (B, T, d_out) logits


class LSTMBaseline(nn.Module):
    """An LSTM without memory (Graves et al.'s baseline): inputs (B, T, d_in) → logits
    (B, T, d_out) read from the hidden state at every step."""

    def __init__(self, d_in: int, d_out: int, hidden: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(d_in, hidden, batch_first=True)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> BaselineOutput:
        return BaselineOutput(self.out(self.lstm(x)[0]))


@REGISTRY.register("copy")
class CopyTask(Task):
    description = "NTM copy: read random bit vectors, then write them back from memory"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 30, "n_train": 8000, "n_test": 500, "batch_size": 16, "lr": 3e-3,
                 "d_model": 64},
        "quick": {"epochs": 10, "n_train": 4000, "n_test": 300, "batch_size": 16, "lr": 3e-3,
                  "d_model": 64},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "bit_errors": Metric(
            f"wrong bits per test sequence of 1-max_train vectors (1-{MAX_TRAIN} by default; "
            "chance: half the bits)",
            "lower",
        ),
        "bit_errors_long": Metric(
            f"wrong bits per sequence of long vectors ({LONG} by default), longer than any "
            f"trained on (chance: half the bits, {LONG * WIDTH // 2} by default)",
            "lower",
        ),
        "sequence_accuracy": Metric(
            f"share of test sequences (1-max_train, 1-{MAX_TRAIN} by default) copied exactly"
        ),
    }
    attentions: ClassVar[tuple[str, ...]] = ("lstm",)  # the baseline without memory
    settings = CopySettings

    @classmethod
    def unused(cls, config) -> dict[str, Unused]:
        if config.attention == "lstm":
            why = "the LSTM baseline has no memory and no attention"
            return {key: Unused("--attention lstm", why) for key in ("score", "align")}
        why = (
            "the Neural Turing Machine addresses its memory by cosine similarity (Graves et al. "
            "eq. 6); it has no score function to choose"
        )
        return {"score": Unused(f"task {config.task!r}", why)}

    @classmethod
    def validate(cls, config) -> None:
        if config.supervise_attention > 0 and config.attention == "lstm":
            raise ValueError(
                f"supervise_attention {config.supervise_attention}: the LSTM baseline "
                "(--attention lstm) has no memory and no attention to supervise"
            )

    def __init__(self, config) -> None:
        super().__init__(config)
        s = self.settings
        steps, width = 2 * s.max_train + 1, s.width
        self.train = make_copy(
            config.n_train, (1, s.max_train), steps, seed=config.seed, width=width
        )
        self.splits = {
            name: make_copy(
                config.n_test, (1, s.max_train), steps, seed=config.seed + k, width=width
            )
            for k, name in ((1, "validation"), (2, "test"))
        }
        self.long = make_copy(
            config.n_test, (s.long, s.long), 2 * s.long + 1, seed=config.seed + 3, width=width
        )

    def build_model(self) -> nn.Module:
        width = self.settings.width
        if self.config.attention == "lstm":
            return LSTMBaseline(width + 1, width, self.config.d_model)
        return NeuralTuringMachine(
            width + 1,
            width,
            memory_size=self.settings.memory,
            memory_width=8,
            controller_size=self.config.d_model,
            align=build_alignment(self.config.align, 8),
        )

    def has_split(self, name: str) -> bool:
        return name in self.splits

    def n_train(self) -> int:
        return self.train[0].shape[0]

    def objective(self, model, index: Tensor) -> Tensor:
        x, y, out = (t[index] for t in self.train)
        logits = model(x).outputs
        return F.binary_cross_entropy_with_logits(logits[out], y[out])

    def _split(self, split: str) -> tuple[Tensor, Tensor, Tensor]:
        return self.train if split == "train" else self.splits[split]

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, 2T, 1, MEMORY) bool, rows as :meth:`supervised_weights`: see
        :func:`copy_gold`."""
        x, _, out = (t[index] for t in self._split(split))
        return copy_gold(x, out, self.settings.memory).unsqueeze(-2)

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, 2T, H, MEMORY): the write weightings of the T steps, then the read weightings
        of the T steps (every head)."""
        run = model(self._split(split)[0][index])
        return torch.cat([run.write_weights, run.read_weights], 1)

    @staticmethod
    def _errors(model, data) -> tuple[Tensor, Tensor]:
        x, y, out = data
        wrong = ((model(x).outputs > 0) != y.bool()) & out.unsqueeze(-1)
        per_sequence = wrong.sum((1, 2)).float()
        return per_sequence, per_sequence == 0

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        errors, exact = self._errors(model, self.splits[split])
        long_errors, _ = self._errors(model, self.long)
        return {
            "bit_errors": float(errors.mean()),
            "bit_errors_long": float(long_errors.mean()),
            "sequence_accuracy": float(exact.float().mean()),
        }

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        if isinstance(model, LSTMBaseline):
            return []  # no memory, nothing to show
        model.eval()
        x, _, _ = (t[:n] for t in self.splits["test"])
        run = model(x)
        maps = []
        for i in range(min(n, x.shape[0])):
            # write weightings at every step, then read weightings: (2T, N)
            w = torch.cat([run.write_weights[i, :, 0], run.read_weights[i, :, 0]], 0)
            steps = run.write_weights.shape[1]
            maps.append(
                {
                    "title": f"sequence {i}: write (top) and read (bottom) weightings",
                    "weights": w.numpy(),
                    "gold": torch.zeros_like(w, dtype=torch.bool).numpy(),
                    "x_labels": [str(j) for j in range(w.shape[-1])],
                    "y_labels": [f"write {t}" for t in range(steps)]
                    + [f"read {t}" for t in range(steps)],
                    "x_title": "memory location",
                    "y_title": "step",
                }
            )
        return maps
