"""The bAbI-style tasks (Weston et al. 2015, tasks 1, 2, 6 and 7; stories from the world
simulator of :mod:`attnkit.tasks.babi`), answered by an end-to-end memory network (Sukhbaatar et
al. 2015) or, with ``--attention memory_network``, by a strongly supervised memory network
(Weston, Chopra and Bordes 2015).

- ``babi``: single supporting fact, "where is mary ?"
- ``babi-two-facts``: two supporting facts, "where is the football ?"
- ``babi-yes-no``: "is mary in the kitchen ?"
- ``babi-counting``: "how many objects is mary carrying ?"

The supporting facts are the gold attention: the metrics report how much of each hop's weight falls
on them, and ``--supervise-attention`` trains every hop of the end-to-end network towards them (not
with linear start, whose hop weights are raw scores). On ``babi-two-facts``, where training with the
softmax from the start gets stuck, the end-to-end network trains with the paper's linear start (Sec.
4.2): its hops go without the softmax until the validation loss stops decreasing (at the latest
after half of the epochs); meanwhile the hop weights are raw scores, so the support attention and
entropy printed for those epochs are not shares.

The memory network reads bag-of-words memories with one more feature per memory, its age (how
many sentences were written after it), as a one-hot block: Weston et al. (Sec. 3.4) model write
time with pairwise time features; the age block lets the same linear scores s_O prefer the most
recent of two matching memories. It is trained by the paper's margin ranking loss on the gold
supporting facts and the answer (eqs. 6-8) and answers with hard max addressing (eqs. 2-3), so
it needs a fixed number of ordered supporting facts: counting is refused.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.evaluation import entropy
from attnkit.memory.memn2n import EndToEndMemoryNetwork
from attnkit.memory.memnet import MemoryNetwork, MemoryNetworkOutput
from attnkit.tasks.babi import KINDS, PLACES, VOCAB, BabiData, make_babi
from attnkit.tasks.base import REGISTRY, Metric, Task, Unused
from attnkit.tasks.parts import build_alignment, build_score

__all__ = [
    "BabiCountingTask",
    "BabiMemoryNetwork",
    "BabiTask",
    "BabiTwoFactsTask",
    "BabiYesNoTask",
]


class BabiMemoryNetwork(nn.Module):
    """A :class:`~attnkit.memory.memnet.MemoryNetwork` over word ids: each sentence becomes its
    bag of words plus a one-hot of its age, the question its bag of words; ``hops`` = the
    number of supporting facts. Same call as the end-to-end network: (story, question, mask)."""

    def __init__(self, max_sentences: int, d: int, hops: int, align: str | nn.Module | None):
        super().__init__()
        self.max_sentences = max_sentences
        self.memnet = MemoryNetwork(
            len(VOCAB) + max_sentences, d, hops=hops, n_answers=len(VOCAB), align=align
        )

    def features(self, story: Tensor, question: Tensor, mask: Tensor):
        """(x (B, V + n), memories (B, n, V + n), keep (B, n)) from ids and the word mask."""
        v, n = len(VOCAB), self.max_sentences
        bags = F.one_hot(story, v).to(torch.get_default_dtype())
        bags = (bags * mask.unsqueeze(-1)).sum(-2)  # (B, n, V), padding ids dropped
        keep = mask.any(-1)  # (B, n)
        age = (keep.sum(-1, keepdim=True) - 1 - torch.arange(n)).clamp_min(0)
        memories = torch.cat([bags, F.one_hot(age, n).to(bags.dtype)], -1)
        x = F.one_hot(question, v).to(bags.dtype)
        x = (x * (question != 0).unsqueeze(-1)).sum(-2)
        return torch.cat([x, x.new_zeros(x.shape[0], n)], -1), memories, keep

    def forward(self, story: Tensor, question: Tensor, mask: Tensor) -> MemoryNetworkOutput:
        x, memories, keep = self.features(story, question, mask)
        return self.memnet(x, memories, mask=keep)

    def margin_ranking_loss(self, data: BabiData) -> Tensor:
        x, memories, keep = self.features(data.story, data.question, data.mask)
        return self.memnet.margin_ranking_loss(x, memories, data.supports, data.answer, mask=keep)


@REGISTRY.register("babi")
class BabiTask(Task):
    description = "bAbI-style single supporting fact QA with a memory network; gold = the fact"
    kind: ClassVar[str] = "single"
    linear_start: ClassVar[bool] = False  # the end-to-end network's linear start (Sec. 4.2)
    answers: ClassVar[str] = f"chance 1/{len(PLACES)}"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 40, "n_train": 4000, "n_test": 1000, "batch_size": 32, "lr": 1e-2,
                 "d_model": 32},
        "quick": {"epochs": 15, "n_train": 1000, "n_test": 500, "batch_size": 32, "lr": 1e-2,
                  "d_model": 32},
    }  # fmt: skip
    attentions: ClassVar[tuple[str, ...]] = ("memory_network",)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.metrics = cls._metrics()

    @classmethod
    def _metrics(cls) -> dict[str, Metric]:
        return {
            "accuracy": Metric(f"share of questions answered right ({cls.answers})"),
            "support_attention": Metric(
                "mean attention weight on the supporting facts, at the hop where it is highest"
            ),
            "support_argmax": Metric(
                "share of questions whose strongest memory (at that hop) is a supporting fact"
            ),
            "entropy": Metric("mean entropy of the hop attention in nats (lower: sharper)", None),
        }

    @classmethod
    def unused(cls, config) -> dict[str, Unused]:
        if config.attention != "memory_network":
            return {}
        why = (
            "Weston et al.'s memory network scores memories by its own bilinear match and "
            "addresses them by hard max (eqs. 2-3)"
        )
        return {key: Unused("--attention memory_network", why) for key in ("score", "align")}

    @classmethod
    def validate(cls, config) -> None:
        if config.supervise_attention > 0 and config.attention == "memory_network":
            raise ValueError(
                f"supervise_attention {config.supervise_attention}: the memory network "
                "(--attention memory_network) is already trained on the supporting facts by its "
                "margin ranking loss (Weston et al. eqs. 6-8)"
            )
        if config.supervise_attention > 0 and cls.linear_start:
            raise ValueError(
                f"supervise_attention {config.supervise_attention}: task {config.task!r} trains "
                "with linear start, whose hop weights are raw scores, not distributions to "
                "compare with the supporting facts"
            )
        if config.attention != "memory_network":
            return
        if not KINDS[cls.kind].supports:
            raise ValueError(
                f"attention 'memory_network' finds a fixed number of supporting facts one hop "
                f"at a time (Weston et al.); task {config.task!r} has a varying number of them: "
                f"use the end-to-end memory network (attention 'default')"
            )
        if config.align not in ("softmax", "hard"):
            raise ValueError(
                f"attention 'memory_network' addresses memories by hard max (Weston et al. eqs. "
                f"2-3) and is trained by its margin ranking loss; align {config.align!r} is not "
                f"used by it: leave align at its default"
            )

    def __init__(self, config) -> None:
        super().__init__(config)
        n_eval = config.n_test
        data = make_babi(config.n_train + 2 * n_eval, kind=self.kind, seed=config.seed)
        a, b = config.n_train, config.n_train + n_eval
        cut = {"train": slice(0, a), "validation": slice(a, b), "test": slice(b, b + n_eval)}
        self.splits = {k: BabiData(*(t[s] for t in data)) for k, s in cut.items()}

    def build_model(self) -> nn.Module:
        d = self.config.d_model
        spec = KINDS[self.kind]
        if self.config.attention == "memory_network":
            return BabiMemoryNetwork(spec.max_sentences, d, spec.supports, None)
        score = build_score(self.config.score, head_dim=d, max_len=spec.max_sentences)
        return EndToEndMemoryNetwork(
            len(VOCAB),
            d,
            hops=3,
            tying="adjacent",
            position_encoding=True,
            max_memories=spec.max_sentences,
            score=score,
            align=build_alignment(self.config.align, d),
            linear_start=self.linear_start,
        )

    def end_epoch(self, model, epoch: int) -> str | None:
        """Linear start (Sukhbaatar et al. Sec. 4.2): the end-to-end network's hops go without
        the softmax until the validation loss stops decreasing, and at the latest after half of
        the epochs, so that the run ends with the softmax model."""
        if not isinstance(model, EndToEndMemoryNetwork) or not model.linear_start_active:
            return None
        with torch.no_grad():
            model.eval()
            data = self.splits["validation"]
            loss = float(F.cross_entropy(self._run(model, data).logits, data.answer))
        if model.linear_start_step(loss) or epoch >= self.config.epochs / 2:
            model.end_linear_start()
            return "linear start ended: softmax re-inserted"
        return "linear start: hop weights are the raw scores"

    def has_split(self, name: str) -> bool:
        return name in self.splits

    def n_train(self) -> int:
        return self.splits["train"].story.shape[0]

    @staticmethod
    def _run(model, data: BabiData):
        return model(data.story, data.question, mask=data.mask)

    def objective(self, model, index: Tensor) -> Tensor:
        train = self.splits["train"]
        batch = BabiData(*(t[index] for t in train))
        if isinstance(model, BabiMemoryNetwork):
            return model.margin_ranking_loss(batch)
        return F.cross_entropy(self._run(model, batch).logits, batch.answer)

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, 1, n) bool: the supporting facts, for every hop."""
        return self.splits[split].gold[index].unsqueeze(1)

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, K, n): every hop's weights over the memories (end-to-end memory network)."""
        data = self.splits[split]
        return model(data.story[index], data.question[index], mask=data.mask[index]).weights

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.splits[split]
        out = self._run(model, data)
        gold = data.gold.unsqueeze(1)  # (N, 1, n)
        on_support = (out.weights * gold).sum(-1)  # (N, K): weight on the supporting facts
        hop = int(on_support.mean(0).argmax())
        strongest = out.weights[:, hop].argmax(-1, keepdim=True)
        hits = data.gold.gather(-1, strongest).squeeze(-1)
        return {
            "accuracy": float((out.logits.argmax(-1) == data.answer).float().mean()),
            "support_attention": float(on_support[:, hop].mean()),
            "support_argmax": float(hits.float().mean()),
            # during a memory network's linear start the hops weight by raw scores, which are
            # no distribution: their entropy is undefined
            "entropy": entropy(out.weights) if bool((out.weights >= 0).all()) else math.nan,
        }

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        model.eval()
        data = BabiData(*(t[:n] for t in self.splits["test"]))
        out = self._run(model, data)
        maps = []
        for i in range(min(n, data.story.shape[0])):
            real = int(data.mask[i].any(-1).sum())
            sentences = [
                " ".join(VOCAB[w] for w in data.story[i, s].tolist() if w) for s in range(real)
            ]
            hops = out.weights.shape[1]
            gold = data.gold[i, :real].unsqueeze(1).expand(real, hops)
            question = " ".join(VOCAB[w] for w in data.question[i].tolist() if w)
            # sentences down the side (long labels read across), hops along the bottom
            maps.append(
                {
                    "title": f"{question}? answer {VOCAB[int(data.answer[i])]}, "
                    f"predicted {VOCAB[int(out.logits[i].argmax())]}",
                    "weights": out.weights[i, :, :real].T.numpy(),
                    "gold": gold.numpy(),
                    "x_labels": [f"hop {k + 1}" for k in range(hops)],
                    "y_labels": [f"{s + 1}. {text}" for s, text in enumerate(sentences)],
                    "x_title": "hop",
                    "y_title": "memory (sentence of the story)",
                }
            )
        return maps


BabiTask.metrics = BabiTask._metrics()


@REGISTRY.register("babi-two-facts")
class BabiTwoFactsTask(BabiTask):
    description = "bAbI-style two supporting facts: where is an object? gold = both facts"
    kind = "two-facts"
    linear_start = True


@REGISTRY.register("babi-yes-no")
class BabiYesNoTask(BabiTask):
    description = "bAbI-style yes/no questions: is a person in a place? gold = the last move"
    kind = "yes-no"
    answers = "chance 1/2"


@REGISTRY.register("babi-counting")
class BabiCountingTask(BabiTask):
    description = "bAbI-style counting: how many objects is a person carrying? gold = the facts"
    kind = "counting"
    answers = "none ... three"
