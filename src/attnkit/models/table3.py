"""The 17 published models of Brauwers Table III, each as a minimal attention architecture built
from attnkit parts, with the survey's cells to compare ``describe()`` against.

``build(name)`` returns the model (a :class:`attnkit.taxonomy.Variants` where the paper compared
several); every model has ``example()``, a forward pass on small random inputs, so that each
architecture is exercised, not only described. ``reproduce()`` gives the rebuilt table and
whether each row matches the survey.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from attnkit import alignments as al
from attnkit import scores as sc
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.features import (
    HierarchicalAttention,
    MetaEmbedding,
    ParallelCoAttention,
    RotatoryAttention,
)
from attnkit.models.captioning import ImageCaptioner
from attnkit.models.seq2seq import Seq2SeqAttention
from attnkit.models.survey_table3 import SURVEY
from attnkit.multihead import MultiHeadAttention
from attnkit.queries import CapsuleAttention, QueryTagged
from attnkit.transformer import TransformerDecoderLayer, TransformerEncoder
from attnkit.vision import AttentionGate

__all__ = ["MODELS", "SURVEY", "build", "reproduce"]

D = 16  # feature size of the minimal models


class Minimal(nn.Module):
    """A minimal model: named parts, the tags the model itself adds (e.g. that its two inputs
    are a question hierarchy), and ``example()``: a forward pass on random inputs."""

    def __init__(
        self, parts: dict[str, nn.Module], run: Callable[[Minimal], Tensor], tags: tuple = ()
    ) -> None:
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        self._run, self._tags = run, tags

    def taxonomy_tags(self) -> list:
        return list(self._tags)

    def example(self) -> Tensor:
        return self._run(self)


def _seq(score: sc.Score, align: al.Alignment, *, bidirectional: bool) -> Seq2SeqAttention:
    model = Seq2SeqAttention(11, 13, D, Attention(score, align), bidirectional=bidirectional)

    def example() -> Tensor:
        src, tgt = torch.randint(0, 11, (2, 7)), torch.randint(0, 13, (2, 5))
        mask = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
        return model(src, tgt, mask).logits

    model.example = example  # type: ignore[method-assign]
    return model


def _captioner(align: al.Alignment) -> ImageCaptioner:
    model = ImageCaptioner(9, D, Attention(sc.Additive(D, D, D), align))

    def example() -> Tensor:
        logits, _, log_prob = model(torch.randn(2, 1, 16, 16), torch.randint(0, 9, (2, 4)))
        # Hard attention learns through REINFORCE: log-probabilities join the loss.
        return logits if log_prob is None else logits + log_prob.unsqueeze(-1)

    model.example = example  # type: ignore[method-assign]
    return model


def _words(b: int = 2, n: int = 6) -> tuple[Tensor, Tensor]:
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, n - 2 :] = False
    return torch.randn(b, n, D), mask


def bahdanau() -> nn.Module:
    return _seq(sc.Additive(D, 2 * D, D), al.Softmax(), bidirectional=True)


def luong() -> nn.Module:
    return tx.Variants(
        global_dot=_seq(sc.Dot(), al.Softmax(), bidirectional=False),
        global_location=_seq(sc.Location(D, 16), al.Softmax(), bidirectional=False),
        local_dot=_seq(sc.Dot(), al.Local(2, "predictive", d_q=D), bidirectional=False),
    )


def xu() -> nn.Module:
    return tx.Variants(soft=_captioner(al.Softmax()), hard=_captioner(al.Hard()))


def lu() -> nn.Module:
    """Parallel co-attention at the word, phrase and question levels of the question."""
    parts = {
        "phrase": nn.Conv1d(D, D, 3, padding=1),
        "question": nn.LSTM(D, D, batch_first=True),
        "word_level": ParallelCoAttention(D, D, d_w=D),
        "phrase_level": ParallelCoAttention(D, D, d_w=D),
        "question_level": ParallelCoAttention(D, D, d_w=D),
        "out": nn.Linear(2 * D, 5),
    }

    def run(m: Minimal) -> Tensor:
        image, words = torch.randn(2, 9, D), torch.randn(2, 6, D)
        phrases = m.parts["phrase"](words.transpose(1, 2)).transpose(1, 2)
        question, _ = m.parts["question"](phrases)
        total = 0
        for level, q in (
            ("word_level", words),
            ("phrase_level", phrases),
            ("question_level", question),
        ):
            total = total + m.parts[level](image, q).concat()
        return m.parts["out"](total)

    return Minimal(parts, run, (tx.FeatureLevels.HIERARCHICAL,))


def _han() -> Minimal:
    parts = {
        "sentence_encoder": nn.GRU(D, D // 2, batch_first=True, bidirectional=True),
        "out": nn.Linear(D, 3),
    }
    parts["han"] = HierarchicalAttention(D, D, sentence_encoder=parts["sentence_encoder"])

    def run(m: Minimal) -> Tensor:
        words = torch.randn(2, 3, 5, D)
        mask = torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(0)) > 0.3
        return m.parts["out"](m.parts["han"](words, mask).document)

    return Minimal(parts, run)


def yang() -> nn.Module:
    return _han()


def li47() -> nn.Module:
    return _han()


def vaswani() -> nn.Module:
    parts = {
        "encoder": TransformerEncoder(2, D, 4),
        "decoder": TransformerDecoderLayer(D, 4),
        "out": nn.Linear(D, 7),
    }

    def run(m: Minimal) -> Tensor:
        memory = m.parts["encoder"](torch.randn(2, 6, D))
        return m.parts["out"](m.parts["decoder"](torch.randn(2, 4, D), memory))

    return Minimal(parts, run)


def wallaart() -> nn.Module:
    parts = {"lcr_rot_hop": RotatoryAttention(D, D, D, hops=3), "out": nn.Linear(4 * D, 3)}

    def run(m: Minimal) -> Tensor:
        (left, ml), (target, mt), (right, mr) = _words(n=5), _words(n=3), _words(n=6)
        return m.parts["out"](m.parts["lcr_rot_hop"](left, target, right, ml, mt, mr)[0])

    return Minimal(parts, run)


def kiela() -> nn.Module:
    parts = {"dme": MetaEmbedding([8, 12, D], D, D), "out": nn.Linear(D, 3)}

    def run(m: Minimal) -> Tensor:
        embs = [torch.randn(2, 6, d) for d in (8, 12, D)]
        return m.parts["out"](m.parts["dme"](embs).embedding.mean(1))

    return Minimal(parts, run)


def shen() -> nn.Module:
    """DiSAN: multi-dimensional token-to-token self-attention, then source-to-token pooling."""
    parts = {
        "token2token": QueryTagged(Attention(sc.Additive(D, D, D, d_out=D)), "self-attentive"),
        "source2token": Attention(sc.Additive(None, D, D, d_out=D)),
        "out": nn.Linear(D, 3),
    }

    def run(m: Minimal) -> Tensor:
        x, mask = _words()
        h = m.parts["token2token"](x, x, mask=mask.unsqueeze(-2)).context
        pooled = m.parts["source2token"](None, h, mask=mask.unsqueeze(-2)).context
        return m.parts["out"](pooled.squeeze(1))

    return Minimal(parts, run)


def zhang() -> nn.Module:
    """SAGAN: self-attention over the positions of a feature map, dot-product scores."""
    parts = {
        "f": nn.Conv2d(D, D // 2, 1),
        "g": nn.Conv2d(D, D // 2, 1),
        "h": nn.Conv2d(D, D, 1),
        "attention": QueryTagged(Attention("dot"), "self-attentive"),
    }

    def run(m: Minimal) -> Tensor:
        x = torch.randn(2, D, 4, 4)
        flat = [m.parts[n](x).flatten(2).transpose(1, 2) for n in ("f", "g", "h")]
        out = m.parts["attention"](*flat).context
        return x + out.transpose(1, 2).reshape(x.shape)

    return Minimal(parts, run)


def li105() -> nn.Module:
    parts = {
        "self_attention": QueryTagged(Attention("scaled_dot"), "self-attentive"),
        "co_attention": ParallelCoAttention(D, D, score="max"),
        "out": nn.Linear(2 * D, 3),
    }

    def run(m: Minimal) -> Tensor:
        (a, ma), (b, mb) = _words(n=6), _words(n=4)
        a = m.parts["self_attention"](a, a, mask=ma.unsqueeze(-2)).context
        b = m.parts["self_attention"](b, b, mask=mb.unsqueeze(-2)).context
        return m.parts["out"](m.parts["co_attention"](a, b, ma, mb).concat())

    return Minimal(parts, run)


def yu106() -> nn.Module:
    """MCAN: self-attention in each input and guided attention of one by the other."""
    parts = {
        "self_attention": QueryTagged(MultiHeadAttention(D, 4, "dot"), "self-attentive"),
        "guided_attention": QueryTagged(MultiHeadAttention(D, 4, "dot"), "specialized"),
        "out": nn.Linear(D, 3),
    }

    def run(m: Minimal) -> Tensor:
        (img, _), (q, mq) = _words(n=9), _words(n=5)
        q = m.parts["self_attention"](q, mask=mq.unsqueeze(-2)).context
        img = m.parts["self_attention"](img).context
        img = m.parts["guided_attention"](img, q, q, mask=mq.unsqueeze(-2)).context
        return m.parts["out"](img.mean(1) + q.mean(1))

    return Minimal(parts, run, (tx.FeatureMultiplicity.PARALLEL_CO_ATTENTION,))


def wang62() -> nn.Module:
    parts = {
        "co_attention": ParallelCoAttention(D, D, d_w=D, align=al.Reinforced()),
        "out": nn.Linear(2 * D, 3),
    }

    def run(m: Minimal) -> Tensor:
        (a, ma), (b, mb) = _words(n=6), _words(n=4)
        out = m.parts["co_attention"](a, b, ma, mb)
        # The reinforced policy learns through REINFORCE: log-probabilities join the loss.
        return m.parts["out"](out.concat()) + (out.log_prob1 + out.log_prob2).unsqueeze(-1)

    return Minimal(parts, run)


def oktay() -> nn.Module:
    """Attention gates (attnkit.vision.AttentionGate): a coarser level's gating signal
    (specialized query) gives every pixel of the skip features sigmoid coefficients, one per
    channel group (multi-dimensional), beside a self-attentive grid attention. The survey files
    the gates' sigmoid coefficients under global alignment (every pixel weighted, none picked),
    and the model says so."""
    parts = {
        "gate": AttentionGate(D, D, D, coefficients=2),
        "grid": Attention(sc.Additive(None, D, D, d_out=D)),
    }

    def run(m: Minimal) -> Tensor:
        x, g = torch.randn(2, D, 4, 4), torch.randn(2, D, 2, 2)
        gated = m.parts["gate"](x, g).output.flatten(2).transpose(1, 2)  # (2, 16, D)
        return gated + m.parts["grid"](None, gated).context

    model = Minimal(parts, run, tags=(tx.AlignmentKind.GLOBAL,))
    model.taxonomy_final = (tx.AlignmentKind,)
    return model


def winata() -> nn.Module:
    parts = {
        "dme": MetaEmbedding([8, D], D, D),
        "self_attention": QueryTagged(MultiHeadAttention(D, 4, "additive"), "self-attentive"),
        "out": nn.Linear(D, 3),
    }

    def run(m: Minimal) -> Tensor:
        x = m.parts["dme"]([torch.randn(2, 6, 8), torch.randn(2, 6, D)]).embedding
        return m.parts["out"](m.parts["self_attention"](x).context.mean(1))

    return Minimal(parts, run)


def wang89() -> nn.Module:
    parts = {"encoder": nn.GRU(D, D, batch_first=True), "capsules": CapsuleAttention(D, 3)}

    def run(m: Minimal) -> Tensor:
        h, _ = m.parts["encoder"](torch.randn(2, 6, D))
        return m.parts["capsules"](h).probabilities

    return Minimal(parts, run)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "Bahdanau et al. [3]": bahdanau,
    "Luong et al. [4]": luong,
    "Xu et al. [8]": xu,
    "Lu et al. [32]": lu,
    "Yang et al. [5]": yang,
    "Li et al. [47]": li47,
    "Vaswani et al. [13]": vaswani,
    "Wallaart and Frasincar [43]": wallaart,
    "Kiela et al. [50]": kiela,
    "Shen et al. [64]": shen,
    "Zhang et al. [74]": zhang,
    "Li et al. [105]": li105,
    "Yu et al. [106]": yu106,
    "Wang et al. [62]": wang62,
    "Oktay et al. [67]": oktay,
    "Winata et al. [52]": winata,
    "Wang et al. [89]": wang89,
}


def build(name: str) -> nn.Module:
    """The minimal model of a Table III row, by the row's name (see ``MODELS``)."""
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown Table III row {name!r}; rows: {', '.join(MODELS)}") from None


def reproduce() -> tuple[dict[str, tx.TaxonomyRow], dict[str, bool]]:
    """Describe every model; return the rows and whether each equals the survey's row."""
    rows = {name: tx.describe(make()) for name, make in MODELS.items()}
    marks = {name: rows[name].cells() == SURVEY[name] for name in rows}
    return rows, marks
