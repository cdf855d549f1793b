"""The ``pairs`` task: a small entailment-style sentence-pair task with a known answer, for
decomposable attention and co-attention (Galassi IV-D2).

A premise is 4-8 distinct tokens; a hypothesis is 1-3 tokens. The hypothesis is *entailed*
(label 1) when every one of its tokens occurs in the premise, and not (label 0) when one of
them does not. The gold alignment of a hypothesis token is its occurrence in the premise
(``--supervise-attention``: the decomposable model's α, towards it).
``--compare attention=...`` swaps the pair mechanism: ``decomposable`` (Parikh et al.; the
default), ``parallel`` (fine-grained parallel co-attention with the run's ``score`` as the
co-compatibility function and Lu et al.'s perceptron aggregation, eqs. 14-15), ``nested``
(attention-over-attention). Only ``parallel`` reads ``score``; every mechanism reads ``align``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import alignments as al
from attnkit import masks
from attnkit.features import DecomposableAttention, NestedCoAttention, ParallelCoAttention
from attnkit.scores import Score
from attnkit.tasks.base import REGISTRY, Metric, Task, Unused
from attnkit.tasks.parts import build_alignment, build_score

__all__ = ["PAIR_MECHANISMS", "PairsModel", "PairsTask", "make_pairs"]

VOCAB = 30
PREMISE = (4, 8)
HYPOTHESIS = (1, 3)


def make_pairs(n: int, *, seed: int = 0) -> dict[str, Tensor]:
    """n pairs: ``premise`` (n, 8) and ``hypothesis`` (n, 3) token ids (0 where padded), their
    masks ``premise_mask`` and ``hypothesis_mask`` (True = a real token), ``label`` (n,) and
    ``gold`` (n, 3, 8): hypothesis token j is premise token i."""
    g = torch.Generator().manual_seed(seed)
    p_max, h_max = PREMISE[1], HYPOTHESIS[1]
    p_len = torch.randint(PREMISE[0], p_max + 1, (n,), generator=g)
    h_len = torch.randint(HYPOTHESIS[0], h_max + 1, (n,), generator=g)
    p_mask = masks.from_lengths(p_len, p_max).squeeze(-2)
    h_mask = masks.from_lengths(h_len, h_max).squeeze(-2)
    perm = torch.rand(n, VOCAB, generator=g).argsort(-1)  # distinct tokens per pair
    premise = perm[:, :p_max] * p_mask
    # Each hypothesis token copies a distinct premise position among the real ones.
    pos = torch.rand(n, p_max, generator=g).masked_fill(~p_mask, 2.0).argsort(-1)[:, :h_max]
    hypothesis = premise.gather(1, pos)
    label = torch.randint(0, 2, (n,), generator=g)
    # Not entailed: one real hypothesis token becomes a token absent from the premise.
    swap = (torch.rand(n, generator=g) * h_len).long()
    absent = perm[:, p_max]  # the (p_max+1)-th token of the permutation is in no premise
    rows = torch.arange(n)
    replaced = label == 0
    hypothesis[rows[replaced], swap[replaced]] = absent[replaced]
    hypothesis = hypothesis * h_mask
    gold = F.one_hot(pos, p_max).bool() & h_mask.unsqueeze(-1)
    gold[rows[replaced], swap[replaced]] = False
    return {
        "premise": premise,
        "hypothesis": hypothesis,
        "premise_mask": p_mask,
        "hypothesis_mask": h_mask,
        "label": label,
        "gold": gold,
    }


PAIR_MECHANISMS = ("decomposable", "parallel", "nested")


class PairsModel(nn.Module):
    """Token embeddings, a pair mechanism, and a linear classifier over its representation.
    ``alignment(out)`` gives each hypothesis token's weights over the premise (B, 3, 8)."""

    def __init__(
        self,
        mechanism: str,
        d: int,
        *,
        align: str | nn.Module = "softmax",
        affinity: Score | None = None,
    ) -> None:
        super().__init__()
        if mechanism not in PAIR_MECHANISMS:
            raise ValueError(f"mechanism must be one of {PAIR_MECHANISMS}, got {mechanism!r}")
        self.mechanism = mechanism
        self.embed = nn.Embedding(VOCAB, d)
        if mechanism == "decomposable":
            self.pair: nn.Module = DecomposableAttention(d, d, 2, align=align)
            self.classify: nn.Module = nn.Identity()
        elif mechanism == "parallel":
            self.pair = ParallelCoAttention(
                d, d, affinity=affinity or "bilinear", d_w=d, align=align
            )
            self.classify = nn.Linear(2 * d, 2)
        else:
            self.pair = NestedCoAttention(align=align)
            self.classify = nn.Linear(2 * d, 2)

    def forward(self, premise, hypothesis, premise_mask, hypothesis_mask):
        """(logits (B, 2), the mechanism's output)."""
        out = self.pair(self.embed(premise), self.embed(hypothesis), premise_mask, hypothesis_mask)
        return self.classify(out.representation), out

    def alignment(self, out) -> Tensor:
        """Hypothesis tokens over premise tokens (B, n_h, n_p): the decomposable model's α
        weights; the co-attention models have one weight vector per input, so their premise
        weights are repeated per hypothesis token."""
        if self.mechanism == "decomposable":
            return out.weights2
        return out.weights1.unsqueeze(1).expand(-1, HYPOTHESIS[1], -1)


@REGISTRY.register("pairs")
class PairsTask(Task):
    description = "entailment-style pairs: is every hypothesis token in the premise?"
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 20, "n_train": 8000, "n_test": 1000, "batch_size": 32, "lr": 3e-3,
                 "d_model": 32},
        "quick": {"epochs": 5, "n_train": 3000, "n_test": 500, "batch_size": 32, "lr": 3e-3,
                  "d_model": 32},
    }  # fmt: skip
    attentions: ClassVar[tuple[str, ...]] = PAIR_MECHANISMS
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric("share of test pairs classified right (chance 0.5)"),
        "alignment_accuracy": Metric(
            "share of entailed hypothesis tokens whose strongest premise weight is their copy",
        ),
    }

    @classmethod
    def unused(cls, config: Any) -> dict[str, Unused]:
        mechanism = "decomposable" if config.attention == "default" else config.attention
        if mechanism == "parallel":
            return {}
        why = (
            f"the {mechanism} mechanism fixes its own affinity (only parallel co-attention takes "
            "the run's score)"
        )
        by = (
            f"--attention {mechanism}"
            if config.attention != "default"
            else f"task {config.task!r} (its default mechanism, {mechanism} attention)"
        )
        return {"score": Unused(by, why)}

    @classmethod
    def validate(cls, config: Any) -> None:
        mechanism = "decomposable" if config.attention == "default" else config.attention
        if config.supervise_attention > 0 and mechanism != "decomposable":
            raise ValueError(
                f"supervise_attention {config.supervise_attention}: the {mechanism} mechanism "
                "has one weight vector per input, not a weight row per hypothesis token to "
                "compare with its gold copy; supervise the decomposable mechanism (attention "
                "'default')"
            )
        if al.REGISTRY.get(config.align).stochastic:
            raise ValueError(
                f"align {config.align!r} samples its weights; the pairs task trains by "
                "back-propagation through the weights and needs a deterministic alignment"
            )

    def __init__(self, config) -> None:
        super().__init__(config)
        self.train = make_pairs(config.n_train, seed=config.seed)
        self.splits = {
            "validation": make_pairs(max(config.n_test // 2, 1), seed=config.seed + 1),
            "test": make_pairs(config.n_test, seed=config.seed + 2),
        }

    def build_model(self) -> PairsModel:
        mechanism = "decomposable" if self.config.attention == "default" else self.config.attention
        d = self.config.d_model
        align = build_alignment(self.config.align, d)
        affinity = None
        if mechanism == "parallel":
            affinity = build_score(self.config.score, head_dim=d, max_len=PREMISE[1])
        return PairsModel(mechanism, d, align=align, affinity=affinity)

    def has_split(self, name: str) -> bool:
        return name in self.splits

    def n_train(self) -> int:
        return self.train["label"].shape[0]

    @staticmethod
    def _call(model, data):
        return model(
            data["premise"], data["hypothesis"], data["premise_mask"], data["hypothesis_mask"]
        )

    def objective(self, model, index: Tensor) -> Tensor:
        data = {k: v[index] for k, v in self.train.items()}
        logits, _ = self._call(model, data)
        return F.cross_entropy(logits, data["label"])

    def _split(self, split: str) -> dict[str, Tensor]:
        return self.train if split == "train" else self.splits[split]

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, 3, 8) bool: each hypothesis token's copy in the premise (none for a token
        without one)."""
        return self._split(split)["gold"][index]

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, 3, 8): the decomposable model's α, hypothesis tokens over premise tokens."""
        data = {k: v[index] for k, v in self._split(split).items()}
        return model.alignment(self._call(model, data)[1])

    @torch.no_grad()
    def evaluate(self, model, split: str) -> dict[str, float]:
        model.eval()
        data = self.splits[split]
        logits, out = self._call(model, data)
        gold = data["gold"]
        aligned = gold.any(-1)  # hypothesis tokens with a copy in the premise
        right = gold.gather(-1, model.alignment(out).argmax(-1, keepdim=True)).squeeze(-1)
        return {
            "accuracy": float((logits.argmax(-1) == data["label"]).float().mean()),
            "alignment_accuracy": float((right & aligned).sum() / aligned.sum().clamp_min(1)),
        }

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        model.eval()
        data = {k: v[:n] for k, v in self.splits["test"].items()}
        _, out = self._call(model, data)
        w = model.alignment(out)
        maps = []
        for i in range(min(n, w.shape[0])):
            lp, lh = int(data["premise_mask"][i].sum()), int(data["hypothesis_mask"][i].sum())
            label = "entailed" if int(data["label"][i]) else "not entailed"
            maps.append(
                {
                    "title": f"pair {i} ({label}): hypothesis tokens over the premise",
                    "weights": w[i, :lh, :lp].numpy(),
                    "gold": data["gold"][i, :lh, :lp].numpy(),
                    "x_labels": [str(t) for t in data["premise"][i, :lp].tolist()],
                    "y_labels": [str(t) for t in data["hypothesis"][i, :lh].tolist()],
                    "x_title": "premise token",
                    "y_title": "hypothesis token",
                }
            )
        return maps
