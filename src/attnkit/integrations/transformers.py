"""Any attnkit attention inside Hugging Face ``transformers`` models, with their own weights.

``transformers`` routes the attention of its models (BERT, GPT-2, ViT, T5, BART, Llama, …)
through a registry of attention functions chosen by ``config._attn_implementation``. This module
registers one function per :func:`swap_attention` call that evaluates the model's per-head
queries, keys and values with :func:`attnkit.attention`, and switches the model to it. The
model's projections, head layout, masks (padding, causal, sliding windows, T5's relative
position bias), attention sinks (GPT-OSS), key/value cache and generation are untouched, so with
the defaults (``score=None``: the model's own scaled dot product; ``align="softmax"``) the
swapped model is the same model.

Masks are built for the swapped model exactly as for the model's eager implementation
(``transformers.masking_utils.eager_mask``: additive, causality always written into the mask,
no mask only for full attention without padding), so an attention call without a mask attends
to every key, as eager does, whatever the module's ``is_causal`` says, and the model's other
modules that read the mask (NLLB-MoE's router) see what they see in eager mode.
:mod:`attnkit.integrations.transformers_sweep` checks every architecture ``transformers``
ships against its eager path; those it finds not reproduced are listed in :data:`NOT_EXACT`
and refused by name.

The swap does its checks at the door and trusts its calls, as a layer's plan does (DESIGN 8):
it resolves its parts once (the model's own score, :mod:`attnkit.integrations.transformers_score`),
each mask's attnkit form is built once per forward pass and shared by the layers
(:mod:`attnkit.integrations.transformers_masks`), and each call goes through the direct entry of
the kernel selection tries first (:meth:`attnkit.kernels.Kernel.direct`: SDPA, grouped-query
heads natively, the model's additive mask as it is), as :class:`attnkit.MultiHeadAttention`'s
calls do; a call that entry does not take is made with :func:`attnkit.attention`.

    from attnkit.integrations.transformers import swap_attention
    swap_attention(model, align="sparsemax")          # every attention layer now sparsemax
    swap_attention(model, score=ak.scores.Cosine(), align=ak.alignments.Softmax(0.1))
    model.set_attn_implementation("eager")           # back to the original

Weights requested with ``output_attentions=True`` are attnkit's, and ``attnkit.evaluation.capture``
records them under the model's attention module names.

Saving and loading: parts given as a *spec* (a registered name, or a dict ``{"name": ...,
**constructor arguments}``) are described in ``model.config.attnkit_swap``; one with parameters is
built once per attention layer and registered on that layer's attention module, so
``model.save_pretrained(path)`` writes its weights, and :func:`from_pretrained` rebuilds the
swap and loads them:

    import attnkit.integrations.transformers as hf
    hf.swap_attention(model,
                      score={"name": "additive", "d_q": 8, "d_k": 8, "d_w": 8, "num_heads": 4},
                      align={"name": "entmax", "learnable": True})
    model.save_pretrained(path)
    model = hf.from_pretrained(BertModel, path)        # swapped, with the trained parts

Parts given as modules cannot be described, and saving such a model raises ``ValueError``.
"""

from __future__ import annotations

import inspect
import itertools
import json
import re
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import hook_points, hooks, kernels
from attnkit.alignments import REGISTRY as ALIGNMENTS
from attnkit.alignments import Alignment
from attnkit.core import attention
from attnkit.integrations.transformers_masks import eager_mask, split_mask
from attnkit.integrations.transformers_score import model_score
from attnkit.kernels.prepare import check_for_score
from attnkit.scores import REGISTRY as SCORES
from attnkit.scores import Score

__all__ = ["from_pretrained", "swap_attention"]

#: The config attribute that describes a swap: ``{"score": spec or None, "align": spec,
#: "kernel": name or None}``, each spec ``{"name": registered name, **constructor arguments}``.
CONFIG_KEY = "attnkit_swap"
#: Attribute names of the per-layer parts on each attention module.
_PART_NAMES = {"score": "attnkit_score", "align": "attnkit_align"}
_PART_KEY = re.compile(r"(^|\.)attnkit_(score|align)\.")
#: The module path of the marker a swapped model carries (:func:`_add_marker`): its state-dict
#: key names the loader to use.
MARKER = ("attnkit_swap_load_with", "attnkit", "integrations", "transformers", "from_pretrained")
_MARKER_KEY = re.compile(r"(^|\.)attnkit_swap_load_with\.")

_COUNTER = itertools.count()

#: Model classes whose attention goes through transformers' interface but which a swap does not
#: reproduce (found by :mod:`attnkit.integrations.transformers_sweep`), with the reason;
#: :func:`swap_attention` refuses them by name.
NOT_EXACT: dict[str, str] = {}


def _with_sink(
    heads: int, key: Tensor, value: Tensor, mask: Tensor | None, bias: Tensor | None, sinks: Tensor
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Any]:
    """Attention sinks (GPT-OSS): one extra key per head whose logit is the head's learned sink
    and whose value is 0, so that softmax over [e_1 … e_N, s_h] sends part of every row's mass
    nowhere (transformers' eager GPT-OSS attention: softmax of the concatenated logits, sink
    column dropped). Any alignment gets the same definition: the sink is an extra column of its
    scores with a zero value.

    Returns key, value, mask and bias with the sink key appended, and the score_mod that sets
    the sink column's score to ``sinks[h]`` whatever the score function gives there."""
    n = key.shape[-2]
    # A key of ones keeps every score function finite there (a zero key makes cosine 0/0).
    key = torch.cat([key, key.new_ones(*key.shape[:-2], 1, key.shape[-1])], dim=-2)
    value = torch.cat([value, value.new_zeros(*value.shape[:-2], 1, value.shape[-1])], dim=-2)
    if mask is not None:
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)
    if bias is not None:
        bias = torch.cat([bias, bias.new_zeros(*bias.shape[:-1], 1)], dim=-1)
    per_head = sinks.reshape(-1)
    if per_head.numel() != heads:
        raise ValueError(
            f"s_aux must hold one sink logit per head ({heads}), got shape {tuple(sinks.shape)}"
        )

    def sink_mod(e, b_idx, h_idx, q_idx, kv_idx):
        return torch.where(kv_idx == n, per_head.to(e.dtype)[h_idx], e)

    return key, value, mask, bias, sink_mod


def _chain(mods: list) -> Any:
    """One score_mod applying ``mods`` in order (None when there are none)."""
    if not mods:
        return None
    if len(mods) == 1:
        return mods[0]

    def chained(e, b, h, q_idx, kv_idx):
        for mod in mods:
            e = mod(e, b, h, q_idx, kv_idx)
        return e

    return chained


def _uses_interface(model: nn.Module) -> bool:
    """Whether the model's attention goes through transformers' attention-function registry."""
    if getattr(type(model), "_supports_attention_backend", False):
        return True
    source = sys.modules.get(type(model).__module__)
    try:
        return source is not None and "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(source)
    except (OSError, TypeError):
        return False


def _layer_part(module: nn.Module, kind: str) -> nn.Module:
    """The ``kind`` part ("score" or "align") that :func:`swap_attention` built for ``module``."""
    part = module._modules.get(_PART_NAMES[kind])
    if part is None:
        raise RuntimeError(
            f"{type(module).__name__} calls attnkit's attention but holds no {_PART_NAMES[kind]}: "
            "swap_attention did not recognise it as an attention module (its class does not "
            "name ALL_ATTENTION_FUNCTIONS); give the part as a module to share one across layers"
        )
    return part


def _attention_function(
    score: Score | None,
    align: Alignment | None,
    kernel: str | None,
    per_layer: frozenset[str] = frozenset(),
    holder: Mapping[str, nn.Module] | None = None,
):
    """The function registered with transformers; the parts named in ``per_layer`` ("score",
    "align") are read from the calling attention module, the others are the ones given, or,
    with ``holder`` (the modules of the model's ``attnkit_attention``), read from it at each
    call, so that a part replaced there (:func:`attnkit.evaluation.uniform_weights`) is the
    one used.

    A call is first offered to the direct entry (:meth:`attnkit.kernels.Kernel.direct`) of
    ``kernel``, or of the kernel automatic selection tries first, as a layer's plan offers its
    calls (:meth:`attnkit.Attention.direct`), when the parts are the ones swapped in and have no
    parameters (nothing whose dtype or device could differ from the model's tensors, which the
    swap's door cannot see), no weights are asked for or listened to, and there is no
    soft-capping or sink. The entry gets the model's grouped key/value heads as they are, the
    model's additive mask where it stands for the mask (see
    :func:`~attnkit.integrations.transformers_masks.split_mask`), and ``keep_masked``: masked
    keys and values are taken as the model's own attention takes them (a non-finite one is not
    cleared first). A call the entry does not take (None) goes through
    :func:`attnkit.attention`, which validates it, selects a kernel and gives the reasons."""
    shared = [part for part in (score, align) if part is not None]
    direct = not per_layer and not any(True for part in shared for _ in part.parameters())

    def attnkit_attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        # query (B, H, M, d); key, value (B, H_kv, N, d): grouped-query heads share keys.
        query, key, value = hook_points.qkv(module, query, key, value)  # (attnkit.hooks)
        mask, bias, additive = split_mask(attention_mask, query.dtype)
        # The masks are built as for transformers' eager attention (see swap_attention), which
        # never leaves causality to the kernel: no mask means every key, as in eager.
        position_bias = kwargs.get("position_bias")
        if position_bias is not None:  # T5's relative position bias (B or 1, H, M, N)
            position_bias = position_bias.to(query.dtype)
            bias = position_bias if bias is None else bias + position_bias
            additive = None
        softcap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux")

        shared_score, shared_align = score, align
        if holder is not None:
            shared_score = holder.get("score", score)
            shared_align = holder.get("align", align)
        layer_score = _layer_part(module, "score") if "score" in per_layer else shared_score
        layer_align = _layer_part(module, "align") if "align" in per_layer else shared_align
        as_swapped = shared_score is score and shared_align is align
        if layer_score is None:  # the model's own score: scaling · qᵀk
            layer_score = model_score(scaling, query.shape[-1])
        want = bool(kwargs.get("output_attentions", False)) or hooks.listening()
        p = dropout if module.training else 0.0
        out = None
        chosen = kernels.REGISTRY.chosen(kernel)
        if direct and as_swapped and not want and softcap is None and sinks is None and chosen:
            check_for_score(query, key, value, layer_score)  # (what the door cannot know)
            out = chosen.direct(
                query,
                key,
                value,
                layer_score,
                layer_align,
                mask=mask,
                bias=bias,
                dropout=p,
                additive=additive,
                keep_masked=True,
            )
        if out is None:
            heads, kv_heads = query.shape[1], key.shape[1]
            if kv_heads != heads:
                key = key.repeat_interleave(heads // kv_heads, dim=1)
                value = value.repeat_interleave(heads // kv_heads, dim=1)
            mods = []
            if softcap is not None:  # Gemma-2's logit soft-capping: cap · tanh(e / cap)
                mods.append(lambda e, b, h, q_idx, kv_idx: softcap * torch.tanh(e / softcap))
            if sinks is not None:
                key, value, mask, bias, sink_mod = _with_sink(heads, key, value, mask, bias, sinks)
                mods.append(sink_mod)
            out = attention(
                query,
                key,
                value,
                score=layer_score,
                align=layer_align,
                mask=mask,
                bias=bias,
                need_weights=want,
                dropout=p,
                kernel=kernel,
                score_mod=_chain(mods),
            )
        out = hook_points.attention(module, out, query, value, mask, layer_align)
        weights = out.weights
        if weights is not None:  # (only weights are reported)
            if sinks is not None:
                weights = weights[..., :-1]  # the sink's column is no key of the model
            hooks.report(module, weights)
        context = hook_points.emit(module, "context", out.context)  # (B, H, M, d_v)
        return context.transpose(1, 2).contiguous(), weights

    return attnkit_attention


def _kind_info(kind: str) -> tuple[str, Any, type]:
    """(argument word, registry, base class) of a part kind."""
    return ("score", SCORES, Score) if kind == "score" else ("alignment", ALIGNMENTS, Alignment)


def _plan(part: Any, kind: str) -> tuple[dict | None, nn.Module | None, str | None]:
    """What ``score=``/``align=`` asks for: (spec, module, why it cannot be saved).

    A registered name or a dict ``{"name": ..., **arguments}`` is a spec (normalised to what
    JSON gives back, so that the part built now is the part built when loading); a module is
    used as it is and cannot be described."""
    what, registry, base = _kind_info(kind)
    if isinstance(part, base):
        return (
            None,
            part,
            f"{kind}= was given as a module ({type(part).__name__}), which the config cannot "
            f"describe; give it as a spec instead, {kind}={{'name': <registered {what}>, "
            "**constructor arguments}",
        )
    if isinstance(part, str):
        spec = {"name": part}
    elif isinstance(part, Mapping):
        spec = dict(part)
        if not isinstance(spec.get("name"), str):
            raise TypeError(f"{kind} spec must hold 'name', a registered {what} name, got {part!r}")
        for key in ("device", "dtype"):
            if key in spec:
                raise ValueError(
                    f"{kind} spec {part!r} gives {key!r}; leave it out: each part is built on "
                    "the device and dtype of the attention module that holds it"
                )
    else:
        raise TypeError(
            f"{kind} must be a registered {what} name, a spec dict {{'name': ..., **arguments}} "
            f"or an attnkit {base.__name__} module, got {type(part).__name__}"
        )
    registry.get(spec["name"])  # an unknown name raises here, listing the known ones
    try:
        return json.loads(json.dumps(spec)), None, None
    except (TypeError, ValueError) as err:
        return (
            spec,
            None,
            f"{kind} spec {part!r} holds an argument that JSON cannot hold ({err}); give "
            "arguments as names, numbers, strings, lists or dicts",
        )


def _placement(module: nn.Module) -> dict[str, Any]:
    """device and dtype of ``module``'s first floating-point parameter (empty when none)."""
    for p in module.parameters():
        if p.is_floating_point():
            return {"device": p.device, "dtype": p.dtype}
    return {}


def _build(spec: dict, kind: str, like: nn.Module) -> nn.Module:
    """The part ``spec`` describes, on ``like``'s device and dtype, in ``like``'s train mode."""
    _, registry, _ = _kind_info(kind)
    name = spec["name"]
    arguments = {k: v for k, v in spec.items() if k not in ("name", "for_heads")}
    sizes = spec.get("for_heads")
    if sizes is not None and not isinstance(sizes, Mapping):
        raise TypeError(
            f"{kind} spec {spec!r}: 'for_heads' must be a dict of sizes (head_dim, num_heads, "
            f"embed_dim, max_len), got {type(sizes).__name__}"
        )
    placement = _placement(like)
    accepted = registry.accepts(name)
    factory = {k: v for k, v in placement.items() if k in accepted}
    try:
        if sizes is not None:  # built at the model's sizes, as attnkit run builds parts
            part = registry.get(name).for_heads(**sizes, **arguments, **factory)
        else:
            part = registry.build(name, **arguments, **factory)
    except TypeError as err:
        raise TypeError(f"{kind}={spec!r} cannot be built: {err}") from None
    if placement:
        part = part.to(**placement)
    return part.train(like.training)


_ATTENTION_CLASSES: dict[type, bool] = {}


def _is_attention_module(module: nn.Module) -> bool:
    """Whether ``module``'s class (or a class it derives from) calls transformers' attention
    functions: the modules whose calls the swap serves."""
    cls = type(module)
    if cls not in _ATTENTION_CLASSES:
        found = False
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch.") or klass is object:
                continue
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            if re.search(r"\bALL_ATTENTION_FUNCTIONS\b", source):
                found = True
                break
        _ATTENTION_CLASSES[cls] = found
    return _ATTENTION_CLASSES[cls]


LOADING_NOTE = """# A model whose attention was swapped by attnkit

This checkpoint was saved after `attnkit.integrations.transformers.swap_attention`
(`config.json` describes the swap under `attnkit_swap`). transformers' own `from_pretrained`
builds the model with its original attention and leaves the attnkit parts' weights out (its load
report lists them, and `attnkit_swap_load_with.attnkit.integrations.transformers.from_pretrained`,
as unexpected), so its outputs differ. Load it with attnkit:

```
from attnkit.integrations.transformers import from_pretrained
model = from_pretrained({cls}, "path/to/this/folder")
```
"""


def _save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
    """transformers' ``save_pretrained``, refused when the swap cannot be saved as it is; the
    folder gets a README.md (unless it has one) saying how to load it."""
    _check_saveable(self)
    out = type(self).save_pretrained(self, *args, **kwargs)
    folder = args[0] if args else kwargs.get("save_directory")
    if folder is not None and Path(folder).is_dir() and not (Path(folder) / "README.md").exists():
        note = LOADING_NOTE.replace("{cls}", type(self).__name__)
        (Path(folder) / "README.md").write_text(note, encoding="utf-8")
    return out


_save_pretrained.__name__ = "save_pretrained"  # a pickled model finds the method by this name


def _check_saveable(model: nn.Module) -> None:
    state = getattr(model, "_attnkit_swap", None)
    if state is None:
        return
    if state["problem"] is not None:
        raise ValueError(
            f"cannot save {type(model).__name__} with its attnkit attention: {state['problem']}. "
            "Its weights and the swap would be lost when loading"
        )
    current = model.config._attn_implementation
    if current != state["name"]:
        raise ValueError(
            f"cannot save {type(model).__name__}: its attention was switched to {current!r} "
            f"after swap_attention, but its attnkit parts are still attached and "
            f"config.{CONFIG_KEY} describes them; swap it again before saving"
        )


def _clear(model: nn.Module) -> None:
    """Detach the parts of an earlier swap."""
    for module in list(model.modules()):
        for attr in _PART_NAMES.values():
            module._modules.pop(attr, None)
    model._modules.pop("attnkit_attention", None)
    model._modules.pop(MARKER[0], None)


def _add_marker(model: nn.Module) -> None:
    """The buffer named by :data:`MARKER` (one byte), nested so that its state-dict key reads
    ``attnkit_swap_load_with.attnkit.integrations.transformers.from_pretrained``: saved with
    the model, it is the key transformers' own ``from_pretrained`` lists as unexpected in the
    load report it logs as a warning, so a swapped checkpoint loaded without attnkit names the
    loader that restores it, even when the swap has no weights of its own."""
    outer = inner = nn.Module()
    for part in MARKER[1:-1]:
        child = nn.Module()
        inner.add_module(part, child)
        inner = child
    inner.register_buffer(MARKER[-1], torch.ones((), dtype=torch.uint8))
    model.add_module(MARKER[0], outer)


def swap_attention(
    model: nn.Module,
    *,
    score: str | Mapping[str, Any] | Score | None = None,
    align: str | Mapping[str, Any] | Alignment = "softmax",
    kernel: str | None = None,
) -> str:
    """Evaluate every attention layer of a ``transformers`` model with attnkit.

    Args:
        model: a ``transformers.PreTrainedModel`` whose attention goes through the library's
            attention interface (``_supports_attention_backend``).
        score: None for the model's own scaled dot product (its ``scaling``, e.g. 1 for T5), or
            an attnkit score: a registered name, a spec ``{"name": ..., **constructor
            arguments}`` (e.g. ``{"name": "additive", "d_q": 8, "d_k": 8, "d_w": 8,
            "num_heads": 4}``, sizes per head), or a module.
        align: an attnkit alignment, given likewise (``{"name": "entmax", "learnable": True}``).
        kernel: force an attnkit kernel (None chooses).

    A part given by name or spec is described in ``model.config.attnkit_swap``. When it has
    parameters or buffers, one is built per attention module, on that module's device and dtype,
    and registered on it as ``attnkit_score`` / ``attnkit_align`` (each layer learns its own;
    ``save_pretrained`` writes them and :func:`from_pretrained` loads them); otherwise one is
    shared as ``model.attnkit_attention``. A part given as a module is shared by every layer as
    ``model.attnkit_attention`` (build a score with ``num_heads=H`` for one parameter set per head);
    it trains with the model, but the config cannot describe it, so ``model.save_pretrained``
    raises ``ValueError``. Either way the parts' parameters are in ``model.parameters()``. A
    second call replaces the parts of the first.

    Returns:
        The name under which the attention function is registered (``model.config.
        _attn_implementation`` now); ``model.set_attn_implementation("eager")`` switches back.

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``; a part is neither a name, a spec nor
            a module, or its spec's arguments do not fit its constructor.
        ValueError: a model in ``model`` computes its attention outside the interface, or is
            listed in :data:`NOT_EXACT`; a part's name is not registered; a spec gives
            ``device`` or ``dtype``.

    Attention sinks (``s_aux``, GPT-OSS) are one more key per head whose score is the head's
    sink logit and whose value is 0: softmax over [scores, sink] with the sink's column dropped,
    as transformers' eager GPT-OSS attention; any other alignment is applied to the same
    extended row (e.g. sparsemax over [scores, sink]). Weights returned or captured leave the
    sink's column out, so rows sum to less than 1.
    """
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - exercised only without the package
        raise ImportError(
            "swap_attention needs the transformers package: pip install 'attnkit[hf]'"
        ) from err
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    # A composite (EncoderDecoderModel) is swappable when the models it is made of are.
    parts = [m for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]
    leaves = [m for m in parts if not any(o is not m and o in set(m.modules()) for o in parts)]
    refused = [m for m in leaves if not _uses_interface(m)]
    if refused:
        names = ", ".join(sorted({type(m).__name__ for m in refused}))
        raise ValueError(
            f"{names} computes its attention in its own code (masks or position biases outside "
            "transformers' attention interface), so its attention cannot be swapped exactly"
        )
    known = sorted({type(m).__name__ for m in parts if type(m).__name__ in NOT_EXACT})
    if known:
        reasons = "; ".join(f"{n}: {NOT_EXACT[n]}" for n in known)
        raise ValueError(f"swap_attention does not reproduce {', '.join(known)} ({reasons})")
    plans = {"align": _plan(align, "align")}
    if score is not None:
        plans["score"] = _plan(score, "score")
    # Parts become submodules, so that their parameters train with the model, follow .to() and
    # are in its state_dict. Everything is built before the parts of an earlier swap go.
    shared: dict[str, nn.Module] = {}
    layered: list[tuple[nn.Module, str, nn.Module]] = []
    attention_modules = [
        m
        for m in model.modules()
        if not isinstance(m, transformers.PreTrainedModel) and _is_attention_module(m)
    ]
    for kind, (spec, module, _) in plans.items():
        if module is not None:
            shared[kind] = module
            continue
        template = _build(spec, kind, model)
        if not template.state_dict():
            shared[kind] = template  # nothing to learn or save: one serves every layer
            continue
        if not attention_modules:
            raise ValueError(
                f"{kind}={spec!r} has parameters, to be built once per attention module, but "
                f"no module of {type(model).__name__} names ALL_ATTENTION_FUNCTIONS; give the "
                "part as a module to share one across layers"
            )
        layered += [(m, _PART_NAMES[kind], _build(spec, kind, m)) for m in attention_modules]
    _clear(model)
    hook_points.output_from_forward(attention_modules)  # their output point (attnkit.hooks)
    for m, attr, part in layered:
        m.add_module(attr, part)
    holder = None
    if shared:
        holder = nn.ModuleDict(shared)
        model.add_module("attnkit_attention", holder)
    _add_marker(model)
    per_layer = frozenset(kind for kind in plans if kind not in shared)
    name = f"attnkit-{next(_COUNTER)}"
    transformers.AttentionInterface.register(
        name,
        _attention_function(
            shared.get("score"),
            shared.get("align"),
            kernel,
            per_layer,
            None if holder is None else holder._modules,  # the parts as they are at each call
        ),
    )
    # The masks eager attention gets (additive, causality always spelled out, None only for
    # full attention): what the model's other modules (routers, poolers) read stays as in eager.
    # Their boolean form is remembered for the attention calls (transformers_masks).
    transformers.AttentionMaskInterface.register(name, eager_mask)
    model.set_attn_implementation(name)

    problems = [why for _, _, why in plans.values() if why is not None]
    if problems:
        if hasattr(model.config, CONFIG_KEY):
            delattr(model.config, CONFIG_KEY)
    else:
        described = {"score": plans["score"][0] if "score" in plans else None}
        described |= {"align": plans["align"][0], "kernel": kernel}
        setattr(model.config, CONFIG_KEY, described)
    model._attnkit_swap = {"name": name, "problem": "; ".join(problems) or None}
    if "save_pretrained" not in model.__dict__:
        model.save_pretrained = types.MethodType(_save_pretrained, model)
    return name


def _with_variant(filename: str, variant: str | None) -> str:
    if variant is None:
        return filename
    stem, ext = filename.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def _stored_parts(path: Any, kwargs: dict[str, Any]) -> dict[str, Tensor]:
    """The attnkit part tensors of a saved checkpoint (single file or sharded, safetensors or
    PyTorch), found as ``from_pretrained`` finds its files."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
        cached_file,
    )

    keys = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only")
    download = {k: kwargs[k] for k in (*keys, "subfolder") if k in kwargs}

    def find(filename: str) -> str | None:
        return cached_file(path, filename, _raise_exceptions_for_missing_entries=False, **download)

    variant = kwargs.get("variant")
    files: list[str] = []
    layouts = ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME), (WEIGHTS_NAME, WEIGHTS_INDEX_NAME))
    for single, index in layouts:
        file = find(_with_variant(single, variant))
        if file is not None:
            files = [file]
            break
        index_file = find(_with_variant(index, variant))
        if index_file is not None:
            with open(index_file, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            shards = sorted({shard for key, shard in weight_map.items() if _PART_KEY.search(key)})
            files = [f for f in map(find, shards) if f is not None]
            break
    stored: dict[str, Tensor] = {}
    for file in files:
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as f:
                names = f.keys()  # a safetensors file handle is not iterable
                stored |= {k: f.get_tensor(k) for k in names if _PART_KEY.search(k)}
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
            stored |= {k: v for k, v in state.items() if _PART_KEY.search(k)}
    return stored


def from_pretrained(cls: Any, pretrained_model_name_or_path: Any, *model_args: Any, **kwargs: Any):
    """Load a model saved after :func:`swap_attention`, swapped again, with its parts' weights.

    transformers' own ``cls.from_pretrained`` knows nothing of the swap: it builds the model
    without the attnkit parts and drops their weights, reporting them as unexpected. This calls
    it, re-applies the swap described in ``config.attnkit_swap`` (so each part is rebuilt on its
    attention module's device and dtype) and loads the parts' saved weights.

    Args:
        cls: the model class (``BertModel``, ``AutoModelForCausalLM``, ...).
        pretrained_model_name_or_path: what ``cls.from_pretrained`` takes.
        *model_args, **kwargs: passed on to ``cls.from_pretrained`` (``dtype``, ``revision``,
            ``output_loading_info``, ...).

    Returns:
        The swapped model (in eval mode, as ``from_pretrained`` leaves it), or ``(model,
        loading_info)`` with ``output_loading_info=True``.

    Raises:
        ValueError: the checkpoint's config has no ``attnkit_swap`` (it was not saved from a
            swapped model), or its attnkit weights do not match the parts the swap rebuilds.
    """
    import transformers

    want_info = kwargs.pop("output_loading_info", False)
    # The parts' weights are loaded below: keep transformers from reporting them as unused.
    patch = isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
    attr = "_keys_to_ignore_on_load_unexpected"
    absent = object()
    own = cls.__dict__.get(attr, absent) if patch else absent
    if patch:
        ignored = [_PART_KEY.pattern, _MARKER_KEY.pattern]
        setattr(cls, attr, [*(getattr(cls, attr, None) or []), *ignored])
    try:
        model, info = cls.from_pretrained(
            pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
        )
    finally:
        if patch:
            if own is absent:
                delattr(cls, attr)
            else:
                setattr(cls, attr, own)
    described = getattr(model.config, CONFIG_KEY, None)
    if not isinstance(described, Mapping):
        raise ValueError(
            f"{pretrained_model_name_or_path!s} was not saved from a model swapped with "
            f"swap_attention (its config has no {CONFIG_KEY!r}); load it with "
            f"{getattr(cls, '__name__', cls)}.from_pretrained"
        )
    swap_attention(
        model,
        score=described.get("score"),
        align=described.get("align", "softmax"),
        kernel=described.get("kernel"),
    )
    wanted = [k for k in model.state_dict() if _PART_KEY.search(k)]
    stored = _stored_parts(pretrained_model_name_or_path, kwargs) if wanted else {}
    # A checkpoint of the base model loads into a model with a head and back (as transformers
    # does): the keys may differ by the base model's prefix.
    prefix = getattr(model, "base_model_prefix", "")
    loaded, used, missing = {}, set(), []
    for key in wanted:
        names = [key]
        if prefix:
            names += [f"{prefix}.{key}", key.removeprefix(f"{prefix}.")]
        hit = next((n for n in names if n in stored), None)
        if hit is None:
            missing.append(key)
        else:
            loaded[key] = stored[hit]
            used.add(hit)
    unused = sorted(set(stored) - used)
    if missing or unused:
        raise ValueError(
            f"the attnkit weights saved in {pretrained_model_name_or_path!s} do not match the "
            f"parts config.{CONFIG_KEY} describes: missing {missing[:4]}"
            f"{' …' if len(missing) > 4 else ''}, not used {unused[:4]}"
            f"{' …' if len(unused) > 4 else ''}"
        )
    model.load_state_dict(loaded, strict=False)
    return (model, info) if want_info else model
