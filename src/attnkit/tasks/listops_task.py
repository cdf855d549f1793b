"""``listops`` (Nangia and Bowman, "ListOps: A Diagnostic Dataset for Latent Tree Learning",
NAACL SRW 2018; the Long Range Arena's long version, Tay et al. 2021): classify the value (0-9)
of a nested prefix expression of list operations over digits::

    [MAX 2 9 [MIN 4 7 ] 0 ]  ->  9

Operators: MAX, MIN, MED (median; of an even count, the floor of the mean of the middle two,
as ``int(numpy.median)``) and SM (sum modulo 10). Each operator takes 2 … ``MAX_ARGS``
arguments, nesting at most ``MAX_DEPTH`` deep. An expression is generated to a target length
drawn uniformly from [seq_len / 2, seq_len - 1] tokens (the budget is split at random among an
operator's arguments), prefixed with a classification token and padded to ``seq_len``; its
value is computed by the evaluator below, so every label is known exactly.
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit.tasks.base import REGISTRY, Metric
from attnkit.tasks.long_range import LongRangeTask

__all__ = ["ListOpsTask", "evaluate_listops", "make_listops", "tokens_of"]

OPS = ("MAX", "MIN", "MED", "SM")
MAX_ARGS = 10
MAX_DEPTH = 10
# token ids: padding 0, digits 1-10, operators 11-14, "]" 15, the classification token 16
PAD, CLOSE, CLS = 0, 15, 16
VOCAB = 17
MAX_SEQ_LEN = 4096


def _apply(op: str, values: list[int]) -> int:
    if op == "MAX":
        return max(values)
    if op == "MIN":
        return min(values)
    if op == "SM":
        return sum(values) % 10
    s, m = sorted(values), len(values) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2


def evaluate_listops(tree) -> int:
    """The value of an expression: a digit, or (op, [arguments])."""
    if isinstance(tree, int):
        return tree
    op, args = tree
    return _apply(op, [evaluate_listops(a) for a in args])


def tokens_of(tree) -> list[str]:
    """The expression as tokens: ``["[MAX", "2", "9", "]"]``."""
    if isinstance(tree, int):
        return [str(tree)]
    op, args = tree
    return [f"[{op}", *(t for a in args for t in tokens_of(a)), "]"]


def _grow(budget: int, depth: int, rng: random.Random):
    """An expression of at most ``budget`` tokens."""
    if budget < 4 or depth >= MAX_DEPTH:
        return rng.randrange(10)
    n = rng.randint(2, min(MAX_ARGS, budget - 2))
    cuts = sorted(rng.sample(range(1, budget - 2), n - 1))  # n parts >= 1 summing to budget - 2
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, budget - 2], strict=True)]
    return (rng.choice(OPS), [_grow(s, depth + 1, rng) for s in sizes])


def _ids(tokens: list[str]) -> list[int]:
    out = []
    for t in tokens:
        if t == "]":
            out.append(CLOSE)
        elif t.startswith("["):
            out.append(11 + OPS.index(t[1:]))
        else:
            out.append(1 + int(t))
    return out


def make_listops(n: int, seq_len: int, *, seed: int = 0) -> tuple[Tensor, Tensor]:
    """n expressions: tokens (n, seq_len, 1) (classification token first, padding last) and
    their values (n,)."""
    if seq_len < 8:
        raise ValueError(f"seq_len must be >= 8 for listops, got {seq_len}")
    rng = random.Random(seed)
    tokens = torch.full((n, seq_len, 1), PAD, dtype=torch.long)
    labels = torch.empty(n, dtype=torch.long)
    for i in range(n):
        tree = _grow(rng.randint(seq_len // 2, seq_len - 1), 0, rng)
        ids = [CLS, *_ids(tokens_of(tree))]
        tokens[i, : len(ids), 0] = torch.tensor(ids)
        labels[i] = evaluate_listops(tree)
    return tokens, labels


NAMES = ["pad", *map(str, range(10)), *(f"[{o}" for o in OPS), "]", "cls"]


@REGISTRY.register("listops")
class ListOpsTask(LongRangeTask):
    description = (
        "ListOps (Nangia & Bowman; LRA): value 0-9 of nested MAX/MIN/MED/SM lists, "
        "attention chosen by --attention"
    )
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 10, "n_train": 20000, "n_test": 2000, "batch_size": 32, "lr": 1e-3,
                 "d_model": 64, "seq_len": 512, "score": "scaled_dot"},
        "quick": {"epochs": 3, "n_train": 2000, "n_test": 500, "batch_size": 32, "lr": 2e-3,
                  "d_model": 32, "seq_len": 64, "score": "scaled_dot"},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric("share of test expressions whose value is predicted (10 classes)"),
        "majority_share": Metric(
            "share of the commonest value among the test labels (what always guessing it "
            "scores: the chance level to beat)",
            None,
        ),
    }
    vocab = (VOCAB,)
    classes = 10
    readout = 0

    @classmethod
    def validate(cls, config) -> None:
        if not 8 <= config.seq_len <= MAX_SEQ_LEN:
            raise ValueError(
                f"seq_len must be in [8, {MAX_SEQ_LEN}] for listops, got {config.seq_len}"
            )
        super().validate(config)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.train = make_listops(config.n_train, config.seq_len, seed=config.seed)
        self.splits = {
            name: make_listops(config.n_test // k, config.seq_len, seed=config.seed + 10 + k)
            for k, name in ((2, "validation"), (1, "test"))
        }

    def token_labels(self, tokens: Tensor) -> list[str]:
        return [NAMES[int(t)] for t in tokens[:, 0]]
