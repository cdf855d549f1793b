"""The ``rationale`` task: text classification whose label is decided by planted tokens among
distractors, so every explanation measure can be compared with the truth (the gold rationale).

Each example is a sequence of 8-24 words. One to three *cue* words of one polarity are planted
at random positions; the label is that polarity. The other words are neutral, except *decoys*:
words that appear with one label three times in four but never decide it (a shortcut a model
may also attend to). The gold rationale is the set of planted positions.

The model follows Jain & Wallace's (2019) text classifiers, with a convolutional encoder: word
embeddings, a residual width-3 convolution (so each position sees its neighbours: the encoder
mixes items, as the recurrent encoders under debate do), attention with a learned query, and a
linear classifier on the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.evaluation import (
    attention_correctness,
    capture,
    entropy,
    uniform_weights,
)
from attnkit.evaluation.suite import Probe
from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.parts import build_attention, task_loss

__all__ = ["RationaleData", "RationaleModel", "RationaleTask", "Vocabulary", "make_rationale"]

CUES = (("awful", "poor", "dull", "broken"), ("great", "superb", "lovely", "solid"))
DECOYS = (("grey", "late"), ("bright", "early"))
NEUTRAL = [
    "the",
    "a",
    "it",
    "was",
    "this",
    "that",
    "film",
    "book",
    "plot",
    "cast",
    "scene",
    "story",
    "one",
    "two",
    "with",
    "and",
    "but",
    "of",
    "in",
    "on",
    "for",
    "very",
    "quite",
    "rather",
    "really",
    "some",
    "most",
    "many",
    "long",
    "short",
    "old",
    "new",
    "first",
    "last",
    "there",
    "here",
    "then",
    "also",
    "just",
    "still",
]
MIN_LEN, MAX_LEN = 8, 24


class Vocabulary:
    """Word ids: 0 is padding, then neutral words, decoys and cues."""

    PAD = 0

    def __init__(self) -> None:
        words = ["<pad>", *NEUTRAL, *(w for d in DECOYS for w in d), *(w for c in CUES for w in c)]
        self.words = words
        self.ids = {w: i for i, w in enumerate(words)}

    def __len__(self) -> int:
        return len(self.words)


@dataclass(frozen=True)
class RationaleData:
    """``splits[name]``: ``tokens`` (B, MAX_LEN) long, ``keep`` (B, MAX_LEN) bool (not
    padding), ``gold`` (B, MAX_LEN) bool (planted cues), ``labels`` (B,) long."""

    vocab: Vocabulary
    splits: dict[str, dict[str, Tensor]]


def _split(n: int, vocab: Vocabulary, g: torch.Generator) -> dict[str, Tensor]:
    tokens = torch.zeros(n, MAX_LEN, dtype=torch.long)
    gold = torch.zeros(n, MAX_LEN, dtype=torch.bool)
    labels = torch.randint(0, 2, (n,), generator=g)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=g)
    neutral = torch.tensor([vocab.ids[w] for w in NEUTRAL])

    def pick(options: tuple[str, ...]) -> int:
        return vocab.ids[options[int(torch.randint(0, len(options), (1,), generator=g))]]

    for i in range(n):
        length, label = int(lengths[i]), int(labels[i])
        row = neutral[torch.randint(0, len(neutral), (length,), generator=g)]
        slots = torch.randperm(length, generator=g)
        n_cues = int(torch.randint(1, 4, (1,), generator=g))
        for s in slots[:n_cues].tolist():
            row[s] = pick(CUES[label])
            gold[i, s] = True
        if float(torch.rand(1, generator=g)) < 0.8:  # a decoy, on the label's side 3 times in 4
            side = label if float(torch.rand(1, generator=g)) < 0.75 else 1 - label
            row[int(slots[n_cues])] = pick(DECOYS[side])
        tokens[i, :length] = row
    keep = torch.arange(MAX_LEN) < lengths.unsqueeze(1)
    return {"tokens": tokens, "keep": keep, "gold": gold, "labels": labels}


def make_rationale(n_train: int, n_test: int, *, seed: int = 0) -> RationaleData:
    """Train, validation (n_test // 2, at least 1) and test splits, reproducible from ``seed``."""
    vocab = Vocabulary()
    g = torch.Generator().manual_seed(seed)
    sizes = {"train": n_train, "validation": max(1, n_test // 2), "test": n_test}
    return RationaleData(vocab, {name: _split(n, vocab, g) for name, n in sizes.items()})


class RationaleModel(nn.Module):
    """Embedding -> x + ReLU(Conv1d_3(x)) -> attention with a learned query -> linear.

    ``forward(tokens, keep)`` returns (logits (B, n_classes), weights (B, N), log_prob or None).
    :meth:`embed` and :meth:`from_embeddings` split it at the embeddings, for importance
    measures; an item with ``keep`` False is removed: its embedding is zeroed (as padding) and
    it is not attended.
    """

    def __init__(self, vocab_size: int, d: int, attention: Attention, n_classes: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d, padding_idx=Vocabulary.PAD)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.query = nn.Parameter(torch.randn(1, 1, d) / d**0.5)
        self.attention = attention
        self.out = nn.Linear(d, n_classes)

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def embed(self, tokens: Tensor) -> Tensor:
        return self.embedding(tokens)

    def from_embeddings(self, x: Tensor, keep: Tensor):
        x = x * keep.unsqueeze(-1).to(x.dtype)
        h = x + F.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        q = self.query.expand(x.shape[0], 1, -1).to(h.dtype)
        out = self.attention(q, h, mask=keep.unsqueeze(1), need_weights=True)
        logits = self.out(out.context.squeeze(1))
        log_prob = None if out.log_prob is None else out.log_prob.squeeze(-1)
        return logits, out.weights.squeeze(1), log_prob

    def forward(self, tokens: Tensor, keep: Tensor):
        return self.from_embeddings(self.embed(tokens), keep)


@REGISTRY.register("rationale")
class RationaleTask(Task):
    description = (
        "classify word sequences whose label is decided by planted cue words among distractors "
        "and decoys; gold rationale = the planted positions"
    )
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 8, "n_train": 8000, "n_test": 1000, "batch_size": 64, "lr": 3e-3,
                 "d_model": 32},
        "quick": {"epochs": 4, "n_train": 2000, "n_test": 400, "batch_size": 32, "lr": 5e-3,
                  "d_model": 32},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric("share of test sequences classified right (chance 0.5)"),
        "attention_correctness": Metric("attention weight on the planted cue words"),
        "argmax_on_rationale": Metric("share of sequences whose most-weighted word is a cue"),
        "attention_on_decoys": Metric("attention weight on decoy words (a shortcut)", "lower"),
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
        self.data = make_rationale(config.n_train, config.n_test, seed=config.seed)
        self.train = self.data.splits["train"]
        ids = self.data.vocab.ids
        self.decoy_ids = torch.tensor([ids[w] for d in DECOYS for w in d])

    def build_model(self) -> RationaleModel:
        d = self.config.d_model
        attention = build_attention(self.config.score, self.config.align, d, MAX_LEN)
        return RationaleModel(len(self.data.vocab), d, attention)

    def n_train(self) -> int:
        return self.train["labels"].shape[0]

    def has_split(self, name: str) -> bool:
        return name in self.data.splits

    def objective(self, model, index: Tensor) -> Tensor:
        b = self.train
        logits, _, log_prob = model(b["tokens"][index], b["keep"][index])
        per_item = F.cross_entropy(logits, b["labels"][index], reduction="none")
        return task_loss(per_item, log_prob)

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, MAX_LEN) bool: the planted cue words."""
        return self.data.splits[split]["gold"][index]

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, MAX_LEN): the learned query's weights over the words."""
        data = self.data.splits[split]
        return model(data["tokens"][index], data["keep"][index])[1]

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.data.splits[split]
        logits, weights, _ = model(data["tokens"], data["keep"])
        acc = float((logits.argmax(-1) == data["labels"]).float().mean())
        decoys = torch.isin(data["tokens"], self.decoy_ids) & data["keep"]
        top = weights.argmax(-1, keepdim=True)
        metrics = {
            "accuracy": acc,
            "attention_correctness": attention_correctness(weights, data["gold"]),
            "argmax_on_rationale": float(data["gold"].gather(-1, top).float().mean()),
            "attention_on_decoys": attention_correctness(weights, decoys),
            "entropy": entropy(weights),
        }
        with uniform_weights(model):
            ablated, _, _ = model(data["tokens"], data["keep"])
        metrics["uniform_ablation_accuracy"] = float(
            (ablated.argmax(-1) == data["labels"]).float().mean()
        )
        metrics["uniform_ablation_drop"] = acc - metrics["uniform_ablation_accuracy"]
        return metrics

    @torch.no_grad()
    def explanation_probe(self, model: RationaleModel, n: int = 200) -> Probe:
        """The first ``n`` test examples for ``attnkit explain``, run from the embeddings."""
        model.eval()
        split = self.data.splits["test"]
        tokens, keep = split["tokens"][:n], split["keep"][:n]
        _, weights, _ = model(tokens, keep)
        return Probe(
            model=model,
            logits=lambda x, keep: model.from_embeddings(x, keep)[0],
            inputs=model.embed(tokens),
            keep=keep,
            attention=weights,
            labels=split["labels"][:n],
            gold=split["gold"][:n],
            tokens=[self.words(t, k) for t, k in zip(tokens, keep, strict=True)],
            attention_part="attention",
        )

    def words(self, tokens: Tensor, keep: Tensor) -> list[str]:
        return [self.data.vocab.words[t] for t in tokens[keep].tolist()]

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        """Held-out examples: one row of weights over the words; gold = the planted cues."""
        model.eval()
        split = self.data.splits["test"]
        with capture(model) as records:
            logits, _, _ = model(split["tokens"][:n], split["keep"][:n])
        weights = next(iter(records.values()))[0].squeeze(1)
        side = ("0 (negative cues)", "1 (positive cues)")  # CUES[0] decide label 0
        out = []
        for i in range(min(n, split["labels"].shape[0])):
            keep = split["keep"][i]
            length = int(keep.sum())
            out.append(
                {
                    "title": f"label {side[int(split['labels'][i])]}, predicted "
                    f"{side[int(logits[i].argmax())]}",
                    "weights": weights[i, :length].unsqueeze(0).numpy(),
                    "gold": split["gold"][i, :length].unsqueeze(0).numpy(),
                    "x_labels": self.words(split["tokens"][i], keep),
                    "y_labels": ["query"],
                    "x_title": "word (gold: the planted cue words)",
                    "y_title": "learned query",
                }
            )
        return out
