"""The dates experiment: a Bahdanau-style encoder-decoder normalising dates, evaluated against
the gold character alignment."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.evaluation import (
    alignment_error_rate,
    capture,
    entropy,
    supervised_attention_loss,
    uniform_weights,
)
from attnkit.experiments.config import RunConfig
from attnkit.experiments.parts import build_attention, task_loss
from attnkit.models.seq2seq import Seq2SeqAttention
from attnkit.tasks.dates import OUTPUT_LEN, Vocab, make_dates

__all__ = ["DatesTask"]


class DatesTask:
    name = "dates"

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.data = make_dates(config.n_train, config.n_test, seed=config.seed)
        self.train = self.data.splits["train"]

    def build_model(self) -> Seq2SeqAttention:
        c = self.config
        d = c.d_model
        return Seq2SeqAttention(
            len(self.data.src_vocab),
            len(self.data.tgt_vocab),
            d,
            build_attention(c.score, c.align, d),
            bidirectional=True,
            enc_hidden=d // 2,
        )

    def n_train(self) -> int:
        return self.train["src"].shape[0]

    def loss(self, model, index: Tensor) -> Tensor:
        b = self.train
        src, mask, tgt = b["src"][index], b["mask"][index], b["tgt"][index]
        bos = torch.full((tgt.shape[0], 1), Vocab.BOS, dtype=torch.long)
        out = model(src, torch.cat([bos, tgt[:, :-1]], 1), mask)
        per_token = F.cross_entropy(out.logits.transpose(1, 2), tgt, reduction="none")
        loss = task_loss(per_token, out.log_prob)
        if self.config.supervise_attention > 0:
            gold = b["sure"][index][:, :, : src.shape[1]]
            loss = loss + self.config.supervise_attention * supervised_attention_loss(
                out.weights, gold
            )
        return loss

    @torch.no_grad()
    def _decode(self, model, split: dict, limit: int | None = None):
        src, mask = split["src"][:limit], split["mask"][:limit]
        tokens, out = model.generate(src, OUTPUT_LEN, Vocab.BOS, mask)
        return tokens, out.weights

    @torch.no_grad()
    def evaluate(self, model, split_name: str = "test") -> dict[str, float]:
        model.eval()
        split = self.data.splits[split_name]
        tokens, weights = self._decode(model, split)
        correct = tokens == split["tgt"]
        metrics = {
            "exact_match": float(correct.all(-1).float().mean()),
            "char_accuracy": float(correct.float().mean()),
        }
        if split_name == "test":
            width = weights.shape[-1]
            sure, possible = split["sure"][..., :width], split["possible"][..., :width]
            rows = sure.any(-1)  # output characters with gold links (not the dashes)
            metrics["aer_argmax"] = alignment_error_rate(weights, sure, possible, rows=rows)
            metrics["aer_threshold"] = alignment_error_rate(
                weights, sure, possible, mode="threshold", threshold=0.2, rows=rows
            )
            # AER has a floor with one predicted link per character and several sure links per
            # field, so also report how often the argmax falls inside the gold field.
            top = weights.argmax(-1, keepdim=True)
            metrics["argmax_in_gold_field"] = float(
                sure.gather(-1, top).squeeze(-1)[rows].float().mean()
            )
            metrics["entropy"] = entropy(weights[rows])
            with uniform_weights(model):
                ablated, _ = self._decode(model, split)
            uniform_em = float((ablated == split["tgt"]).all(-1).float().mean())
            metrics["uniform_ablation_exact_match"] = uniform_em
            metrics["uniform_ablation_drop"] = metrics["exact_match"] - uniform_em
        return metrics

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        """Held-out examples: weights (10 × len(text)) with labels and gold sure links."""
        model.eval()
        split = self.data.splits["test"]
        with capture(model) as records:
            tokens, _ = self._decode(model, split, limit=n)
        steps = next(iter(records.values()))  # one (B, 1, N) tensor per decoding step
        weights = torch.cat(steps, dim=-2)
        out = []
        for i in range(n):
            ex = split["examples"][i]
            n_chars = len(ex.text)
            out.append(
                {
                    "title": f"{ex.text!r} → {self.data.tgt_vocab.decode(tokens[i].tolist())} "
                    f"(gold {ex.target}; {ex.locale}, {ex.pattern})",
                    "weights": weights[i, :, :n_chars].numpy(),
                    "x_labels": list(ex.text),
                    "y_labels": list(ex.target),
                    "gold": torch.tensor(ex.sure).numpy(),
                }
            )
        return out
