"""The ``dates`` task: a Bahdanau-style encoder-decoder normalising dates, evaluated against
the gold character alignment."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.evaluation import (
    alignment_error_rate,
    capture,
    entropy,
    uniform_weights,
)
from attnkit.memory.coverage import CoverageAttention, coverage_loss
from attnkit.models.seq2seq import Seq2SeqAttention, Seq2SeqOutput
from attnkit.output import AttentionOutput
from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.dates import END, OUTPUT_LEN, START, Vocab, make_dates
from attnkit.tasks.parts import build_attention, task_loss

__all__ = ["COVERAGE_WEIGHT", "CoverageSeq2Seq", "DatesTask", "repeated_attention"]

COVERAGE_WEIGHT = 1.0  # λ of See et al. eq. 13, as in the paper


def repeated_attention(weights: Tensor, mask: Tensor) -> Tensor:
    """Attention a source character receives beyond one unit, summed over the characters and
    divided by the number of steps: Σ_i max(0, Σ_t a_ti − 1) / T per item (B,), the share of
    the attention mass spent on characters already attended once in full (0 when no
    character receives more than 1 in total; padded characters count nothing).

    Args:
        weights: a (B, T, n); mask: (B, n), True = a real character.
    """
    total = (weights * mask.unsqueeze(-2).to(weights.dtype)).sum(-2)  # (B, n)
    return (total - 1).clamp_min(0).sum(-1) / weights.shape[-2]


class CoverageSeq2Seq(Seq2SeqAttention):
    """The dates model with coverage (``attention=coverage``): the decoder's additive score
    takes the coverage vector c^t = Σ_{t'<t} a^{t'} (See et al. eqs. 10-11, Tu et al.), by
    :meth:`attnkit.memory.CoverageAttention.step`; everything else is
    :class:`~attnkit.models.seq2seq.Seq2SeqAttention`. The coverage is reset at the start of
    every decoding; :meth:`_attend` reads the coverage of the decoding under way (zeros
    outside one)."""

    def __init__(self, vocab_in: int, vocab_out: int, d: int, **kw) -> None:
        super().__init__(vocab_in, vocab_out, d, build_attention("dot", "softmax", d, 1), **kw)
        del self.attention  # the base class's part, replaced by the coverage attention
        self.coverage_attention = CoverageAttention(d, self.d_enc, d)
        self._coverage: Tensor | None = None
        self._keys: tuple[Tensor, Tensor] | None = None

    def _attend(self, q: Tensor, states: Tensor, mask: Tensor | None, step: int) -> AttentionOutput:
        att = self.coverage_attention
        if self._keys is None or self._keys[0] is not states:
            self._keys = (states, att.W_h(states))
        coverage = self._coverage
        if coverage is None or coverage.shape != states.shape[:-1]:
            coverage = states.new_zeros(states.shape[:-1])
        m = None if mask is None else mask.reshape(states.shape[:-1])
        a = att.step(q.squeeze(-2), self._keys[1], coverage, m)
        self._coverage = coverage + a  # eq. 10, for the next step
        context = (a.unsqueeze(-1) * states).sum(-2, keepdim=True)
        return AttentionOutput(context, a.unsqueeze(-2))

    def _decode(self, src, src_mask, length, tgt_in, bos: int = 1) -> Seq2SeqOutput:
        self._coverage, self._keys = None, None
        try:
            return super()._decode(src, src_mask, length, tgt_in, bos=bos)
        finally:
            self._coverage, self._keys = None, None


@REGISTRY.register("dates")
class DatesTask(Task):
    description = "normalise written dates (5 locales) to YYYY-MM-DD; gold character alignment"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        mode: {"epochs": epochs, "n_train": n_train, "n_test": n_test, "batch_size": 64,
               "lr": 3e-3, "d_model": 64}
        for mode, epochs, n_train, n_test in (("full", 6, 12000, 1000), ("quick", 3, 2000, 300))
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "exact_match": Metric("share of dates whose whole ISO output is right"),
        "char_accuracy": Metric("share of output characters that are right"),
        "unseen_patterns_exact_match": Metric(
            "exact match on date patterns never seen in training"
        ),
        "argmax_in_gold_field": Metric(
            "share of output characters whose most-weighted input character is in the gold field"
        ),
        "aer_argmax": Metric(
            "alignment error rate of the most-weighted input character against the gold links",
            "lower",
        ),
        "aer_threshold": Metric(
            "alignment error rate of the input characters weighted above 0.2", "lower"
        ),
        "repeated_attention": Metric(
            "attention the input characters receive beyond 1 in total over the output, "
            "as a share of all attention (the gold alignment repeats some too)",
            None,
        ),
        "entropy": Metric("mean entropy of the attention weights in nats (lower: sharper)", None),
        "uniform_ablation_exact_match": Metric(
            "exact match when every attention is replaced by uniform weights", None
        ),
        "uniform_ablation_drop": Metric(
            "exact match lost under uniform weights: how much the model relies on its attention",
            None,
        ),
    }

    @classmethod
    def validate(cls, config) -> None:
        if config.attention == "coverage" and (
            config.score not in (None, "additive") or config.align != "softmax"
        ):
            raise ValueError(
                "attention=coverage is See et al.'s additive score with softmax alignment; "
                f"score {config.score!r} and align {config.align!r} cannot be combined with it"
            )
        days = (END - START).days + 1  # every split has its own dates
        needed = config.n_train + max(1, config.n_test // 2) + config.n_test
        if needed > days:
            raise ValueError(
                f"n_train + n_test + validation ({config.n_train} + {config.n_test} + "
                f"{max(1, config.n_test // 2)} = {needed}) exceeds the {days} distinct dates "
                f"of the dates task ({START} to {END})"
            )

    def __init__(self, config) -> None:
        super().__init__(config)
        self.data = make_dates(config.n_train, config.n_test, seed=config.seed)
        self.train = self.data.splits["train"]
        self.max_len = max(s["src"].shape[1] for s in self.data.splits.values())

    attentions: ClassVar[tuple[str, ...]] = ("coverage",)

    def build_model(self) -> Seq2SeqAttention:
        d = self.config.d_model
        sizes = (len(self.data.src_vocab), len(self.data.tgt_vocab), d)
        if self.config.attention == "coverage":
            return CoverageSeq2Seq(*sizes, bidirectional=True, enc_hidden=d // 2)
        return Seq2SeqAttention(
            *sizes,
            build_attention(self.config.score, self.config.align, d, self.max_len),
            bidirectional=True,
            enc_hidden=d // 2,
        )

    def n_train(self) -> int:
        return self.train["src"].shape[0]

    def has_split(self, name: str) -> bool:
        return name in self.data.splits

    def _teacher_forced(self, model, split: str, index: Tensor) -> tuple[Seq2SeqOutput, Tensor]:
        b = self.data.splits[split]
        src, mask, tgt = b["src"][index], b["mask"][index], b["tgt"][index]
        bos = torch.full((tgt.shape[0], 1), Vocab.BOS, dtype=torch.long)
        return model(src, torch.cat([bos, tgt[:, :-1]], 1), mask), tgt

    def objective(self, model, index: Tensor) -> Tensor:
        out, tgt = self._teacher_forced(model, "train", index)
        per_token = F.cross_entropy(out.logits.transpose(1, 2), tgt, reduction="none")
        loss = task_loss(per_token, out.log_prob)
        if self.config.attention == "coverage":  # See et al. eq. 13: + λ Σ_i min(a^t, c^t)
            w = out.weights
            before = w.cumsum(1) - w  # c^t, the coverage before step t (eq. 10)
            loss = loss + COVERAGE_WEIGHT * coverage_loss(w, before).mean() / w.shape[1]
        return loss

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, OUTPUT_LEN, n) bool: the sure links of each output character (none for the
        dashes)."""
        data = self.data.splits[split]
        return data["sure"][index][:, :, : data["src"].shape[1]]

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, OUTPUT_LEN, n): the decoder's weights over the input characters, teacher-forced."""
        return self._teacher_forced(model, split, index)[0].weights

    @torch.no_grad()
    def _decode(self, model, split: dict, limit: int | None = None):
        src, mask = split["src"][:limit], split["mask"][:limit]
        tokens, out = model.generate(src, OUTPUT_LEN, Vocab.BOS, mask)
        return tokens, out.weights

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.data.splits[split]
        tokens, weights = self._decode(model, data)
        correct = tokens == data["tgt"]
        metrics = {
            "exact_match": float(correct.all(-1).float().mean()),
            "char_accuracy": float(correct.float().mean()),
        }
        if split != "test":
            return metrics
        width = weights.shape[-1]
        sure, possible = data["sure"][..., :width], data["possible"][..., :width]
        rows = sure.any(-1)  # output characters with gold links (not the dashes)
        metrics["aer_argmax"] = alignment_error_rate(weights, sure, possible, rows=rows)
        metrics["aer_threshold"] = alignment_error_rate(
            weights, sure, possible, mode="threshold", threshold=0.2, rows=rows
        )
        # A copied digit has one sure link; a character read from a whole field (a month
        # name) has the field: also report how often the argmax falls inside the right field.
        top = weights.argmax(-1, keepdim=True)
        field = data["field"][..., :width]
        metrics["argmax_in_gold_field"] = float(
            field.gather(-1, top).squeeze(-1)[rows].float().mean()
        )
        metrics["entropy"] = entropy(weights[rows])
        metrics["repeated_attention"] = float(
            repeated_attention(weights, data["mask"][..., :width]).mean()
        )
        with uniform_weights(model):
            ablated, _ = self._decode(model, data)
        uniform_em = float((ablated == data["tgt"]).all(-1).float().mean())
        metrics["uniform_ablation_exact_match"] = uniform_em
        metrics["uniform_ablation_drop"] = metrics["exact_match"] - uniform_em
        return metrics

    def final_metrics(self, model) -> dict[str, float]:
        metrics = self.evaluate(model, "test")
        unseen = self.evaluate(model, "unseen_patterns")
        metrics["unseen_patterns_exact_match"] = unseen["exact_match"]
        return metrics

    @torch.no_grad()
    def explanation_probe(self, model, n: int = 200, step: int = 3):
        """``attnkit explain``: the output character at ``step`` (3: the year's last digit,
        copied from one input character) of the first ``n`` test dates, as a classifier over
        the output characters, run from the source embeddings; a character left out is
        replaced by padding and not attended.

        The decoder state at ``step`` is taken from teacher forcing on the full input and held
        fixed, so the step's attention is the only path from the inputs through the decoder
        (they still reach the output through the encoder). Gold: the last input character of the
        sure links, the input character the digit is copied from (the whole field when none
        is, e.g. a month name)."""
        from attnkit.evaluation.suite import Probe

        model.eval()
        data = self.data.splits["test"]
        src, mask, tgt = data["src"][:n], data["mask"][:n], data["tgt"][:n]
        bos = torch.full((src.shape[0], 1), Vocab.BOS, dtype=torch.long)
        tgt_in = torch.cat([bos, tgt[:, :-1]], 1)
        covered = isinstance(model, CoverageSeq2Seq)
        if covered:  # a decoding starts with no coverage
            model._coverage, model._keys = None, None
        states, h = model.encode(src, mask)
        context = states.new_zeros(states.shape[0], states.shape[-1])
        for t in range(step + 1):  # the decoder state at ``step`` (teacher forcing)
            h = model.cell(torch.cat([model.embed_out(tgt_in[:, t]), context], -1), h)
            if t < step:
                context = model._attend(h.unsqueeze(-2), states, mask.unsqueeze(-2), t)
                context = context.context.squeeze(-2)
        query = h.unsqueeze(-2)
        # With coverage (attention=coverage), c^step from the same teacher-forced steps, held
        # fixed like the decoder state (each call would otherwise add its weights to it).
        coverage = None
        if covered:
            so_far = model._coverage
            coverage = states.new_zeros(states.shape[:-1]) if so_far is None else so_far.clone()

        def logits(x: Tensor, keep: Tensor) -> Tensor:
            # a removed character reads as padding, as the model sees padding
            pad = model.embed_in.weight[Vocab.PAD].to(x.dtype)
            enc, _ = model.encoder(torch.where(keep.unsqueeze(-1), x, pad))
            if coverage is not None:
                model._coverage = coverage.to(enc.dtype)
            out = model._attend(query.to(enc.dtype), enc, keep.unsqueeze(-2), step)
            return model.out(
                torch.cat([query.squeeze(-2).to(enc.dtype), out.context.squeeze(-2)], -1)
            )

        inputs = model.embed_in(src)
        with capture(model) as records:
            logits(inputs, mask)
        (weights,) = next(iter(records.values()))
        width = src.shape[1]
        gold = data["sure"][:n, step, :width]
        return Probe(
            model=model,
            logits=logits,
            inputs=inputs,
            keep=mask,
            attention=weights.squeeze(-2),
            labels=tgt[:, step],
            gold=gold & mask,
            tokens=[list(ex.text) for ex in data["examples"][:n]],
            attention_part="coverage_attention" if covered else "attention",
        )

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        """Held-out examples: weights (10 × len(text)); rows are the predicted characters."""
        model.eval()
        split = self.data.splits["test"]
        with capture(model) as records:
            tokens, _ = self._decode(model, split, limit=n)
        steps = next(iter(records.values()))  # one (B, 1, N) tensor per decoding step
        weights = torch.stack([s.reshape(s.shape[0], s.shape[-1]) for s in steps], dim=-2)
        out = []
        for i in range(min(n, len(split["examples"]))):
            ex = split["examples"][i]
            predicted = [self.data.tgt_vocab.chars[t] for t in tokens[i].tolist()]
            out.append(
                {
                    "title": f"{ex.text!r} → {''.join(predicted)} (gold {ex.target}; "
                    f"{ex.locale}, {ex.pattern})",
                    "weights": weights[i, :, : len(ex.text)].numpy(),
                    "x_labels": list(ex.text),
                    "y_labels": predicted,
                    "x_title": "input character",
                    "y_title": "predicted output character",
                    "gold": torch.tensor(ex.sure).numpy(),
                }
            )
        return out
