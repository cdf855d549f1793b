"""The ``dates-lm`` task: a small decoder-only character language model (GPT-style) on the
written dates of the ``dates`` task, each line ``<written date>=<ISO date>`` followed by an end
mark. Measured: perplexity per character on held-out dates, and whether greedy generation with
the KV cache, prompted with a held-out written date and ``=``, writes its ISO form.

The run configuration's ``position`` picks the position scheme: ``default`` means GPT's learned
absolute embeddings; a registered scheme's name (``--position rope``) replaces them.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit as ak
from attnkit.evaluation import capture
from attnkit.models.decoder_lm import DecoderLM
from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.dates import END, OUTPUT_LEN, START, DateExample, Vocab, make_dates
from attnkit.tasks.parts import build_alignment

__all__ = ["DatesLMTask"]

SEP, EOS = "=", "\n"
LAYERS = 2


def _line(e: DateExample) -> str:
    return f"{e.text}{SEP}{e.target}{EOS}"


@REGISTRY.register("dates-lm")
class DatesLMTask(Task):
    description = (
        "decoder-only character LM (GPT-style) on written dates and their ISO form; perplexity "
        "and KV-cached generation"
    )
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        mode: {"epochs": epochs, "n_train": n_train, "n_test": n_test, "batch_size": 32,
               "lr": 5e-3, "d_model": 64}
        for mode, epochs, n_train, n_test in (("full", 10, 12000, 1000), ("quick", 10, 2000, 300))
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "perplexity": Metric(
            "exp of the mean negative log-likelihood per character of held-out lines", "lower"
        ),
        "date_exact_match": Metric(
            "share of held-out written dates whose ISO form greedy KV-cached generation writes"
        ),
        "unseen_patterns_exact_match": Metric("the same on date patterns never seen in training"),
    }

    takes_position = True

    @classmethod
    def validate(cls, config) -> None:
        days = (END - START).days + 1
        needed = config.n_train + max(1, config.n_test // 2) + config.n_test
        if needed > days:
            raise ValueError(
                f"n_train + n_test + validation = {needed} exceeds the {days} distinct dates "
                f"of the dates task ({START} to {END})"
            )
        score = ak.scores.REGISTRY.get(config.score)
        if score.mixes_keys or config.score == "location":
            raise ValueError(
                f"score {config.score!r} cannot be used by a causal language model (it mixes "
                "neighbouring keys or needs a fixed key count); try scaled_dot"
            )
        position = _position(config)
        if position is not None:
            ak.positions.REGISTRY.get(position)  # unknown names: the options and the closest

    def __init__(self, config) -> None:
        super().__init__(config)
        data = make_dates(config.n_train, config.n_test, seed=config.seed)
        self.splits = {name: split["examples"] for name, split in data.splits.items()}
        self.vocab = Vocab({c for exs in self.splits.values() for e in exs for c in _line(e)})
        self.max_len = 1 + max(len(_line(e)) for exs in self.splits.values() for e in exs)
        self.encoded = {name: self._encode(exs) for name, exs in self.splits.items()}

    def _encode(self, examples: list[DateExample]) -> Tensor:
        """(n, max_len) ids: <s>, the line, then padding (id 0)."""
        out = torch.zeros(len(examples), self.max_len, dtype=torch.long)
        for i, e in enumerate(examples):
            ids = [Vocab.BOS, *self.vocab.encode(_line(e))]
            out[i, : len(ids)] = torch.tensor(ids)
        return out

    def build_model(self) -> DecoderLM:
        d = self.config.d_model
        heads = 4 if d % 4 == 0 else 2
        name = _position(self.config)
        position = None
        if name is not None:
            position = name
            if getattr(ak.positions.REGISTRY.get(name), "absolute", False):
                position = ak.positions.build(name, embed_dim=d)
        return DecoderLM(
            len(self.vocab),
            d,
            heads,
            LAYERS,
            max_len=self.max_len,
            position=position,
            score=self.config.score,
            align=build_alignment(self.config.align, d // heads),
        )

    def has_split(self, name: str) -> bool:
        return name in self.encoded

    def n_train(self) -> int:
        return self.encoded["train"].shape[0]

    @staticmethod
    def _nll(model, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Summed negative log-likelihood per line and the number of predicted characters."""
        length = int((tokens != Vocab.PAD).sum(1).max())
        tokens = tokens[:, :length]
        logits = model(tokens[:, :-1])
        target = tokens[:, 1:]
        nll = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        real = target != Vocab.PAD
        return (nll * real).sum(1), real.sum(1)

    def objective(self, model, index: Tensor) -> Tensor:
        nll, count = self._nll(model, self.encoded["train"][index])
        return nll.sum() / count.sum()

    def _generate(self, model, examples: list[DateExample]) -> list[str]:
        """Greedy KV-cached continuation of ``<s><written date>=`` by the ISO length."""
        out: list[str] = [""] * len(examples)
        by_length: dict[int, list[int]] = {}
        for i, e in enumerate(examples):  # prompts of one length go in one batch
            by_length.setdefault(len(e.text), []).append(i)
        for items in by_length.values():
            prompt = torch.tensor(
                [[Vocab.BOS, *self.vocab.encode(examples[i].text + SEP)] for i in items]
            )
            tokens = model.generate(prompt, OUTPUT_LEN)[:, prompt.shape[1] :]
            for i, row in zip(items, tokens.tolist(), strict=True):
                out[i] = self.vocab.decode(row)
        return out

    def _exact(self, model, examples: list[DateExample]) -> float:
        written = self._generate(model, examples)
        return sum(w == e.target for w, e in zip(written, examples, strict=True)) / len(examples)

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        nll, count = self._nll(model, self.encoded[split])
        return {
            "perplexity": math.exp(float(nll.sum() / count.sum())),
            "date_exact_match": self._exact(model, self.splits[split]),
        }

    def final_metrics(self, model) -> dict[str, float]:
        out = self.evaluate(model, "test")
        with torch.no_grad():
            out["unseen_patterns_exact_match"] = self._exact(
                model.eval(), self.splits["unseen_patterns"]
            )
        return out

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        """The last layer's self-attention (mean over heads) on held-out lines; gold: the
        position that predicts an ISO character should look at the written character it is
        copied or read from (the ``dates`` task's sure links)."""
        model.eval()
        examples = self.splits["test"][:n]
        tokens = self.encoded["test"][: len(examples)]
        last = f"decoder.layers.{LAYERS - 1}.self_attention"
        with capture(model) as records:
            model(tokens)
        (key,) = [k for k in records if k.startswith(last)]
        weights = records[key][0].mean(1)  # (B, L, L)
        out = []
        for i, e in enumerate(examples):
            chars = ["<s>", *_line(e).replace(EOS, "⏎")]
            size = len(chars)
            gold = torch.zeros(size, size, dtype=torch.bool)
            start = 1 + len(e.text) + 1  # position of the first ISO character
            sure = torch.tensor(e.sure)
            gold[start - 1 : start - 1 + OUTPUT_LEN, 1 : 1 + len(e.text)] = sure
            out.append(
                {
                    "title": f"{e.text!r} = {e.target} ({e.locale}, {e.pattern})",
                    "weights": weights[i, :size, :size].numpy(),
                    "gold": gold.numpy(),
                    "x_labels": chars,
                    "y_labels": [f"→{c}" for c in chars[1:]] + ["(end)"],
                    "x_title": "attended character",
                    "y_title": "next character predicted",
                }
            )
        return out


def _position(config) -> str | None:
    """The configured scheme's name, or None for the task's default (learned absolute)."""
    return None if config.position == "default" else config.position
