"""``kv-recall``: key-value retrieval over a long context (associative recall in the form of Ba
et al. 2016 and the Zoology MQAR probe of Arora et al. 2023, one query): read ``seq_len - 1``
key-value pairs, then a queried key; answer the value stored with it.

Each pair is one position, its key and its value embedded and summed (two input channels);
keys are distinct within a sequence (drawn from ``max(seq_len, 16)`` key tokens), values are
one of ``VALUES`` classes. The last position holds the queried key with a query marker in the
value channel, and the model is read there. Chance is 1 / ``VALUES``; the gold attention of the
read-out position is the pair holding the queried key (``--supervise-attention``: the last
layer's weights at the read-out position, every head, with ``--attention full``).

Context-parallel (``--context-parallel P``, ``seq_len`` divisible by P): each sequence is split
over a ring of P processes, attention evaluated by ring attention.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.tasks.base import REGISTRY, Metric
from attnkit.tasks.long_range import LongRangeTask

__all__ = ["VALUES", "KVRecallTask", "make_kv_recall"]

VALUES = 10
QUERY = VALUES  # the value channel's query marker


def key_count(seq_len: int) -> int:
    return max(seq_len, 16)


def make_kv_recall(n: int, seq_len: int, *, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """tokens (n, seq_len, 2) (key, value channels), answers (n,), and the position of the
    queried pair (n,)."""
    if seq_len < 3:
        raise ValueError(
            f"seq_len must be >= 3 for kv-recall (2 pairs and the query), got {seq_len}"
        )
    g = torch.Generator().manual_seed(seed)
    pairs = seq_len - 1
    keys = torch.argsort(torch.rand(n, key_count(seq_len), generator=g), dim=1)[:, :pairs]
    values = torch.randint(0, VALUES, (n, pairs), generator=g)
    where = torch.randint(0, pairs, (n,), generator=g)
    rows = torch.arange(n)
    tokens = torch.empty(n, seq_len, 2, dtype=torch.long)
    tokens[:, :pairs, 0], tokens[:, :pairs, 1] = keys, values
    tokens[:, -1, 0], tokens[:, -1, 1] = keys[rows, where], QUERY
    return tokens, values[rows, where], where


@REGISTRY.register("kv-recall")
class KVRecallTask(LongRangeTask):
    description = (
        "key-value retrieval: seq_len - 1 pairs, then a key; answer its value (10 classes), "
        "attention chosen by --attention"
    )
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 10, "n_train": 20000, "n_test": 2000, "batch_size": 32, "lr": 1e-3,
                 "d_model": 64, "seq_len": 512, "score": "scaled_dot"},
        "quick": {"epochs": 4, "n_train": 2000, "n_test": 500, "batch_size": 32, "lr": 3e-3,
                  "d_model": 32, "seq_len": 32, "score": "scaled_dot"},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric(
            f"share of test queries answered with the stored value (chance 1/{VALUES})"
        ),
        "majority_share": Metric(
            "share of the commonest value among the test answers (always guessing it)", None
        ),
    }
    vocab = (0, VALUES + 1)  # key vocabulary set per instance
    classes = VALUES
    readout = -1
    context_parallel = True

    @classmethod
    def validate(cls, config) -> None:
        if config.seq_len < 3:
            raise ValueError(f"seq_len must be >= 3 for kv-recall, got {config.seq_len}")
        name = cls.attention_name(config)
        if config.supervise_attention > 0 and name != "full":
            raise ValueError(
                f"supervise_attention needs weights that are a distribution over the keys; "
                f"attention {name!r} does not give them (use --attention full)"
            )
        super().validate(config)

    def __init__(self, config) -> None:
        super().__init__(config)
        self.vocab = (key_count(config.seq_len), VALUES + 1)
        tokens, answers, where = make_kv_recall(config.n_train, config.seq_len, seed=config.seed)
        self.train, self.where = (tokens, answers), {"train": where}
        self.splits = {}
        for k, name in ((2, "validation"), (1, "test")):
            tokens, answers, where = make_kv_recall(
                config.n_test // k, config.seq_len, seed=config.seed + 10 + k
            )
            self.splits[name], self.where[name] = (tokens, answers), where

    def gold_positions(self, split: str) -> Tensor:
        return self.where[split]

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, 1, N) bool: the read-out position's gold, the pair holding the queried key
        (every head)."""
        where = self.where[split][index]
        return F.one_hot(where, self.config.seq_len).bool().unsqueeze(1)

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, H, N): the last layer's weights at the read-out position, every head."""
        tokens = (self.train if split == "train" else self.splits[split])[0][index]
        return model.last_weights(tokens)[:, :, self.readout]

    def token_labels(self, tokens: Tensor) -> list[str]:
        return [f"{int(k)}:{'?' if int(v) == QUERY else int(v)}" for k, v in tokens]
