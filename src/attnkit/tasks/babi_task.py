"""The ``babi`` task: bAbI-style "single supporting fact" stories (Weston et al. 2015, task 1)
from a small world simulator, answered by an end-to-end memory network (Sukhbaatar et al. 2015).

A story is 2 … ``MAX_SENTENCES`` sentences "person moved to the place"; the question is "where is
person ?"; the answer is the place of that person's last move, and that sentence is the supporting
fact: the gold attention. Everything is generated locally from the seed.
"""

from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.evaluation import entropy
from attnkit.memory.memn2n import EndToEndMemoryNetwork
from attnkit.tasks.base import REGISTRY, Metric, Task
from attnkit.tasks.parts import build_alignment, build_score

__all__ = ["VOCAB", "BabiData", "BabiTask", "make_babi"]

PEOPLE = ("mary", "john", "sandra", "daniel")
PLACES = ("kitchen", "garden", "office", "hallway", "bathroom", "bedroom")
VERBS = ("moved", "went", "journeyed", "travelled")
# Id 0 pads; the answer is a word of the same vocabulary (as in the paper, W maps to words).
VOCAB = ("<pad>", *PEOPLE, *PLACES, *VERBS, "to", "the", "where", "is")
WORD = {w: i for i, w in enumerate(VOCAB)}
MAX_SENTENCES = 10
SENTENCE = 5  # "mary moved to the kitchen"
QUESTION = 3  # "where is mary"


class BabiData(NamedTuple):
    """story (N, n, L) word ids, 0 = padding; mask (N, n, L) True = a real word; question
    (N, 3); answer (N,) word id; support (N,) index of the supporting sentence."""

    story: Tensor
    mask: Tensor
    question: Tensor
    answer: Tensor
    support: Tensor


def make_babi(n: int, *, seed: int = 0) -> BabiData:
    """``n`` single-supporting-fact stories from the world simulator, reproducibly from
    ``seed``. The person asked about has moved at least once."""
    g = torch.Generator().manual_seed(seed)

    def pick(k: int) -> int:
        return int(torch.randint(0, k, (1,), generator=g))

    story = torch.zeros(n, MAX_SENTENCES, SENTENCE, dtype=torch.long)
    question = torch.zeros(n, QUESTION, dtype=torch.long)
    answer = torch.zeros(n, dtype=torch.long)
    support = torch.zeros(n, dtype=torch.long)
    for e in range(n):
        length = 2 + pick(MAX_SENTENCES - 1)
        last: dict[str, tuple[int, str]] = {}
        for s in range(length):
            who, verb, where = (
                PEOPLE[pick(len(PEOPLE))],
                VERBS[pick(len(VERBS))],
                PLACES[pick(len(PLACES))],
            )
            story[e, s] = torch.tensor([WORD[w] for w in (who, verb, "to", "the", where)])
            last[who] = (s, where)
        asked = sorted(last)[pick(len(last))]
        question[e] = torch.tensor([WORD["where"], WORD["is"], WORD[asked]])
        support[e], place = last[asked]
        answer[e] = WORD[place]
    return BabiData(story, story != 0, question, answer, support)


@REGISTRY.register("babi")
class BabiTask(Task):
    description = "bAbI-style single supporting fact QA with a memory network; gold = the fact"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 40, "n_train": 4000, "n_test": 1000, "batch_size": 32, "lr": 1e-2,
                 "d_model": 32},
        "quick": {"epochs": 15, "n_train": 1000, "n_test": 500, "batch_size": 32, "lr": 1e-2,
                  "d_model": 32},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric(f"share of questions answered right (chance 1/{len(PLACES)})"),
        "support_attention": Metric(
            "mean attention weight on the supporting fact, at the hop where it is highest"
        ),
        "support_argmax": Metric(
            "share of questions whose strongest memory (at that hop) is the supporting fact"
        ),
        "entropy": Metric("mean entropy of the hop attention in nats (lower: sharper)", None),
    }

    def __init__(self, config) -> None:
        super().__init__(config)
        n_eval = config.n_test
        data = make_babi(config.n_train + 2 * n_eval, seed=config.seed)
        a, b = config.n_train, config.n_train + n_eval
        cut = {"train": slice(0, a), "validation": slice(a, b), "test": slice(b, b + n_eval)}
        self.splits = {k: BabiData(*(t[s] for t in data)) for k, s in cut.items()}

    def build_model(self) -> EndToEndMemoryNetwork:
        d = self.config.d_model
        score = build_score(self.config.score, d_q=d, d_k=d, d_w=d, max_len=MAX_SENTENCES)
        return EndToEndMemoryNetwork(
            len(VOCAB),
            d,
            hops=3,
            tying="adjacent",
            position_encoding=True,
            max_memories=MAX_SENTENCES,
            score=score,
            align=build_alignment(self.config.align, d),
        )

    def has_split(self, name: str) -> bool:
        return name in self.splits

    def n_train(self) -> int:
        return self.splits["train"].story.shape[0]

    @staticmethod
    def _run(model, data: BabiData):
        return model(data.story, data.question, mask=data.mask)

    def loss(self, model, index: Tensor) -> Tensor:
        train = self.splits["train"]
        batch = BabiData(*(t[index] for t in train))
        return F.cross_entropy(self._run(model, batch).logits, batch.answer)

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.splits[split]
        out = self._run(model, data)
        on_support = out.weights[torch.arange(len(data.support)), :, data.support]  # (N, K)
        hop = int(on_support.mean(0).argmax())
        hits = out.weights[:, hop].argmax(-1) == data.support
        return {
            "accuracy": float((out.logits.argmax(-1) == data.answer).float().mean()),
            "support_attention": float(on_support[:, hop].mean()),
            "support_argmax": float(hits.float().mean()),
            "entropy": entropy(out.weights),
        }

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        model.eval()
        data = BabiData(*(t[:n] for t in self.splits["test"]))
        out = self._run(model, data)
        maps = []
        for i in range(min(n, len(data.support))):
            real = int(data.mask[i].any(-1).sum())
            sentences = [
                " ".join(VOCAB[w] for w in data.story[i, s].tolist() if w) for s in range(real)
            ]
            gold = torch.zeros(out.weights.shape[1], real, dtype=torch.bool)
            gold[:, int(data.support[i])] = True
            question = " ".join(VOCAB[w] for w in data.question[i].tolist())
            maps.append(
                {
                    "title": f"{question}? answer {VOCAB[int(data.answer[i])]}, "
                    f"predicted {VOCAB[int(out.logits[i].argmax())]}",
                    "weights": out.weights[i, :, :real].numpy(),
                    "gold": gold.numpy(),
                    "x_labels": sentences,
                    "y_labels": [f"hop {k + 1}" for k in range(out.weights.shape[1])],
                    "x_title": "memory (sentence)",
                    "y_title": "hop",
                }
            )
        return maps
