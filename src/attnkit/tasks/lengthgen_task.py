"""The ``lengthgen`` task: does a Transformer trained on short sequences work on longer ones?

Three algorithmic subtasks of digit strings, mixed in one training set and told apart by the
first token: copy (``COPY 3 1 4 = 3 1 4``), reverse (``REV 3 1 4 = 4 1 3``) and addition of two
n-digit numbers written least-significant digit first (``ADD 9 1 + 3 0 = 2 2 0``: 19 + 3 = 22).
Training and in-distribution test strings have n = 1 … L digits; the length test has n = 2L,
longer than anything seen in training. A small decoder-only Transformer (causal, pre-norm) is
trained on the next token of the answer; a test string counts as right when every answer token
is, teacher-forced — which is exactly when greedy decoding reproduces the answer.

The run configuration's ``position`` picks the position scheme (``default``: sinusoidal): an
absolute embedding (``sinusoidal``, ``learned``) is added to the token embeddings, any other
scheme goes into every layer's self-attention. Relative schemes were proposed partly for this
kind of extrapolation (Shaw et al. 2018; Press et al. 2022).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit as ak
from attnkit.evaluation.capture import capture
from attnkit.models.decoder_lm import DecoderLM
from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.parts import build_alignment

__all__ = ["LengthGenTask", "make_lengthgen"]

L = 6  # training lengths 1 … L; the length test uses 2L
LAYERS = 2
PAD, EQ, PLUS = 10, 11, 12
OPS = {"copy": 13, "reverse": 14, "addition": 15}
VOCAB = 16
NAMES = [*map(str, range(10)), "·", "=", "+", "COPY", "REV", "ADD"]


def _example(op: str, digits: list[int], other: list[int]) -> tuple[list[int], list[int]]:
    """(question tokens, answer tokens) of one string."""
    if op == "copy":
        return [OPS[op], *digits, EQ], digits
    if op == "reverse":
        return [OPS[op], *digits, EQ], digits[::-1]
    a = sum(d * 10**i for i, d in enumerate(digits))
    b = sum(d * 10**i for i, d in enumerate(other))
    total = a + b
    answer = [(total // 10**i) % 10 for i in range(len(digits) + 1)]
    return [OPS[op], *digits, PLUS, *other, EQ], answer


def make_lengthgen(n: int, lengths: tuple[int, int], *, seed: int = 0) -> tuple[Tensor, ...]:
    """n strings with n_digits in [lo, hi], subtasks in turn (copy, reverse, addition):
    tokens (n, T) right-padded with PAD, answer (n, T) True at answer tokens, op (n,) the
    subtask index (0 copy, 1 reverse, 2 addition)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    rows, answers, ops = [], [], []
    names = list(OPS)
    for i in range(n):
        op = names[i % 3]
        size = int(torch.randint(lo, hi + 1, (), generator=g))
        digits = torch.randint(0, 10, (2, size), generator=g).tolist()
        question, answer = _example(op, digits[0], digits[1])
        rows.append(question + answer)
        answers.append([False] * len(question) + [True] * len(answer))
        ops.append(i % 3)
    width = max(map(len, rows))
    tokens = torch.full((n, width), PAD, dtype=torch.long)
    is_answer = torch.zeros(n, width, dtype=torch.bool)
    for i, (row, ans) in enumerate(zip(rows, answers, strict=True)):
        tokens[i, : len(row)] = torch.tensor(row)
        is_answer[i, : len(row)] = torch.tensor(ans)
    return tokens, is_answer, torch.tensor(ops)


def _position(config) -> str:
    return "sinusoidal" if config.position == "default" else config.position


@REGISTRY.register("lengthgen")
class LengthGenTask(Task):
    description = (
        f"length generalisation: copy, reverse, add digit strings; train on 1-{L} digits, "
        f"test at {2 * L} (compare --position schemes)"
    )
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"score": "scaled_dot", "epochs": 30, "n_train": 12000, "n_test": 600,
                 "batch_size": 64, "lr": 1e-3, "d_model": 64},
        "quick": {"score": "scaled_dot", "epochs": 15, "n_train": 4000, "n_test": 300,
                  "batch_size": 32, "lr": 2e-3, "d_model": 64},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric(f"share of test strings of 1-{L} digits answered exactly (all three "
                           "subtasks)"),
        "accuracy_2L": Metric(f"share of strings of {2 * L} digits answered exactly"),
        "digit_accuracy_2L": Metric(f"share of answer tokens right on strings of {2 * L} digits "
                                    "(teacher-forced)"),
        **{f"{op}_accuracy": Metric(f"{op}: share of strings of 1-{L} digits answered exactly")
           for op in OPS},
        **{f"{op}_accuracy_2L": Metric(f"{op}: share of strings of {2 * L} digits answered "
                                       "exactly") for op in OPS},
    }  # fmt: skip
    takes_position = True

    @classmethod
    def validate(cls, config) -> None:
        ak.positions.REGISTRY.get(_position(config))  # unknown names: options and the closest
        score = ak.scores.REGISTRY.get(config.score)
        if score.mixes_keys or config.score == "location":
            raise ValueError(
                f"score {config.score!r} cannot be used by a causal language model (it mixes "
                "neighbouring keys or needs a fixed key count); try scaled_dot"
            )

    def __init__(self, config) -> None:
        super().__init__(config)
        s = config.seed
        self.train = make_lengthgen(config.n_train, (1, L), seed=s)
        self.splits = {
            "validation": make_lengthgen(max(config.n_test // 2, 3), (1, L), seed=s + 1),
            "test": make_lengthgen(config.n_test, (1, L), seed=s + 2),
            "long": make_lengthgen(config.n_test, (2 * L, 2 * L), seed=s + 3),
        }
        self.max_len = self.splits["long"][0].shape[1]

    def build_model(self) -> DecoderLM:
        d = self.config.d_model
        heads = 4 if d % 4 == 0 else 2
        name = _position(self.config)
        position: Any = None if name == "none" else name
        if getattr(ak.positions.REGISTRY.get(name), "absolute", False):
            kw = {"max_len": self.max_len} if name == "learned" else {}
            position = ak.positions.build(name, embed_dim=d, **kw)
        return DecoderLM(
            VOCAB,
            d,
            heads,
            LAYERS,
            max_len=self.max_len,
            learned_positions=False,
            position=position,
            score=self.config.score,
            align=build_alignment(self.config.align, d // heads),
        )

    def has_split(self, name: str) -> bool:
        return name in self.splits

    def n_train(self) -> int:
        return self.train[0].shape[0]

    @staticmethod
    def _predict(model, tokens: Tensor, is_answer: Tensor) -> tuple[Tensor, Tensor]:
        """Logits (B, T−1, V) for the next token, and which of them are answer tokens."""
        width = int((tokens != PAD).sum(1).max())
        logits = model(tokens[:, : width - 1])
        return logits, is_answer[:, 1:width]

    def objective(self, model, index: Tensor) -> Tensor:
        tokens, is_answer, _ = (t[index] for t in self.train)
        logits, scored = self._predict(model, tokens, is_answer)
        target = tokens[:, 1 : logits.shape[1] + 1]
        nll = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        return (nll * scored).sum() / scored.sum()

    @torch.no_grad()
    def _right(self, model, data) -> tuple[Tensor, Tensor, Tensor]:
        """(strings answered exactly (B,), right answer tokens, answer tokens)."""
        tokens, is_answer, _ = data
        logits, scored = self._predict(model, tokens, is_answer)
        right = (logits.argmax(-1) == tokens[:, 1 : logits.shape[1] + 1]) & scored
        return (right == scored).all(-1), right.sum(), scored.sum()

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        if split == "validation":
            exact, _, _ = self._right(model, self.splits[split])
            return {"accuracy": float(exact.float().mean())}
        out: dict[str, float] = {}
        for name, suffix in (("test", ""), ("long", "_2L")):
            data = self.splits[name]
            exact, right, total = self._right(model, data)
            out[f"accuracy{suffix}"] = float(exact.float().mean())
            if suffix:
                out["digit_accuracy_2L"] = float(right / total)
            for i, op in enumerate(OPS):
                out[f"{op}_accuracy{suffix}"] = float(exact[data[2] == i].float().mean())
        return {key: out[key] for key in self.metrics}

    @torch.no_grad()
    def heatmaps(self, model, n: int = 3) -> list[dict]:
        """The last layer's self-attention (mean over heads) on one length-test string per
        subtask; gold, for copy and reverse: the answer position predicting digit t looks at
        the question digit it copies."""
        model.eval()
        tokens, is_answer, ops = self.splits["long"]
        picks = [int((ops == i).nonzero()[0]) for i in range(3)][:n]
        out = []
        for p in picks:
            row = tokens[p][tokens[p] != PAD]
            size = row.shape[0]
            with capture(model) as records:
                model(row[None, :-1])
            (key,) = [k for k in records if k.startswith(f"decoder.layers.{LAYERS - 1}.self")]
            weights = records[key][0].mean(1)[0]
            gold = torch.zeros(size - 1, size - 1, dtype=torch.bool)
            op = list(OPS)[int(ops[p])]
            start = int(is_answer[p].nonzero()[0])  # first answer token
            digits = start - 2  # COPY d … d =
            if op != "addition":
                for t in range(digits):
                    source = 1 + (t if op == "copy" else digits - 1 - t)
                    gold[start - 1 + t, source] = True
            labels = [NAMES[int(c)] for c in row]
            out.append(
                {
                    "title": f"{op}, {2 * L} digits: who predicts the answer looks where",
                    "weights": weights.numpy(),
                    "gold": gold.numpy(),
                    "x_labels": labels[:-1],
                    "y_labels": [f"→{c}" for c in labels[1:]],
                    "x_title": "attended token",
                    "y_title": "next token predicted",
                }
            )
        return out
