"""``mqar``: multi-query associative recall (MQAR; Arora et al. 2023, "Zoology: Measuring and
Improving Recall in Efficient Language Models", Sec. 3), the probe on which exact attention
recalls well and attention with a fixed-size state degrades once the pairs outgrow the state.

A sequence of ``seq_len`` tokens holds P = ``seq_len // 4`` key-value pairs
``k_1 v_1 … k_P v_P`` (keys distinct, from :func:`key_count` key tokens; values from ``VALUES``
value tokens, a vocabulary disjoint from the keys), then every stored key once more, in random
order, each followed by its value, ``q_1 a_1 … q_P a_P``; ``seq_len mod 4`` padding tokens end
the sequence. A causal model reads the sequence left to right and, at each query key ``q_i``,
predicts the value that was stored with it (chance 1 / ``VALUES``). The number of pairs is set
through the sequence length (``--seq-len 256`` asks for 64 pairs) or by the task's setting
``num_pairs`` (``--set num_pairs=16``: 16 pairs, 4 · 16 tokens, then padding to ``seq_len``);
its other settings (:class:`MQARSettings`) are the key vocabulary and the number of values.

The model is a small decoder: token embeddings, learned positions, 2 pre-norm layers of
attention (causal) + MLP, a final LayerNorm and a linear read-out over the values. The attention
(run configuration key ``attention``) is one of :data:`ATTENTIONS`: ``full`` (exact attention,
:class:`attnkit.MultiHeadAttention` with the run's score and alignment, scaled dot product and
softmax by default), an attention-slot part in a :class:`attnkit.MultiHeadAttention` (one per
layer), or ``latent``, DeepSeek's multi-head latent attention, a whole layer. As the short
convolutions of the gated linear-attention layers (Mamba-2, Gated DeltaNet) do, every model's
input at a position also adds an embedding of the token before it (the same for every
mechanism), so that a value's position carries its key: one attention read then answers a
query, and what is compared is the recall of the attention, not its ability to build an
induction circuit first.

Hybrid stacks (task settings ``layers`` and ``num_layers``): ``--set layers="1 gated_deltanet :
1 full"`` gives each layer its own mixing, a pattern of :mod:`attnkit.layer_plan` repeated to
``num_layers`` (2 by default) layers, whose names are those of :data:`ATTENTIONS`, ``sliding:W``
(exact attention over the last W positions) and the token mixers of :mod:`attnkit.mixers`
(``mixer.gated_deltanet``, ...); ``--compare "set.layers=full,1 gated_deltanet : 1 full"`` sets a
hybrid beside a pure stack.

Gold attention: at the query of a stored key, the position of that pair's value (``2j + 1`` for
pair j), whose input carries both the key and the value. ``--supervise-attention λ`` adds
λ · KL(gold ‖ a) over the query rows of the last layer's weights, every head, for ``full``
(whose weights are a distribution over the keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit as ak
from attnkit import arguments, layer_plan, masks
from attnkit.mixers import TokenMixer
from attnkit.tasks import parts
from attnkit.tasks.base import REGISTRY, Metric, Task, Unused, at_least, setting

__all__ = [
    "ATTENTIONS",
    "VALUES",
    "MQARDecoder",
    "MQARSettings",
    "MQARTask",
    "build_attention_layer",
    "build_layer_mixing",
    "key_count",
    "layer_names",
    "make_mqar",
    "pair_count",
]

VALUES = 32
HEADS = 2
LAYERS = 2

# The mechanisms the task builds; "full" is exact attention, "latent" a whole layer.
ATTENTIONS = (
    "full", "linear", "retention", "gla", "mamba2", "deltanet", "gated_deltanet",
    "differential", "native_sparse", "deepseek_sparse", "sink", "latent",
)  # fmt: skip

# Parts that are causal by construction: they get no mask (kernelized attention honours only
# key padding; the rest are causal whatever the mask). The others get a causal mask.
CAUSAL_PARTS = frozenset(
    {"linear", "retention", "gla", "mamba2", "deltanet", "gated_deltanet", "native_sparse",
     "deepseek_sparse"}
)  # fmt: skip

# Native Sparse Attention at the task's lengths: blocks of 8 (compression stride 4), 4 selected
# blocks (1 ending at the query, 3 chosen) and a window of 16 — the paper's 32/16/64/16/512 at
# 64k tokens would make every query here see every key through the window alone.
NSA_SIZES: dict[str, int] = {
    "compress_block": 8, "compress_stride": 4, "select_block": 8, "num_selected": 4,
    "num_initial": 0, "num_local": 1, "window": 16,
}  # fmt: skip
DSA_TOP_K = 16  # keys each query of DeepSeek sparse attention reads


def pair_count(seq_len: int) -> int:
    """P, the number of key-value pairs in a sequence of ``seq_len`` tokens."""
    return seq_len // 4


def key_count(pairs: int) -> int:
    """The size of the key vocabulary: 64, or 2P when that is larger."""
    return max(64, 2 * pairs)


@dataclass(frozen=True)
class MQARSettings:
    """The settings of ``mqar`` (``attnkit run mqar --set NAME=VALUE``)."""

    num_pairs: int | None = setting(
        None, "key-value pairs in a sequence (4 tokens each); None: seq_len // 4"
    )
    keys: int | None = setting(
        None, "key tokens the distinct keys are drawn from; None: max(64, 2 · pairs)"
    )
    values: int = setting(VALUES, "value tokens, the classes of an answer (chance 1/values)")
    layers: str | None = setting(
        None,
        "a plan, one mixing per layer ('1 gated_deltanet : 1 full', sliding:W, mixer.NAME), "
        "repeated to num_layers; None: every layer is --attention",
    )
    num_layers: int = setting(LAYERS, "decoder layers")

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


def make_mqar(
    n: int,
    seq_len: int,
    *,
    seed: int = 0,
    pairs: int | None = None,
    keys: int | None = None,
    values: int = VALUES,
) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` MQAR sequences of ``pairs`` key-value pairs (default ``seq_len // 4``), keys
    distinct and drawn from ``keys`` key tokens (default ``key_count(P)``), values from
    ``values`` value tokens (default ``VALUES``).

    Returns:
        tokens (n, seq_len): key k is token k, value v is token ``keys + v``, padding
        is ``keys + values``; answers (n, P): the value (0 … values − 1) that query i
        (at position 2P + 2i) must recall; gold (n, P): the position of that pair's value.
    """
    if seq_len < 8:
        raise ValueError(
            f"seq_len must be >= 8 for mqar (2 pairs and their queries), got {seq_len}"
        )
    p = pair_count(seq_len) if pairs is None else pairs
    if not 2 <= p <= pair_count(seq_len):
        raise ValueError(f"pairs must be in [2, seq_len // 4 = {pair_count(seq_len)}], got {p}")
    k = key_count(p) if keys is None else keys
    if k < p:
        raise ValueError(f"keys must be >= pairs ({p}), got {k}")
    g = torch.Generator().manual_seed(seed)
    stored = torch.argsort(torch.rand(n, k, generator=g), dim=1)[:, :p]
    value = torch.randint(0, values, (n, p), generator=g)
    order = torch.argsort(torch.rand(n, p, generator=g), dim=1)  # which pair query i asks
    answers = value.gather(1, order)
    tokens = torch.full((n, seq_len), k + values, dtype=torch.long)
    tokens[:, 0 : 2 * p : 2], tokens[:, 1 : 2 * p : 2] = stored, value + k
    tokens[:, 2 * p : 4 * p : 2] = stored.gather(1, order)
    tokens[:, 2 * p + 1 : 4 * p : 2] = answers + k
    return tokens, answers, 2 * order + 1


def _part(name: str, head_dim: int, num_heads: int, max_len: int, depth: int, config: Any):
    if name == "full":
        return parts.build_attention(config.score, config.align, head_dim, max_len)
    if name == "linear":
        return ak.mechanisms.build("linear", causal=True)
    if name == "differential":
        return ak.mechanisms.build("differential", head_dim=head_dim, depth=depth)
    if name == "native_sparse":
        return ak.mechanisms.build("native_sparse", head_dim=head_dim, **NSA_SIZES)
    if name == "deepseek_sparse":
        return ak.mechanisms.build("deepseek_sparse", head_dim=head_dim, top_k=DSA_TOP_K)
    return parts.build_slot_attention(name, head_dim=head_dim, num_heads=num_heads, max_len=max_len)


@arguments.renamed(d_model="embed_dim")
def build_attention_layer(
    name: str, embed_dim: int, *, max_len: int, depth: int = 1, config: Any = None
) -> nn.Module:
    """The attention of decoder layer ``depth`` (from 1): a :class:`attnkit.MultiHeadAttention`
    of ``HEADS`` heads around the part ``name``, or for ``"latent"`` a
    :class:`attnkit.modern.MultiHeadLatentAttention` (latent of size embed_dim / 2). ``config``
    gives ``score`` and ``align`` for ``"full"``.

    Raises ValueError for a name not in :data:`ATTENTIONS` or sizes the part refuses.
    """
    if name not in ATTENTIONS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {name!r}")
    if name == "latent":
        return ak.mechanisms.build(
            "latent", embed_dim=embed_dim, num_heads=HEADS, kv_rank=max(embed_dim // 2, 1)
        )
    head_dim = embed_dim // HEADS
    part = _part(name, head_dim, HEADS, max_len, depth, config)
    return ak.MultiHeadAttention(embed_dim, HEADS, attention=part)


def layer_names(config: Any) -> list[str]:
    """The mixing of each decoder layer: the plan of setting ``layers`` repeated to
    ``num_layers``, or ``num_layers`` times the run's attention."""
    s = MQARTask.settings_of(config)
    if s.layers is None:
        return [MQARTask.attention_name(config)] * s.num_layers
    return layer_plan.split(s.layers, s.num_layers)


def build_layer_mixing(
    name: str, embed_dim: int, *, max_len: int, depth: int, layers: int, config: Any = None
) -> tuple[nn.Module, Tensor | None]:
    """The mixing of decoder layer ``depth`` (from 1) of ``layers``, named as in a plan — a
    name of :data:`ATTENTIONS`, ``sliding:W`` or a token mixer — and the window W of a sliding
    layer (else None). ValueError naming the options for another name."""
    if name.startswith("sliding"):
        window = layer_plan.parse(name)[0].window  # a malformed window: its error
        return build_attention_layer("full", embed_dim, max_len=max_len, config=config), window
    if name in ATTENTIONS:
        layer = build_attention_layer(name, embed_dim, max_len=max_len, depth=depth, config=config)
        return layer, None
    mixer = layer_plan.mixer_name(name)
    if mixer is None:
        mixers = [f"mixer.{m}" for m in ak.mixers.REGISTRY.available()]
        raise ValueError(
            f"layers: unknown layer {name!r}; mqar's layers are: {', '.join(ATTENTIONS)}, "
            f"sliding:W, {', '.join(mixers)}"
        )
    built = layer_plan.build_mixer(
        mixer, embed_dim=embed_dim, num_heads=HEADS, index=depth - 1, depth=layers
    )
    return built, None


class _Layer(nn.Module):
    def __init__(
        self, embed_dim: int, attention: nn.Module, *, name: str = "full", window=None
    ) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.attention = attention
        self.mlp = nn.Sequential(
            nn.Linear(embed_dim, 2 * embed_dim), nn.GELU(), nn.Linear(2 * embed_dim, embed_dim)
        )
        self.mixes = isinstance(attention, TokenMixer)  # a whole layer: no mask, no weights
        self.causal = self.mixes or name in CAUSAL_PARTS  # causal by construction: no mask
        self.window = window

    def mask(self, n: int, device: torch.device) -> Tensor | None:
        """The layer's (N, N) mask: causal, and within the window of a sliding layer."""
        if self.causal:
            return None
        mask = masks.causal(n, device=device)
        if self.window is not None:
            mask = mask & ~masks.causal(n, device=device).tril(-self.window)
        return mask

    def forward(self, x: Tensor, mask: Tensor | None, need_weights: bool):
        if self.mixes:
            return x + self.mlp(self.norm2(x := x + self.attention(self.norm1(x)))), None
        out = self.attention(self.norm1(x), mask=mask, need_weights=need_weights)
        x = x + out[0]
        return x + self.mlp(self.norm2(x)), out.weights


@arguments.renamed(d_model="embed_dim")
class MQARDecoder(nn.Module):
    """A causal decoder for MQAR: E_tok[x_t] + E_prev[x_{t−1}] + E_pos[t] → ``LAYERS``
    pre-norm layers (attention, then an MLP of width 2 · embed_dim) → LayerNorm → logits over the
    ``values`` values at every position.

    Args:
        vocab: the number of token ids (keys, values and padding).
        embed_dim: width. max_len: the longest input.
        attention: a name from :data:`ATTENTIONS`.
        config: the run configuration (``score`` and ``align`` of ``"full"``), or None for
            scaled dot product and softmax.
        values: the number of values, the read-out's classes.
        layers: the mixing of each layer (names as :func:`build_layer_mixing` takes them);
            None: ``LAYERS`` layers of ``attention``.
    """

    def __init__(
        self,
        vocab: int,
        *,
        embed_dim: int,
        max_len: int,
        attention: str = "full",
        config=None,
        values: int = VALUES,
        layers: list[str] | None = None,
    ) -> None:
        super().__init__()
        if config is None:
            config = _Defaults()
        names = [attention] * LAYERS if layers is None else list(layers)
        self.tokens = nn.Embedding(vocab, embed_dim)
        self.previous = nn.Embedding(vocab + 1, embed_dim)  # id ``vocab``: before the start
        self.position = nn.Embedding(max_len, embed_dim)
        nn.init.normal_(self.position.weight, std=0.02)
        self.attention = attention

        def layer(i: int, name: str) -> _Layer:  # the mixing, then the rest of its layer
            mixing, window = build_layer_mixing(name, embed_dim, max_len=max_len, depth=i + 1,
                                                layers=len(names), config=config)  # fmt: skip
            return _Layer(embed_dim, mixing, name=name, window=window)

        self.layers = nn.ModuleList(layer(i, name) for i, name in enumerate(names))
        self.norm = nn.LayerNorm(embed_dim)
        self.out = nn.Linear(embed_dim, values)

    def forward(self, tokens: Tensor, *, need_weights: bool = False) -> tuple[Tensor, Tensor]:
        """tokens (B, N) → logits (B, N, values) and, with ``need_weights``, the last layer's
        weights (B, H, N, N) (else None)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (B, N), got shape {tuple(tokens.shape)}")
        n = tokens.shape[1]
        if n > self.position.num_embeddings:
            raise ValueError(
                f"sequence of {n} tokens, longer than max_len = {self.position.num_embeddings}"
            )
        start = torch.full_like(tokens[:, :1], self.previous.num_embeddings - 1)
        before = torch.cat([start, tokens[:, :-1]], 1)
        x = self.tokens(tokens) + self.previous(before)
        x = x + self.position(torch.arange(n, device=tokens.device))
        weights = None
        for i, layer in enumerate(self.layers):
            mask = layer.mask(n, tokens.device)
            x, weights = layer(x, mask, need_weights and i == len(self.layers) - 1)
        return self.out(self.norm(x)), weights


class _Defaults:
    score, align = "scaled_dot", "softmax"


@REGISTRY.register("mqar")
class MQARTask(Task):
    description = (
        "multi-query associative recall (Zoology): seq_len // 4 key-value pairs, then every key "
        "again; recall its value (32 classes), causal decoder, attention chosen by --attention"
    )
    defaults: ClassVar[dict[str, dict[str, Any]]] = {
        "full": {"epochs": 20, "n_train": 20000, "n_test": 1000, "batch_size": 64, "lr": 1e-3,
                 "d_model": 64, "seq_len": 256, "score": "scaled_dot"},
        "quick": {"epochs": 4, "n_train": 4000, "n_test": 400, "batch_size": 32, "lr": 3e-3,
                  "d_model": 32, "seq_len": 64, "score": "scaled_dot"},
    }  # fmt: skip
    metrics: ClassVar[dict[str, Metric]] = {
        "accuracy": Metric(
            "share of test queries answered with the value stored with the key (chance "
            f"1/values, 1/{VALUES} by default)"
        ),
        "gold_argmax": Metric(
            "share of test queries for which some head of the last layer puts its largest "
            "weight on the queried pair's value position (a model may retrieve in the first "
            "layer instead)",
            None,
        ),
    }
    attentions: ClassVar[tuple[str, ...]] = ATTENTIONS
    settings = MQARSettings

    @classmethod
    def attention_name(cls, config) -> str:
        return "full" if config.attention == "default" else config.attention

    @classmethod
    def unused(cls, config) -> dict[str, Unused]:
        name = cls.attention_name(config)
        plan = cls.settings_of(config).layers
        if plan is not None:
            if any(n == "full" or n.startswith("sliding") for n in layer_names(config)):
                return {}
            why = "no layer of the plan is exact attention (no score or alignment is built)"
            return {key: Unused(f"--set layers={plan!r}", why) for key in ("score", "align")}
        if name == "full":
            return {}
        why = (
            f"mechanism {name!r} computes its own attention (no score function or alignment "
            "is built for it)"
        )
        return {key: Unused(f"--attention {name}", why) for key in ("score", "align")}

    @classmethod
    def validate(cls, config) -> None:
        if config.seq_len < 8:
            raise ValueError(
                f"seq_len must be >= 8 for mqar (seq_len // 4 pairs, at least 2), got "
                f"{config.seq_len}"
            )
        if config.d_model % HEADS:
            raise ValueError(
                f"d_model must be divisible by the {HEADS} heads, got {config.d_model}"
            )
        s = cls.settings_of(config)
        if s.num_pairs is not None and 4 * s.num_pairs > config.seq_len:
            raise ValueError(
                f"setting num_pairs {s.num_pairs} does not fit seq_len {config.seq_len}: a pair "
                f"takes 4 tokens, so at most seq_len // 4 = {pair_count(config.seq_len)} pairs"
            )
        pairs = pair_count(config.seq_len) if s.num_pairs is None else s.num_pairs
        if s.keys is not None and s.keys < pairs:
            raise ValueError(
                f"setting keys {s.keys} is fewer than the {pairs} pairs of a sequence (its keys "
                "are distinct); set keys >= num_pairs"
            )
        names = layer_names(config)
        if s.layers is not None and config.attention != "default":
            raise ValueError(
                f"--attention {config.attention} and setting layers {s.layers!r} both choose the "
                "layers' attention; name it in the plan"
            )
        if config.supervise_attention > 0 and names[-1] != "full":
            raise ValueError(
                f"supervise_attention needs weights that are a distribution over the keys; "
                f"attention {names[-1]!r} does not give them (the last layer's; use --attention "
                "full, or a plan whose last layer is full)"
            )
        with torch.random.fork_rng(devices=[]):  # names and sizes refused now
            for i, each in enumerate(dict.fromkeys(names)):
                build_layer_mixing(each, config.d_model, max_len=config.seq_len, depth=i + 1,
                                   layers=len(names), config=config)  # fmt: skip

    def __init__(self, config) -> None:
        super().__init__(config)
        n, s = config.seq_len, self.settings
        self.pairs = pair_count(n) if s.num_pairs is None else s.num_pairs
        self.keys = key_count(self.pairs) if s.keys is None else s.keys
        self.values = s.values
        self.vocab = self.keys + self.values + 1
        sizes = {"pairs": self.pairs, "keys": self.keys, "values": self.values}
        self.train = make_mqar(config.n_train, n, seed=config.seed, **sizes)
        self.splits = {
            name: make_mqar(max(config.n_test // k, 1), n, seed=config.seed + 10 + k, **sizes)
            for k, name in ((2, "validation"), (1, "test"))
        }

    def build_model(self) -> MQARDecoder:
        c = self.config
        return MQARDecoder(self.vocab, embed_dim=c.d_model, max_len=c.seq_len,
                           attention=self.attention_name(c), config=c,
                           values=self.values, layers=layer_names(c))  # fmt: skip

    def n_train(self) -> int:
        return self.train[0].shape[0]

    def has_split(self, name: str) -> bool:
        return name in self.splits

    def query_positions(self) -> Tensor:
        """(P,) the positions of the queries, 2P, 2P + 2, …, 4P − 2."""
        return torch.arange(2 * self.pairs, 4 * self.pairs, 2)

    def gold_matrix(self, gold: Tensor) -> Tensor:
        """(n, P, N) bool: the gold key position of each query row."""
        out = torch.zeros(*gold.shape, self.config.seq_len, dtype=torch.bool)
        return out.scatter_(-1, gold.unsqueeze(-1), True)

    def _split(self, split: str) -> tuple[Tensor, Tensor, Tensor]:
        return self.train if split == "train" else self.splits[split]

    def objective(self, model, index: Tensor) -> Tensor:
        tokens, answers, _ = (t[index] for t in self.train)
        logits, _ = model(tokens)
        rows = self.query_positions()
        return F.cross_entropy(logits[:, rows].flatten(0, 1), answers.flatten())

    def gold(self, split: str, index: Tensor) -> Tensor:
        """(B, 1, P, N) bool: at each query, the position of its pair's value (every head)."""
        return self.gold_matrix(self._split(split)[2][index]).unsqueeze(1)

    def supervised_weights(self, model, split: str, index: Tensor) -> Tensor:
        """(B, H, P, N): the last layer's weights at the query rows, every head."""
        _, weights = model(self._split(split)[0][index], need_weights=True)
        return weights[:, :, self.query_positions()]

    @torch.no_grad()
    def evaluate(self, model, split: str, batch: int = 200) -> dict[str, float]:
        model.eval()
        tokens, answers, gold = self.splits[split]
        rows = self.query_positions()
        correct, hit = [], []
        for i in range(0, len(tokens), batch):
            logits, weights = model(tokens[i : i + batch], need_weights=True)
            correct.append(logits[:, rows].argmax(-1) == answers[i : i + batch])
            if weights is None:
                hit.append(torch.zeros_like(correct[-1]))
            else:  # (b, H, P): the head's largest weight on the gold position
                top = weights[:, :, rows].float().argmax(-1)
                hit.append((top == gold[i : i + batch].unsqueeze(1)).any(1))
        return {
            "accuracy": float(torch.cat(correct).float().mean()),
            "gold_argmax": float(torch.cat(hit).float().mean()),
        }

    @torch.no_grad()
    def heatmaps(self, model, n: int = 4) -> list[dict]:
        model.eval()
        tokens, answers, gold = (t[:n] for t in self.splits["test"])
        logits, weights = model(tokens, need_weights=True)
        rows = self.query_positions()
        predicted = logits[:, rows].argmax(-1)
        show_rows = min(self.pairs, 16)
        cols = min(2 * self.pairs, 64)  # the stored pairs (the first 64 positions at most)
        k = self.keys
        maps = []
        for i in range(tokens.shape[0]):
            if weights is None:
                w = torch.zeros(show_rows, cols)
            else:
                w = weights[i, :, rows[:show_rows], :cols].float().mean(0)
            g = self.gold_matrix(gold[i : i + 1])[0, :show_rows, :cols]
            labels = [self._label(int(t), k, self.values) for t in tokens[i]]
            right = int((predicted[i] == answers[i]).sum())
            maps.append(
                {
                    "title": f"example {i}: {right}/{self.pairs} queries recalled"
                    + ("" if weights is not None else " (this attention reports no weights)"),
                    "weights": w.numpy(),
                    "gold": g.numpy(),
                    "x_labels": labels[:cols],
                    "y_labels": [labels[int(r)] for r in rows[:show_rows]],
                    "x_title": "stored pairs (key k…, value v…)",
                    "y_title": "query, last layer, mean over heads",
                }
            )
        return maps

    @staticmethod
    def _label(token: int, keys: int, values: int = VALUES) -> str:
        if token < keys:
            return f"k{token}"
        return f"v{token - keys}" if token < keys + values else "pad"
