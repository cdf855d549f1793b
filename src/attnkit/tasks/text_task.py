"""The ``text`` task: classify the user's own texts, so attention variants can be compared on
their data with ``attnkit run text --data FILE --compare align=softmax,sparsemax``.

The file is JSON Lines (one object per line with ``text`` and ``label``) or CSV with a header row
naming ``text`` and ``label`` columns; an optional ``split`` field (``train``, ``validation``,
``test``) fixes the splits, otherwise the rows are shuffled with the run's seed and cut 80 / 10 /
10. Labels may be strings or numbers; they are numbered in sorted order. A CSV row with more or
fewer fields than the header (a text with an unquoted comma) is refused naming its line, and so
is data whose training split has fewer than two labels, or whose split comes out empty.

Words (:func:`tokenize`) are lower-cased runs of letters and digits, kept whole across an inner
``-``, ``.`` or ``_`` and with a trailing ``++`` or ``#`` (``utf-8``, ``e-mail``, ``x86_64``,
``3.11``, ``c++``, ``c#``), or single punctuation marks. The vocabulary is built from the
training split: words seen fewer than ``min_count`` times there (the task's setting, default 2:
``--set min_count=1`` keeps every training word) become ``<unk>``. Texts are cut to ``seq_len``
words. ``n_train`` and ``n_test`` cap the number of training and test rows used.

The model is the one of the ``rationale`` task (Jain & Wallace's classifier: embeddings, a
residual width-3 convolution, attention with a learned query, a linear layer), with as many
outputs as there are labels. There is no gold attention, so the attention is described (entropy,
what uniform weights cost) rather than scored.

With ``--pretrained NAME_OR_FOLDER`` (:mod:`attnkit.tasks.text_pretrained`) the model is instead
a pretrained encoder (``minilm``: all-MiniLM-L6-v2, or a local transformers checkpoint) with
every attention layer swapped to ``--score``/``--align`` (default: the scaled dot product and
softmax, which is the original model) and a linear classifier on the mean token state,
fine-tuned together; the texts are cut into the model's own tokens by its tokenizer (``seq_len``
of them, with its special tokens), so ``min_count`` does not apply. Its defaults are those of
fine-tuning (:data:`PRETRAINED_DEFAULTS`: a learning rate of 5e-5, 3 epochs). The heatmaps show
the last layer's weights between the tokens (mean over heads; the report's interactive view has
every layer and head), the entropy is that of every layer's rows, and the uniform ablation makes
every layer attend uniformly.
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

from attnkit import alignments
from attnkit.evaluation import capture, entropy, uniform_weights
from attnkit.tasks import text_pretrained as tp
from attnkit.tasks.base import REGISTRY, Metric, Task, Unused, at_least, setting
from attnkit.tasks.parts import build_attention, task_loss
from attnkit.tasks.rationale_task import RationaleModel
from attnkit.tasks.tables import classification_tables

__all__ = [
    "PRETRAINED_DEFAULTS",
    "TextData",
    "TextSettings",
    "TextTask",
    "checked_splits",
    "read_examples",
    "tokenize",
]

PAD, UNK = "<pad>", "<unk>"
SPLITS = ("train", "validation", "test")
# A word: letters and digits, joined across an inner - . or _ (utf-8, x86_64, 3.11), with a
# trailing ++ or # (c++, c#); else one punctuation mark.
_WORD = re.compile(r"[^\W_]+(?:[-._][^\W_]+)*(?:\+\+|#)?|[^\w\s]", re.UNICODE)
EVAL_BATCH = 64  # texts per forward pass when evaluating


def tokenize(text: str) -> list[str]:
    """Lower-cased words and single punctuation marks; a word is a run of letters and digits,
    kept whole across an inner ``-``, ``.`` or ``_`` and with a trailing ``++`` or ``#``:
    ``tokenize("UTF-8 in C++ on x86_64, Python 3.11.")`` is ``["utf-8", "in", "c++", "on",
    "x86_64", ",", "python", "3.11", "."]``."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class TextSettings:
    """The text task's settings (``attnkit run text --set NAME=VALUE``)."""

    min_count: int = setting(
        2, "training-split count below which a word becomes <unk> (1: keep every word)"
    )

    def __post_init__(self) -> None:
        at_least(self, 1, "min_count")


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
    path: str | Path,
    *,
    seq_len: int,
    n_train: int,
    n_test: int,
    seed: int = 0,
    min_count: int = 2,
    tokenizer: Any = None,
) -> TextData:
    """Read, split, tokenise and number the examples of ``path`` (see the module docstring):
    words seen fewer than ``min_count`` times in training become ``<unk>``; with ``tokenizer``
    (a pretrained model's), its tokens instead."""
    rows = read_examples(path)
    parts = checked_splits(path, rows, n_train=n_train, n_test=n_test, seed=seed)
    if tokenizer is not None:
        return _pretrained_tokens(parts, tokenizer, seq_len)
    counts = Counter(w for r in parts["train"] for w in tokenize(r["text"]))
    words = [PAD, UNK, *sorted(w for w, c in counts.items() if c >= min_count)]
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


def _pretrained_tokens(parts: dict[str, list[dict]], tokenizer: Any, seq_len: int) -> TextData:
    """The splits cut into the tokenizer's tokens (at most ``seq_len`` with its special
    tokens); ``words`` is the tokenizer's vocabulary, by id."""
    labels = sorted({r["label"] for r in parts["train"]})
    label_ids = {lab: i for i, lab in enumerate(labels)}
    splits = {}
    for name, rows in parts.items():
        encoded = tokenizer(
            [r["text"] for r in rows],
            truncation=True,
            max_length=seq_len,
            padding="max_length",
            return_tensors="pt",
        )
        y = torch.tensor([label_ids[r["label"]] for r in rows])
        keep = encoded["attention_mask"].bool()
        splits[name] = {"tokens": encoded["input_ids"], "keep": keep, "labels": y}
    words = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
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


PRETRAINED_DEFAULTS: dict[str, dict[str, Any]] = {
    "full": {"epochs": 3, "n_train": 1_000_000, "n_test": 1_000_000, "batch_size": 16,
             "lr": 5e-5, "d_model": 64, "seq_len": 128, "score": "scaled_dot"},
    "quick": {"epochs": 1, "n_train": 512, "n_test": 256, "batch_size": 16, "lr": 1e-4,
              "d_model": 64, "seq_len": 64, "score": "scaled_dot"},
}  # fmt: skip
"""The text task's defaults with ``--pretrained`` (fine-tuning: a small learning rate, few epochs;
the score is the scaled dot product, which with softmax is the original model's attention;
d_model is not used, the width being the pretrained model's)."""


@REGISTRY.register("text")
class TextTask(Task):
    description = (
        "classify your own texts (--data FILE: JSONL or CSV with text and label); attention "
        "with a learned query over the words, or a pretrained encoder (--pretrained) with its "
        "attention swapped"
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
    takes_pretrained = True
    settings = TextSettings

    @classmethod
    def run_defaults(cls, config: Any) -> dict[str, Any]:
        """:data:`PRETRAINED_DEFAULTS` with ``pretrained``, else the task's ``defaults``."""
        table = PRETRAINED_DEFAULTS if getattr(config, "pretrained", None) else cls.defaults
        return table["quick" if config.quick else "full"]

    @classmethod
    def unused(cls, config: Any) -> dict[str, Unused]:
        if getattr(config, "pretrained", None):
            return {
                "d_model": Unused(
                    f"--pretrained {config.pretrained}", "the width is the pretrained model's"
                )
            }
        return {}

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
        if getattr(config, "pretrained", None):
            cls._validate_pretrained(config)

    @classmethod
    def _validate_pretrained(cls, config: Any) -> None:
        folder = tp.pretrained_folder(config.pretrained)
        longest = tp.encoder_config(folder).get("max_position_embeddings")
        if isinstance(longest, int) and config.seq_len > longest:
            raise ValueError(
                f"seq_len {config.seq_len} is longer than pretrained {config.pretrained!r} "
                f"reads ({longest} positions): give --seq-len {longest} or less"
            )
        given = getattr(config, "settings", None) or {}
        if given.get("min_count", 2) != 2:
            raise ValueError(
                f"setting min_count {given['min_count']} contradicts --pretrained "
                f"{config.pretrained}: the texts are cut by the model's own tokenizer, which has "
                "no <unk> threshold; leave min_count out"
            )
        if config.align is not None and alignments.REGISTRY.get(config.align).stochastic:
            raise ValueError(
                f"align {config.align!r} samples its weights, which needs the REINFORCE term "
                "the text task's own model adds; a swapped pretrained encoder has none: choose "
                "a deterministic alignment"
            )

    def __init__(self, config) -> None:
        super().__init__(config)
        self.pretrained = getattr(config, "pretrained", None)
        self.folder = tp.pretrained_folder(self.pretrained) if self.pretrained else None
        self.data = make_text_data(
            config.data,
            seq_len=config.seq_len,
            n_train=config.n_train,
            n_test=config.n_test,
            seed=config.seed,
            min_count=self.settings.min_count,
            tokenizer=tp.load_tokenizer(self.folder) if self.folder is not None else None,
        )
        self.train = self.data.splits["train"]
        if self.n_train() < config.batch_size:
            raise ValueError(
                f"batch_size {config.batch_size} is larger than the {self.n_train()} training "
                "texts: no training step would run"
            )

    def build_model(self) -> RationaleModel | tp.PretrainedClassifier:
        if self.folder is not None:
            from attnkit.integrations.transformers import swap_attention

            encoder = tp.load_encoder(self.folder)
            score, align = tp.swap_specs(encoder.config, self.config.score, self.config.align)
            swap_attention(encoder, score=score, align=align)
            return tp.PretrainedClassifier(encoder, len(self.data.labels)).train()
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

    def _weights(self, records: dict, keep: Tensor) -> list[Tensor]:
        """The captured attention rows of the tokens that are not padding: one (R, N) per
        layer (per head and query of each text), or the learned query's rows."""
        rows = []
        for calls in records.values():
            w = torch.cat(calls)
            if self.folder is None:
                rows.append(w.reshape(-1, w.shape[-1]))
            else:  # (B, H, N, N): the rows of real queries
                rows.append(w.transpose(1, 2)[keep].reshape(-1, w.shape[-1]))
        return rows

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.data.splits[split]
        logits, ablated, rows = [], [], []
        for start in range(0, data["labels"].shape[0], EVAL_BATCH):
            tokens = data["tokens"][start : start + EVAL_BATCH]
            keep = data["keep"][start : start + EVAL_BATCH]
            with capture(model) as records:
                logits.append(model(tokens, keep)[0])
            rows += self._weights(records, keep)
            ablation = tp.uniform_attention if self.folder is not None else uniform_weights
            with ablation(model):
                ablated.append(model(tokens, keep)[0])
        predicted = torch.cat(logits).argmax(-1)
        acc = float((predicted == data["labels"]).float().mean())
        uniform_acc = float((torch.cat(ablated).argmax(-1) == data["labels"]).float().mean())
        return {
            "accuracy": acc,
            "macro_f1": macro_f1(predicted, data["labels"], len(self.data.labels)),
            "entropy": entropy(torch.cat(rows)),
            "uniform_ablation_drop": acc - uniform_acc,
        }

    def encode(self, texts: list[str]) -> tuple[Tensor, Tensor]:
        """New texts as the model reads them: ``tokens`` (B, seq_len) ids and ``keep``
        (B, seq_len), cut as the splits are (words not in the training vocabulary are
        ``<unk>``; with a pretrained model, its tokenizer's tokens)."""
        n = self.config.seq_len
        if self.folder is not None:
            encoded = tp.load_tokenizer(self.folder)(
                texts, truncation=True, max_length=n, padding="max_length", return_tensors="pt"
            )
            return encoded["input_ids"], encoded["attention_mask"].bool()
        ids = {w: i for i, w in enumerate(self.data.words)}
        tokens = torch.zeros(len(texts), n, dtype=torch.long)
        keep = torch.zeros(len(texts), n, dtype=torch.bool)
        for i, text in enumerate(texts):
            row = [ids.get(w, 1) for w in tokenize(text)][:n] or [1]
            tokens[i, : len(row)] = torch.tensor(row)
            keep[i, : len(row)] = True
        return tokens, keep

    @torch.no_grad()
    def predict(self, model, inputs: list[str]) -> list[dict[str, Any]]:
        """Each text's predicted label, the probability of every label and the tokens the
        model read (``<unk>`` for words it never saw in training), with the learned query's
        weight of each token (``attention``; not for a pretrained encoder, which has a weight
        row per token and head: see the report's heatmaps)."""
        model.eval()
        tokens, keep = self.encode(inputs)
        logits, weights, _ = model(tokens, keep)
        probs = logits.softmax(-1)
        out = []
        for i, text in enumerate(inputs):
            length = int(keep[i].sum())
            item = {
                "input": text,
                "prediction": self.data.labels[int(probs[i].argmax())],
                "probabilities": dict(zip(self.data.labels, probs[i].tolist(), strict=True)),
                "tokens": [self.data.words[t] for t in tokens[i, :length].tolist()],
            }
            if self.folder is None:
                item["attention"] = weights[i].reshape(-1)[:length].tolist()
            out.append(item)
        return out

    @torch.no_grad()
    def report_tables(self, model) -> list[dict]:
        """The test split's confusion matrix and per-label precision, recall and F1."""
        model.eval()
        data = self.data.splits["test"]
        predicted = torch.cat(
            [
                model(data["tokens"][i : i + EVAL_BATCH], data["keep"][i : i + EVAL_BATCH])[0]
                for i in range(0, data["labels"].shape[0], EVAL_BATCH)
            ]
        ).argmax(-1)
        return classification_tables(data["labels"], predicted, self.data.labels)

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        """Held-out texts: the learned query's weights over the words, or with a pretrained
        encoder the last layer's weights between the tokens (mean over heads, every layer and
        head in ``attention``); no gold."""
        model.eval()
        split = self.data.splits["test"]
        with capture(model) as records:
            logits, _, _ = model(split["tokens"][:n], split["keep"][:n])
        layers = [calls[0] for calls in records.values()]
        out = []
        for i in range(min(n, split["labels"].shape[0])):
            length = int(split["keep"][i].sum())
            label = self.data.labels[int(split["labels"][i])]
            guess = self.data.labels[int(logits[i].argmax())]
            tokens = [self.data.words[t] for t in split["tokens"][i, :length]]
            item = {
                "title": f"label {label}, predicted {guess}",
                "x_labels": tokens,
                "x_title": "word",
            }
            if self.folder is None:
                item |= {
                    "weights": layers[0][i, :, :length].reshape(1, length).numpy(),
                    "y_labels": ["query"],
                    "y_title": "learned query",
                }
            else:
                every = torch.stack([w[i, :, :length, :length] for w in layers])
                item |= {
                    "title": item["title"] + f" (last of {len(layers)} layers, mean over heads)",
                    "weights": every[-1].mean(0).numpy(),
                    "attention": every.numpy(),
                    "layer_names": [f"layer {j}" for j in range(len(layers))],
                    "y_labels": tokens,
                    "x_title": "key token",
                    "y_title": "query token",
                }
            item["gold"] = torch.zeros(item["weights"].shape, dtype=torch.bool).numpy()
            out.append(item)
        return out
