"""Attention parts built from the names given to ``attnkit run``, with explicit arguments.

Every score gets exactly the sizes listed for it in :data:`SCORE_SIZES`; a registered score that
is not listed there, or an alignment that needs arguments not listed in :data:`ALIGNMENT_ARGUMENTS`,
is refused with a message saying so, instead of being built with guessed or default sizes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

import attnkit as ak
from attnkit import alignments as al
from attnkit.attention import Attention
from attnkit.scores import Score

__all__ = [
    "ALIGNMENT_ARGUMENTS",
    "SCORE_SIZES",
    "SLOT_ARGUMENTS",
    "build_alignment",
    "build_attention",
    "build_score",
    "build_slot_attention",
    "slot_mechanisms",
    "task_loss",
    "usable_scores",
]

# Which of the task's sizes each score takes: d_q (query), d_k (key), d_w (hidden size of the
# additive family), max_len (the most keys any input of the task has, for position scores).
SCORE_SIZES: dict[str, tuple[str, ...]] = {
    "dot": (),
    "scaled_dot": (),
    "cosine": (),
    "euclidean": (),
    "general": ("d_q", "d_k"),
    "biased_general": ("d_q", "d_k"),
    "activated_general": ("d_q", "d_k"),
    "hermitian": ("d_k", "d_w"),
    "directed_hermitian": ("d_k", "d_w"),
    "decomposable": ("d_q", "d_k", "d_w"),
    "decomposable_shared": ("d_k", "d_w"),
    "additive": ("d_q", "d_k", "d_w"),
    "concat": ("d_q", "d_k", "d_w"),
    "deep": ("d_q", "d_k", "d_w"),
    "convolutional": ("d_k",),
    "learned_query": ("d_k",),
    "location": ("d_q", "max_len"),
}

# Alignments that need arguments, as functions of the query size; the rest take none.
ALIGNMENT_ARGUMENTS: dict[str, Callable[[int], dict[str, Any]]] = {
    # Luong's predictive local alignment with a half-window of 2.
    "local": lambda d_q: {"window": 2, "position": "predictive", "d_q": d_q},
    # Predictors of the temperature (Lin et al.) and of the window (Yang et al.) read the query.
    "query_temperature": lambda d_q: {"d_q": d_q},
    "predicted_window": lambda d_q: {"d_q": d_q},
}


# Constructor parameters of a registered attention-slot mechanism that attnkit run and the
# benchmarks fill from the model's sizes, by parameter name; every other parameter keeps its
# default, and a required parameter not named here makes the mechanism unbuildable (refused).
SLOT_SIZES: dict[str, str] = {
    "d": "head_dim", "dim": "head_dim", "head_dim": "head_dim", "d_head": "head_dim",
    "d_k": "head_dim", "seq_len": "max_len", "max_len": "max_len", "max_length": "max_len",
    "n": "max_len", "length": "max_len", "num_heads": "num_heads", "n_heads": "num_heads",
    "heads": "num_heads", "max_span": "max_len",
}  # fmt: skip


def _synthesizer_arguments(head_dim: int, num_heads: int, max_len: int) -> dict[str, Any]:
    """Tay et al.'s dense synthesizer (eq. 2), one per head, over at most ``max_len`` keys."""
    from attnkit.efficient.synthesizer import DenseSynthetic

    return {"components": [DenseSynthetic(head_dim, max_len, heads=num_heads)]}


# Attention-slot mechanisms whose required arguments are parts (not sizes): a function of
# (head_dim, num_heads, max_len) giving those arguments.
SLOT_ARGUMENTS: dict[str, Callable[[int, int, int], dict[str, Any]]] = {
    "synthesizer": _synthesizer_arguments,
}


def _is_slot_part(cls: type) -> bool:
    from attnkit.slots import ATTENTION_KEYWORDS

    params = inspect.signature(cls.forward).parameters
    return all(name in params for name in ATTENTION_KEYWORDS)


def slot_mechanisms(package: str | None = None) -> list[str]:
    """Registered mechanisms that are per-head parts for the attention slot (``forward(q, k, v,
    *, mask, bias, need_weights)``), optionally only those defined in ``package`` (e.g.
    ``"attnkit.efficient"``). New registrations appear here without any list to update."""
    names = ak.mechanisms.available()  # imports the registering packages
    out = []
    for name in names:
        cls = ak.mechanisms.REGISTRY.get(name)
        if package is not None and not cls.__module__.startswith(package + "."):
            continue
        if _is_slot_part(cls):
            out.append(name)
    return out


def build_slot_attention(name: str, *, head_dim: int, num_heads: int, max_len: int) -> nn.Module:
    """The registered mechanism ``name`` as a per-head attention part, its required constructor
    arguments filled by name from the sizes (:data:`SLOT_SIZES`), or made from them by
    :data:`SLOT_ARGUMENTS` (e.g. the synthesizer's components).

    Raises ValueError for an unknown name, a mechanism that is not an attention-slot part, or one
    that needs an argument attnkit cannot give.
    """
    ak.mechanisms.available()
    cls = ak.mechanisms.REGISTRY.get(name)  # unknown names: ValueError listing the options
    if not _is_slot_part(cls):
        raise ValueError(
            f"mechanism {name!r} is not a per-head attention part (forward(q, k, v, *, mask, "
            f"bias, need_weights)); usable: full, {', '.join(slot_mechanisms())}"
        )
    sizes = {"head_dim": head_dim, "num_heads": num_heads, "max_len": max_len}
    made = SLOT_ARGUMENTS.get(name)
    kwargs = {} if made is None else made(head_dim, num_heads, max_len)
    for key, param in inspect.signature(cls).parameters.items():
        if param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL) or key in kwargs:
            continue
        if key in SLOT_SIZES:
            if param.default is inspect.Parameter.empty or SLOT_SIZES[key] == "max_len":
                kwargs[key] = sizes[SLOT_SIZES[key]]
        elif param.default is inspect.Parameter.empty:
            raise ValueError(
                f"mechanism {name!r} needs the argument {key!r}, which attnkit cannot fill from "
                f"the model's sizes ({', '.join(sorted(SLOT_SIZES))}); build it yourself and "
                "pass it as MultiHeadAttention(attention=...)"
            )
    return ak.mechanisms.build(name, **kwargs)


def usable_scores() -> list[str]:
    """Registered scores that ``attnkit run`` can build."""
    return [name for name in ak.scores.available() if name in SCORE_SIZES]


def build_score(name: str, *, d_q: int, d_k: int, d_w: int, max_len: int) -> Score:
    """The score ``name`` given exactly the sizes :data:`SCORE_SIZES` lists for it.

    Raises ValueError for an unknown name (with the closest one) or a registered score whose
    sizes are not listed.
    """
    ak.scores.REGISTRY.get(name)  # unknown names: ValueError listing the options
    if name not in SCORE_SIZES:
        raise ValueError(
            f"score {name!r} is registered but attnkit run does not know which sizes to give it; "
            f"add it to SCORE_SIZES in attnkit.tasks.parts (usable: {', '.join(usable_scores())})"
        )
    sizes = {"d_q": d_q, "d_k": d_k, "d_w": d_w, "max_len": max_len}
    return ak.scores.build(name, **{key: sizes[key] for key in SCORE_SIZES[name]})


def build_alignment(name: str, d_q: int) -> al.Alignment:
    """The alignment ``name``: with the arguments in :data:`ALIGNMENT_ARGUMENTS`, else none.

    Raises ValueError for an unknown name, or for an alignment that cannot be built without
    arguments ``attnkit run`` does not give.
    """
    arguments = ALIGNMENT_ARGUMENTS[name](d_q) if name in ALIGNMENT_ARGUMENTS else {}
    try:
        return ak.alignments.build(name, **arguments)
    except TypeError as err:
        raise ValueError(
            f"alignment {name!r} cannot be built by attnkit run ({err}); add its arguments to "
            "ALIGNMENT_ARGUMENTS in attnkit.tasks.parts"
        ) from None


def build_attention(score: str, align: str, d: int, max_len: int) -> Attention:
    """Attention with queries and keys of size d (and d_w = d) over at most ``max_len`` keys."""
    return Attention(
        build_score(score, d_q=d, d_k=d, d_w=d, max_len=max_len), build_alignment(align, d)
    )


def task_loss(per_item: Tensor, log_prob: Tensor | None) -> Tensor:
    """Mean task loss, plus REINFORCE for stochastic alignments (hard, reinforced): the
    reward is the negative per-item loss, with the batch mean as baseline."""
    loss = per_item.mean()
    if log_prob is not None:
        reward = -per_item.detach()
        loss = loss - ((reward - reward.mean()) * log_prob).mean()
    return loss
