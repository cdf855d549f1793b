"""The ``seq2seq`` task: translate the user's own source/target pairs (``attnkit run seq2seq
--data FILE``, a TSV or JSONL file, :mod:`attnkit.tasks.parallel`) with an attention
encoder-decoder, and score its attention against gold word alignments when the file gives them.

Models (``--attention``): ``bahdanau`` (the default: a bidirectional GRU encoder, the decoder
state attends with the run's score, by default additive, Bahdanau et al.), ``luong`` (a
unidirectional encoder; by default the ``general`` bilinear score, Luong et al.), both
:class:`attnkit.models.seq2seq.Seq2SeqAttention`, and ``transformer`` (attnkit's
encoder-decoder :class:`attnkit.Transformer`, 2 + 2 layers of 4 heads with sinusoidal
positions; by default the scaled dot product). ``--score`` and ``--align`` set the attention
of every model (in the Transformer: of every layer).

Metrics: corpus BLEU (Papineni et al., 4-grams, no smoothing, in [0, 1]), METEOR and exact
match of greedy decoding; with gold alignments, the alignment error rate
AER = 1 − (|A∩S| + |A∩P|) / (|A| + |S|) (Och & Ney 2003) of the links A, one per target token:
the source token of its largest attention weight, with the model forced to decode the reference
(the usual way to read an alignment from a translation model). For the Transformer A is read
from the last layer's cross-attention, averaged over the heads.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import alignments as al
from attnkit.encoder_decoder import Transformer
from attnkit.evaluation import alignment_error_rate, bleu, capture, entropy, meteor
from attnkit.models.seq2seq import Seq2SeqAttention
from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.parallel import BOS, ParallelData, make_parallel_data, read_pairs
from attnkit.tasks.parts import build_attention

__all__ = ["MODELS", "Seq2SeqTask", "TransformerSeq2Seq"]

MODELS = ("bahdanau", "luong", "transformer")
DEFAULT_SCORE = {"bahdanau": "additive", "luong": "general", "transformer": "scaled_dot"}


def _sinusoids(n: int, d: int) -> Tensor:
    """Vaswani et al.'s position encodings (n, d): sin and cos of position / 10000^(2i/d)."""
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(-1)
    rate = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(n, d)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos * rate), torch.cos(pos * rate)
    return table


class TransformerSeq2Seq(nn.Module):
    """Token embeddings (scaled by √d) plus sinusoidal positions, :class:`attnkit.Transformer`
    and a linear layer to the target vocabulary. ``forward(src, tgt_in, src_mask)`` gives the
    logits (B, T, V_out) with teacher forcing; :meth:`cross_weights` reads the last decoder
    layer's cross-attention, averaged over the heads, from a :func:`attnkit.evaluation.capture`
    of a forward pass."""

    def __init__(
        self, vocab_in: int, vocab_out: int, d: int, *, score: str, align: Any, max_len: int
    ) -> None:
        super().__init__()
        self.d = d
        self.embed_in = nn.Embedding(vocab_in, d)
        self.embed_out = nn.Embedding(vocab_out, d)
        self.register_buffer("positions", _sinusoids(max_len + 2, d), persistent=False)
        self.transformer = Transformer(
            d, 4, encoder_layers=2, decoder_layers=2, d_ff=4 * d, dropout=0.1, score=score,
            align=align,
        )  # fmt: skip
        self.out = nn.Linear(d, vocab_out)

    def _embed(self, table: nn.Embedding, ids: Tensor) -> Tensor:
        return table(ids) * math.sqrt(self.d) + self.positions[: ids.shape[1]]

    def forward(self, src: Tensor, tgt_in: Tensor, src_mask: Tensor) -> Tensor:
        memory_mask = src_mask.unsqueeze(-2)
        memory = self.transformer.encode(self._embed(self.embed_in, src), memory_mask)
        # causal self-attention: a real target position never sees the padding after it
        h = self.transformer.decode(
            self._embed(self.embed_out, tgt_in), memory, memory_mask=memory_mask
        )
        return self.out(h)

    def cross_weights(self, records: dict[str, list[Tensor]]) -> Tensor:
        """(B, T, N): the last decoder layer's cross-attention weights, mean over heads."""
        name = [k for k in records if k.startswith("transformer.decoder.") and "cross" in k][-1]
        return records[name][-1].mean(1)

    @torch.no_grad()
    def generate(self, src: Tensor, length: int, src_mask: Tensor) -> Tensor:
        """Greedy decoding of ``length`` tokens from ``<s>``: (B, length)."""
        tokens = torch.full((src.shape[0], 1), BOS, dtype=torch.long)
        for _ in range(length):
            nxt = self(src, tokens, src_mask)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
        return tokens[:, 1:]


@REGISTRY.register("seq2seq")
class Seq2SeqTask(Task):
    description = (
        "translate your own source/target pairs (--data FILE: TSV or JSONL, optional gold "
        "alignments i-j / i?j); BLEU, METEOR, exact match and AER"
    )
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 30, "n_train": 1_000_000, "n_test": 1_000_000, "batch_size": 32,
                 "lr": 3e-3, "d_model": 64, "seq_len": 64},
        "quick": {"epochs": 12, "n_train": 5000, "n_test": 1000, "batch_size": 32, "lr": 5e-3,
                  "d_model": 64, "seq_len": 64},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "bleu": Metric("corpus BLEU-4 of greedy decoding against the reference, in [0, 1]"),
        "meteor": Metric("METEOR of greedy decoding (exact matches), in [0, 1]"),
        "exact_match": Metric("share of sentences translated exactly"),
        "aer": Metric(
            "alignment error rate of the most-weighted source token of each reference token "
            "against the gold links (pairs with gold alignments)",
            "lower",
        ),
        "entropy": Metric("mean entropy of the attention weights in nats (lower: sharper)", None),
    }
    attentions: ClassVar[tuple[str, ...]] = MODELS
    reads_data = True

    @classmethod
    def run_defaults(cls, config: Any) -> dict[str, Any]:
        """The task's defaults, with the score of the chosen model (``DEFAULT_SCORE``)."""
        model = "bahdanau" if config.attention == "default" else config.attention
        return {**cls.defaults["quick" if config.quick else "full"], "score": DEFAULT_SCORE[model]}

    @classmethod
    def example_settings(cls, directory: Any) -> dict[str, Any]:
        """A file of 200 English → Spanish pairs with gold alignments
        (:mod:`attnkit.tasks.phrases`)."""
        from pathlib import Path

        from attnkit.tasks.phrases import make_pairs, write_tsv

        path = write_tsv(Path(directory) / "example_pairs.tsv", make_pairs(200, seed=1))
        return {"data": str(path)}

    @classmethod
    def validate(cls, config: Any) -> None:
        if getattr(config, "data", None) is None:
            raise ValueError("data: task 'seq2seq' needs --data FILE (TSV or JSONL pairs)")
        if al.REGISTRY.get(config.align).stochastic:
            raise ValueError(
                f"align {config.align!r} samples its weights; the seq2seq task trains by "
                "back-propagation through the weights and needs a deterministic alignment"
            )
        read_pairs(config.data)  # refuses a file it cannot read, naming the line

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model_name = "bahdanau" if config.attention == "default" else config.attention
        self.data: ParallelData = make_parallel_data(
            config.data,
            n_train=config.n_train,
            n_test=config.n_test,
            seed=config.seed,
            max_len=config.seq_len,
        )
        self.train = self.data.splits["train"]
        if self.n_train() < config.batch_size:
            raise ValueError(
                f"batch_size {config.batch_size} is larger than the {self.n_train()} training "
                "pairs: no training step would run"
            )

    def build_model(self) -> nn.Module:
        c = self.config
        sizes = (len(self.data.source_vocab), len(self.data.target_vocab), c.d_model)
        if self.model_name == "transformer":
            return TransformerSeq2Seq(*sizes, score=c.score, align=c.align, max_len=c.seq_len)
        attention = build_attention(c.score, c.align, c.d_model, c.seq_len)
        bidirectional = self.model_name == "bahdanau"
        return Seq2SeqAttention(
            *sizes,
            attention,
            bidirectional=bidirectional,
            enc_hidden=c.d_model // 2 if bidirectional else c.d_model,
        )

    def n_train(self) -> int:
        return self.train["src"].shape[0]

    def has_split(self, name: str) -> bool:
        return name in self.data.splits

    def _forced(self, model, b: dict, index: Any = slice(None), weights: bool = False):
        """Logits (B, T, V) of teacher forcing on the reference, and with ``weights`` the
        attention over the source (B, T, N)."""
        src, mask, tgt_in = b["src"][index], b["src_mask"][index], b["tgt_in"][index]
        if not isinstance(model, TransformerSeq2Seq):
            out = model(src, tgt_in, mask)
            return out.logits, out.weights
        if not weights:
            return model(src, tgt_in, mask), None
        with capture(model) as records:
            logits = model(src, tgt_in, mask)
        return logits, model.cross_weights(records)

    def objective(self, model, index: Tensor) -> Tensor:
        logits, _ = self._forced(model, self.train, index)
        return F.cross_entropy(logits.transpose(1, 2), self.train["tgt"][index], ignore_index=0)

    @torch.no_grad()
    def _greedy(self, model, src: Tensor, mask: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """Greedy output ids (B, length) and their attention over the source (B, length, N)."""
        if isinstance(model, TransformerSeq2Seq):
            tokens = model.generate(src, length, mask)
            fed = torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], 1)
            with capture(model) as records:
                model(src, fed, mask)
            return tokens, model.cross_weights(records)
        tokens, out = model.generate(src, length, BOS, mask)
        return tokens, out.weights

    def _translate(self, model, src: Tensor, mask: Tensor, length: int):
        tokens, weights = self._greedy(model, src, mask, length)
        return [self.data.decode_target(row) for row in tokens.tolist()], weights

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.data.splits[split]
        refs = [e.target for e in data["examples"]]
        hyps, _ = self._translate(model, data["src"], data["src_mask"], data["tgt"].shape[1] + 2)
        metrics = {
            "bleu": bleu(hyps, [[r] for r in refs]),
            "exact_match": sum(h == r for h, r in zip(hyps, refs, strict=True)) / len(refs),
        }
        if split != "test":
            return metrics
        metrics["meteor"] = meteor(hyps, [[r] for r in refs])
        _, weights = self._forced(model, data, weights=True)
        metrics["entropy"] = entropy(weights[data["tgt_mask"]])
        if bool(data["gold_rows"].any()):
            metrics["aer"] = alignment_error_rate(
                weights, data["sure"], data["possible"], rows=data["gold_rows"]
            )
        return metrics

    @torch.no_grad()
    def predict(self, model, inputs: list[str]) -> list[dict[str, Any]]:
        """Each source sentence's greedy translation (``prediction``), its tokens
        (``output_tokens``), the source tokens read (``tokens``, ``<unk>`` for tokens unseen in
        training), the attention of each output token over them (``attention``) and the
        alignment read from it (``alignment``, Pharaoh ``i-j``: each output token's
        most-weighted source token)."""
        model.eval()
        sentences = [text.split() for text in inputs]
        src, mask = self.data.encode_source(sentences)
        length = min(self.config.seq_len, 2 * src.shape[1] + 5) + 1
        outputs, weights = self._translate(model, src, mask, length)
        out = []
        for b, (text, words) in enumerate(zip(inputs, sentences, strict=True)):
            w = weights[b, : len(outputs[b]), : len(words)]
            links = w.argmax(-1).tolist() if len(outputs[b]) else []
            unk = set(self.data.source_vocab)
            out.append(
                {
                    "input": text,
                    "prediction": " ".join(outputs[b]),
                    "tokens": [x if x in unk else "<unk>" for x in words],
                    "output_tokens": outputs[b],
                    "attention": w.tolist(),
                    "alignment": " ".join(f"{i}-{j}" for j, i in enumerate(links)),
                }
            )
        return out

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        """Held-out pairs: the attention of each reference token over the source, decoded with
        the reference (as AER reads it); boxes: the gold links, sure and possible."""
        model.eval()
        data = self.data.splits["test"]
        k = min(n, data["src"].shape[0])
        _, weights = self._forced(model, data, slice(0, k), weights=True)
        hyps, _ = self._translate(
            model, data["src"][:k], data["src_mask"][:k], data["tgt"].shape[1] + 2
        )
        out = []
        for b in range(k):
            e = data["examples"][b]
            n_s, n_t = len(e.source), len(e.target)
            gold = data["possible"][b, :n_t, :n_s]
            marked = "; boxes: gold links, sure and possible" if e.sure is not None else ""
            out.append(
                {
                    "title": f"{' '.join(e.source)} → {' '.join(hyps[b])} (reference "
                    f"{' '.join(e.target)}{marked})",
                    "weights": weights[b, :n_t, :n_s].numpy(),
                    "gold": gold.numpy(),
                    "x_labels": e.source,
                    "y_labels": e.target,
                    "x_title": "source token",
                    "y_title": "reference token (decoded with the reference)",
                }
            )
        return out
