"""The ``text`` task: classify the user's own texts, so attention variants can be compared on
their data with ``attnkit run text --data FILE --compare align=softmax,sparsemax``.

The file is JSON Lines (one object per line with ``text`` and ``label``) or CSV with a header row
naming ``text`` and ``label`` columns; an optional ``split`` field (``train``, ``validation``,
``test``) fixes the splits, otherwise the rows are shuffled with the run's seed and cut 80 / 10 /
10. Labels may be strings or numbers; they are numbered in sorted order. A CSV row with more or
fewer fields than the header (a text with an unquoted comma) is refused naming its line, and so
is data whose training split has fewer than two labels, or whose split comes out empty. Words
are lower-cased runs of letters and digits or single punctuation marks; the vocabulary is built
from the training split (words seen fewer than twice there become ``<unk>``), and texts are cut to
``seq_len`` words. ``n_train`` and ``n_test`` cap the number of training and test rows used.

The model is the one of the ``rationale`` task (Jain & Wallace's classifier: embeddings, a
residual width-3 convolution, attention with a learned query, a linear layer), with as many
outputs as there are labels. There is no gold attention, so the attention is described (entropy,
what uniform weights cost) rather than scored.
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.evaluation import capture, entropy, uniform_weights
from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.parts import build_attention, task_loss
from attnkit.tasks.rationale_task import RationaleModel

__all__ = ["TextData", "TextTask", "checked_splits", "read_examples", "tokenize"]

PAD, UNK = "<pad>", "<unk>"
SPLITS = ("train", "validation", "test")
_WORD = re.compile(r"[^\W_]+|[^\w\s]", re.UNICODE)


def tokenize(text: str) -> list[str]:
    """Lower-cased words (runs of letters and digits) and single punctuation marks."""
    return _WORD.findall(text.lower())


def read_examples(path: str | Path) -> list[dict[str, str]]:
    """Rows of ``text``, ``label`` and optional ``split`` from a JSONL or CSV file.

    Raises ValueError naming the file and line for anything it cannot use.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: {str(path)!r} is not a file")
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise ValueError(f"data: {str(path)!r} must end in .jsonl or .csv, got {suffix!r}")
    rows: list[dict[str, Any]] = []
    try:
        with path.open(encoding="utf-8", newline="") as f:
            if suffix == ".csv":
                reader = csv.DictReader(f)
                missing = {"text", "label"} - set(reader.fieldnames or ())
                if missing:
                    raise ValueError(
                        f"data: {path}: the header must name the columns text and label "
                        f"(missing {', '.join(sorted(missing))}; found {reader.fieldnames})"
                    )
                rows = [_csv_row(r, reader, path) for r in reader]
            else:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        item = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"data: {path}:{i}: not JSON ({err.msg})") from None
                    if not isinstance(item, dict):
                        raise ValueError(f"data: {path}:{i}: expected an object, got {item!r:.60}")
                    rows.append(dict(item, line=i))
    except UnicodeDecodeError as err:
        raise ValueError(f"data: {path}: not UTF-8 text ({err.reason})") from None
    out = []
    for r in rows:
        where = f"data: {path}:{r['line']}"
        text, label = r.get("text"), r.get("label")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: 'text' must be a non-empty string, got {text!r:.60}")
        if label is None or isinstance(label, bool | dict | list) or str(label) == "":
            raise ValueError(f"{where}: 'label' must be a string or a number, got {label!r:.60}")
        split = r.get("split") or None
        if split is not None and split not in SPLITS:
            raise ValueError(f"{where}: 'split' must be one of {', '.join(SPLITS)}, got {split!r}")
        out.append({"text": text, "label": str(label), "split": split})
    if not out:
        raise ValueError(f"data: {path} holds no examples")
    return out


def _csv_row(row: dict, reader: csv.DictReader, path: Path) -> dict:
    """A CSV record with its line; ValueError naming the line when it has more or fewer
    fields than the header (an unquoted comma in a text moves words into the label)."""
    names = reader.fieldnames or []
    extra = row.get(None) or []
    missing = [k for k in names if row.get(k) is None]
    if extra or missing:
        found = len(names) + len(extra) - len(missing)
        raise ValueError(
            f"data: {path}:{reader.line_num}: {found} fields, but the header names "
            f"{len(names)} ({', '.join(names)}); a text with a comma must be in double quotes "
            '("good, not great")'
        )
    return dict(row, line=reader.line_num)


@dataclass(frozen=True)
class TextData:
    """``words`` (id -> word), ``labels`` (id -> label) and ``splits[name]`` with ``tokens``
    (B, N) long, ``keep`` (B, N) bool and ``labels`` (B,) long."""

    words: list[str]
    labels: list[str]
    splits: dict[str, dict[str, Tensor]]


def _assign_splits(rows: list[dict], seed: int) -> dict[str, list[dict]]:
    if any(r["split"] for r in rows):
        if not all(r["split"] for r in rows):
            raise ValueError("data: either every row names its split or none does")
        return {s: [r for r in rows if r["split"] == s] for s in SPLITS}
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = n_test = max(1, len(rows) // 10)
    shuffled = [rows[i] for i in order]
    return {
        "test": shuffled[:n_test],
        "validation": shuffled[n_test : n_test + n_val],
        "train": shuffled[n_test + n_val :],
    }


def checked_splits(
    path: str | Path, rows: list[dict], *, n_train: int, n_test: int, seed: int = 0
) -> dict[str, list[dict]]:
    """The rows of each split (``n_train`` and ``n_test`` cap training and test); ValueError
    naming the file for an empty split, fewer than two labels in training, or a label that
    only other splits have."""
    parts = _assign_splits(rows, seed)
    parts["train"], parts["test"] = parts["train"][:n_train], parts["test"][:n_test]
    for name in SPLITS:
        if not parts[name]:
            why = (
                f"no row has split {name!r}"
                if rows[0]["split"]
                else f"{len(rows)} row{'' if len(rows) == 1 else 's'} cannot be cut 80 / 10 / "
                "10 into three non-empty splits"
            )
            raise ValueError(f"data: {path}: the {name} split is empty ({why})")
    labels = sorted({r["label"] for r in parts["train"]})
    if len(labels) < 2:
        raise ValueError(
            f"data: {path}: every training text has the label {labels[0]!r}; a classifier "
            "needs at least 2 labels"
        )
    for name, split in parts.items():
        unseen = sorted({r["label"] for r in split} - set(labels))
        if unseen:
            raise ValueError(
                f"data: {path}: the {name} split has labels not in training: {unseen[:5]}"
            )
    return parts


def make_text_data(
    path: str | Path, *, seq_len: int, n_train: int, n_test: int, seed: int = 0
) -> TextData:
    """Read, split, tokenise and number the examples of ``path`` (see the module docstring)."""
    rows = read_examples(path)
    parts = checked_splits(path, rows, n_train=n_train, n_test=n_test, seed=seed)
    counts = Counter(w for r in parts["train"] for w in tokenize(r["text"]))
    words = [PAD, UNK, *sorted(w for w, c in counts.items() if c >= 2)]
    ids = {w: i for i, w in enumerate(words)}
    labels = sorted({r["label"] for r in parts["train"]})
    label_ids = {lab: i for i, lab in enumerate(labels)}
    splits = {}
    for name, rows in parts.items():
        tokens = torch.zeros(len(rows), seq_len, dtype=torch.long)
        keep = torch.zeros(len(rows), seq_len, dtype=torch.bool)
        for i, r in enumerate(rows):
            row = [ids.get(w, 1) for w in tokenize(r["text"])][:seq_len] or [1]
            tokens[i, : len(row)] = torch.tensor(row)
            keep[i, : len(row)] = True
        y = torch.tensor([label_ids[r["label"]] for r in rows])
        splits[name] = {"tokens": tokens, "keep": keep, "labels": y}
    return TextData(words, labels, splits)


def macro_f1(predicted: Tensor, target: Tensor, n_classes: int) -> float:
    """Unweighted mean over classes of F1 = 2·TP / (2·TP + FP + FN) (classes absent from both
    the predictions and the targets are left out)."""
    scores = []
    for c in range(n_classes):
        tp = int(((predicted == c) & (target == c)).sum())
        fp = int(((predicted == c) & (target != c)).sum())
        fn = int(((predicted != c) & (target == c)).sum())
        if tp + fp + fn:
            scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


@REGISTRY.register("text")
class TextTask(Task):
    description = (
        "classify your own texts (--data FILE: JSONL or CSV with text and label); attention "
        "with a learned query over the words"
    )
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 8, "n_train": 1_000_000, "n_test": 1_000_000, "batch_size": 32,
                 "lr": 3e-3, "d_model": 64, "seq_len": 128},
        "quick": {"epochs": 3, "n_train": 5000, "n_test": 1000, "batch_size": 32, "lr": 5e-3,
                  "d_model": 32, "seq_len": 64},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric("share of test texts classified right"),
        "macro_f1": Metric("F1 averaged over the labels (each label counts the same)"),
        "entropy": Metric("mean entropy of the attention weights in nats (lower: sharper)", None),
        "uniform_ablation_drop": Metric(
            "accuracy lost when the attention is replaced by uniform weights", None
        ),
    }
    reads_data = True

    @classmethod
    def example_settings(cls, directory: Any) -> dict[str, Any]:
        """A generated file of 200 short texts whose label is decided by one keyword."""
        g = torch.Generator().manual_seed(0)
        cues, filler = (("bad", "poor"), ("good", "fine")), ("the", "film", "was", "plot", "and")
        lines = []
        for _ in range(200):
            label = int(torch.randint(0, 2, (1,), generator=g))
            words = [filler[int(i)] for i in torch.randint(0, len(filler), (6,), generator=g)]
            cue = cues[label][int(torch.randint(0, 2, (1,), generator=g))]
            words.insert(int(torch.randint(0, 7, (1,), generator=g)), cue)
            lines.append(json.dumps({"text": " ".join(words), "label": ("neg", "pos")[label]}))
        path = Path(directory) / "example_texts.jsonl"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return {"data": str(path)}

    @classmethod
    def validate(cls, config: Any) -> None:
        if getattr(config, "data", None) is None:
            raise ValueError("data: task 'text' needs --data FILE (JSONL or CSV)")
        rows = read_examples(config.data)
        checked_splits(
            config.data, rows, n_train=config.n_train, n_test=config.n_test, seed=config.seed
        )

    def __init__(self, config) -> None:
        super().__init__(config)
        self.data = make_text_data(
            config.data,
            seq_len=config.seq_len,
            n_train=config.n_train,
            n_test=config.n_test,
            seed=config.seed,
        )
        self.train = self.data.splits["train"]
        if self.n_train() < config.batch_size:
            raise ValueError(
                f"batch_size {config.batch_size} is larger than the {self.n_train()} training "
                "texts: no training step would run"
            )

    def build_model(self) -> RationaleModel:
        d = self.config.d_model
        attention = build_attention(self.config.score, self.config.align, d, self.config.seq_len)
        return RationaleModel(len(self.data.words), d, attention, len(self.data.labels))

    def n_train(self) -> int:
        return self.train["labels"].shape[0]

    def has_split(self, name: str) -> bool:
        return name in self.data.splits

    def objective(self, model, index: Tensor) -> Tensor:
        b = self.train
        logits, _, log_prob = model(b["tokens"][index], b["keep"][index])
        per_item = F.cross_entropy(logits, b["labels"][index], reduction="none")
        return task_loss(per_item, log_prob)

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.data.splits[split]
        logits, weights, _ = model(data["tokens"], data["keep"])
        predicted = logits.argmax(-1)
        acc = float((predicted == data["labels"]).float().mean())
        with uniform_weights(model):
            ablated, _, _ = model(data["tokens"], data["keep"])
        return {
            "accuracy": acc,
            "macro_f1": macro_f1(predicted, data["labels"], len(self.data.labels)),
            "entropy": entropy(weights),
            "uniform_ablation_drop": acc
            - float((ablated.argmax(-1) == data["labels"]).float().mean()),
        }

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """New texts as the model reads them: ``tokens`` (B, seq_len) word ids (words not in the
        training vocabulary are ``<unk>``) and ``keep`` (B, seq_len), as the splits are made."""
        ids = {w: i for i, w in enumerate(self.data.words)}
        n = self.config.seq_len
        tokens = torch.zeros(len(texts), n, dtype=torch.long)
        keep = torch.zeros(len(texts), n, dtype=torch.bool)
        for i, text in enumerate(texts):
            row = [ids.get(w, 1) for w in tokenize(text)][:n] or [1]
            tokens[i, : len(row)] = torch.tensor(row)
            keep[i, : len(row)] = True
        return tokens, keep

    @torch.no_grad()
    def predict(self, model, inputs: list[str]) -> list[dict[str, Any]]:
        """Each text's predicted label, the probability of every label, and the attention
        weight of each word the model read (``<unk>`` for words it never saw in training)."""
        model.eval()
        tokens, keep = self.encode(inputs)
        logits, weights, _ = model(tokens, keep)
        probs = logits.softmax(-1)
        out = []
        for i, text in enumerate(inputs):
            length = int(keep[i].sum())
            out.append(
                {
                    "input": text,
                    "prediction": self.data.labels[int(probs[i].argmax())],
                    "probabilities": dict(zip(self.data.labels, probs[i].tolist(), strict=True)),
                    "tokens": [self.data.words[t] for t in tokens[i, :length].tolist()],
                    "attention": weights[i].reshape(-1)[:length].tolist(),
                }
            )
        return out

    @torch.no_grad()
    def report_tables(self, model) -> list[dict]:
        """The test split's confusion matrix and per-label precision, recall and F1."""
        from attnkit.experiments.report import classification_tables

        model.eval()
        data = self.data.splits["test"]
        logits, _, _ = model(data["tokens"], data["keep"])
        return classification_tables(data["labels"], logits.argmax(-1), self.data.labels)

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        """Held-out texts: one row of weights over the words (no gold)."""
        model.eval()
        split = self.data.splits["test"]
        with capture(model) as records:
            logits, _, _ = model(split["tokens"][:n], split["keep"][:n])
        weights = next(iter(records.values()))[0].squeeze(1)
        out = []
        for i in range(min(n, split["labels"].shape[0])):
            keep = split["keep"][i]
            length = int(keep.sum())
            label = self.data.labels[int(split["labels"][i])]
            guess = self.data.labels[int(logits[i].argmax())]
            out.append(
                {
                    "title": f"label {label}, predicted {guess}",
                    "weights": weights[i, :length].unsqueeze(0).numpy(),
                    "gold": torch.zeros(1, length, dtype=torch.bool).numpy(),
                    "x_labels": [self.data.words[t] for t in split["tokens"][i, :length]],
                    "y_labels": ["query"],
                    "x_title": "word",
                    "y_title": "learned query",
                }
            )
        return out
