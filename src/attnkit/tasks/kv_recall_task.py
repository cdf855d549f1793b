"""``kv-recall``: key-value retrieval over a long context (associative recall in the form of Ba
et al. 2016 and the Zoology MQAR probe of Arora et al. 2023, one query): read ``seq_len - 1``
key-value pairs, then a queried key; answer the value stored with it.

Each pair is one position, its key and its value embedded and summed (two input channels);
keys are distinct within a sequence (drawn from ``max(seq_len, 16)`` key tokens), values are
one of ``VALUES`` classes. The last position holds the queried key with a query marker in the
value channel, and the model is read there. Chance is 1 / ``VALUES``. The task's settings
(:class:`KVRecallSettings`, ``attnkit run kv-recall --set NAME=VALUE``) change the number of
pairs (fewer than ``seq_len - 1``: padding between the pairs and the query), the key
vocabulary and the number of values. The gold attention of the
read-out position is the pair holding the queried key (``--supervise-attention``: the last
layer's weights at the read-out position, every head, with ``--attention full``).

Hybrid stacks (task settings ``layers`` and ``num_layers``): ``--set layers="1 gated_deltanet :
1 full"`` gives each encoder layer its own mixing, a pattern of :mod:`attnkit.layer_plan`
repeated to ``num_layers`` (2 by default) layers: ``full``, ``sliding:W`` (full attention over
the positions less than W away), a name ``--attention`` takes, or a token mixer of
:mod:`attnkit.mixers` (``mixer.gated_deltanet``, ...).

Context-parallel (``--context-parallel P``, ``seq_len`` divisible by P): each sequence is split
over a ring of P processes, attention evaluated by ring attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import layer_plan
from attnkit.tasks.base import REGISTRY, Metric, Unused, at_least, setting
from attnkit.tasks.long_range import HEADS, LAYERS, EncoderClassifier, LongRangeTask
from attnkit.tasks.long_range import layer_arguments as _layer_arguments

__all__ = ["VALUES", "KVRecallSettings", "KVRecallTask", "make_kv_recall"]

VALUES = 10  # the default number of values
QUERY = VALUES  # the value channel's query marker (with the default number of values)
MIN_KEYS = 16  # the default smallest key vocabulary


def key_count(seq_len: int, min_keys: int = MIN_KEYS) -> int:
    return max(seq_len, min_keys)


@dataclass(frozen=True)
class KVRecallSettings:
    """The settings of ``kv-recall`` (``attnkit run kv-recall --set NAME=VALUE``)."""

    num_pairs: int | None = setting(
        None, "key-value pairs before the query; None: seq_len - 1 (the whole context)"
    )
    keys: int | None = setting(
        None, "key tokens the distinct keys are drawn from; None: max(seq_len, 16)"
    )
    values: int = setting(VALUES, "value classes (chance 1/values)")
    layers: str | None = setting(
        None,
        "a plan, one mixing per layer ('1 gated_deltanet : 1 full', sliding:W, mixer.NAME), "
        "repeated to num_layers; None: every layer is --attention",
    )
    num_layers: int = setting(LAYERS, "encoder layers")

    def __post_init__(self) -> None:
        at_least(self, 2, "num_pairs", "keys", "values")
        at_least(self, 1, "num_layers")
        if self.layers is not None:
            layer_plan.split(self.layers, self.num_layers)  # a malformed plan: refused now
        if None not in (self.keys, self.num_pairs) and self.keys < self.num_pairs:
            raise ValueError(
                f"setting keys ({self.keys}) must be >= num_pairs ({self.num_pairs}): the "
                "keys of a sequence are distinct"
            )


def make_kv_recall(
    n: int,
    seq_len: int,
    *,
    seed: int = 0,
    pairs: int | None = None,
    keys: int | None = None,
    values: int = VALUES,
) -> tuple[Tensor, Tensor, Tensor]:
    """tokens (n, seq_len, 2) (key, value channels), answers (n,), and the position of the
    queried pair (n,).

    ``pairs`` key-value pairs (default ``seq_len - 1``) fill the first positions, keys distinct
    and drawn from ``keys`` key tokens (default ``max(seq_len, 16)``), values from ``values``
    classes; the query (its key, the value channel's marker ``values``) is the last position.
    Positions between are padding: key token ``keys``, value token ``values + 1``."""
    if seq_len < 3:
        raise ValueError(
            f"seq_len must be >= 3 for kv-recall (2 pairs and the query), got {seq_len}"
        )
    pairs = seq_len - 1 if pairs is None else pairs
    keys = key_count(seq_len) if keys is None else keys
    if not 2 <= pairs <= seq_len - 1:
        raise ValueError(f"pairs must be in [2, seq_len - 1 = {seq_len - 1}], got {pairs}")
    if keys < pairs:
        raise ValueError(f"keys must be >= pairs ({pairs}), got {keys}")
    g = torch.Generator().manual_seed(seed)
    stored = torch.argsort(torch.rand(n, keys, generator=g), dim=1)[:, :pairs]
    value = torch.randint(0, values, (n, pairs), generator=g)
    where = torch.randint(0, pairs, (n,), generator=g)
    rows = torch.arange(n)
    tokens = torch.empty(n, seq_len, 2, dtype=torch.long)
    tokens[:, :pairs, 0], tokens[:, :pairs, 1] = stored, value
    tokens[:, pairs:-1, 0], tokens[:, pairs:-1, 1] = keys, values + 1  # padding
    tokens[:, -1, 0], tokens[:, -1, 1] = stored[rows, where], values
    return tokens, value[rows, where], where


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
            f"share of test queries answered with the stored value (chance 1/values, "
            f"1/{VALUES} by default)"
        ),
        "majority_share": Metric(
            "share of the commonest value among the test answers (always guessing it)", None
        ),
    }
    vocab = (0, VALUES + 1)  # key vocabulary set per instance
    classes = VALUES
    readout = -1
    context_parallel = True
    settings = KVRecallSettings

    @classmethod
    def validate(cls, config) -> None:
        if config.seq_len < 3:
            raise ValueError(f"seq_len must be >= 3 for kv-recall, got {config.seq_len}")
        s = cls.settings_of(config)
        if s.num_pairs is not None and s.num_pairs > config.seq_len - 1:
            raise ValueError(
                f"setting num_pairs {s.num_pairs} does not fit seq_len {config.seq_len}: at "
                f"most seq_len - 1 = {config.seq_len - 1} pairs (the last position is the query)"
            )
        pairs = config.seq_len - 1 if s.num_pairs is None else s.num_pairs
        if s.keys is not None and s.keys < pairs:
            raise ValueError(
                f"setting keys {s.keys} is fewer than the {pairs} pairs of a sequence (its keys "
                "are distinct); set keys >= num_pairs"
            )
        names = cls.layer_names(config)
        if s.layers is not None:
            if config.attention != "default":
                raise ValueError(
                    f"--attention {config.attention} and setting layers {s.layers!r} both "
                    "choose the layers' attention; name it in the plan"
                )
            if getattr(config, "context_parallel", 1) > 1:
                raise ValueError(
                    f"context_parallel {config.context_parallel}: a plan of layers (setting "
                    "layers) cannot be split over a ring; only full attention can"
                )
            sizes = {"score": config.score, "align": config.align, "num_heads": HEADS,
                     "max_len": config.seq_len}  # fmt: skip
            with torch.random.fork_rng(devices=[]):  # names and sizes refused now
                for each in dict.fromkeys(names):
                    _layer_arguments(each, max(config.d_model // HEADS, 1) * HEADS, **sizes)
        if config.supervise_attention > 0 and names[-1] != "full":
            raise ValueError(
                f"supervise_attention needs weights that are a distribution over the keys; "
                f"attention {names[-1]!r} does not give them (the last layer's; use --attention "
                "full, or a plan whose last layer is full)"
            )
        super().validate(config)

    @classmethod
    def layer_names(cls, config) -> list[str]:
        """The mixing of each encoder layer: the plan of setting ``layers`` repeated to
        ``num_layers``, or ``num_layers`` times the run's attention."""
        s = cls.settings_of(config)
        if s.layers is None:
            return [cls.attention_name(config)] * s.num_layers
        return layer_plan.split(s.layers, s.num_layers)

    @classmethod
    def unused(cls, config) -> dict[str, Unused]:
        plan = cls.settings_of(config).layers
        if plan is None:
            return super().unused(config)
        if any(n == "full" or n.startswith("sliding") for n in cls.layer_names(config)):
            return {}
        why = "no layer of the plan is full attention (no score or alignment is built)"
        return {key: Unused(f"--set layers={plan!r}", why) for key in ("score", "align")}

    def build_model(self) -> EncoderClassifier:
        c, s = self.config, self.settings
        return EncoderClassifier(
            self.vocab,
            self.classes,
            embed_dim=c.d_model,
            max_len=self.length(),
            attention=self.attention_name(c),
            score=c.score,
            align=c.align,
            readout=self.readout,
            layers=s.num_layers,
            names=None if s.layers is None else self.layer_names(c),
        )

    def __init__(self, config) -> None:
        super().__init__(config)
        s = self.settings
        pairs = config.seq_len - 1 if s.num_pairs is None else s.num_pairs
        keys = key_count(config.seq_len) if s.keys is None else s.keys
        padded = pairs < config.seq_len - 1  # a padding token in each channel
        self.vocab = (keys + padded, s.values + 1 + padded)
        self.classes = s.values
        sizes = {"pairs": pairs, "keys": keys, "values": s.values}
        tokens, answers, where = make_kv_recall(
            config.n_train, config.seq_len, seed=config.seed, **sizes
        )
        self.train, self.where = (tokens, answers), {"train": where}
        self.splits = {}
        for k, name in ((2, "validation"), (1, "test")):
            tokens, answers, where = make_kv_recall(
                config.n_test // k, config.seq_len, seed=config.seed + 10 + k, **sizes
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
        query, pad = self.settings.values, self.settings.values + 1
        return [
            "pad" if int(v) == pad else f"{int(k)}:{'?' if int(v) == query else int(v)}"
            for k, v in tokens
        ]
