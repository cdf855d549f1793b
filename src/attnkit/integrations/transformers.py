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

    from attnkit.integrations.transformers import swap_attention
    swap_attention(model, align="sparsemax")          # every attention layer now sparsemax
    swap_attention(model, score=ak.scores.Cosine(), align=ak.alignments.Softmax(0.1))
    model.set_attn_implementation("eager")           # back to the original

Weights requested with ``output_attentions=True`` are attnkit's, and ``attnkit.evaluation.capture``
records them under the model's attention module names.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import checks, hooks
from attnkit.alignments import Alignment
from attnkit.attention import attention
from attnkit.scores import Score

__all__ = ["swap_attention"]

_COUNTER = itertools.count()

#: Model classes whose attention goes through transformers' interface but which a swap does not
#: reproduce (found by :mod:`attnkit.integrations.transformers_sweep`), with the reason;
#: :func:`swap_attention` refuses them by name.
NOT_EXACT: dict[str, str] = {}


def _split_mask(attention_mask: Tensor | None, dtype: torch.dtype) -> tuple[Tensor | None, ...]:
    """The model's mask as attnkit's boolean mask (True = may attend) and a float bias.

    Models hand over either a boolean mask or an additive float mask whose masked entries are
    near the dtype's minimum and whose other entries are 0 (eager masks) or a bias some models
    add to it (ALiBi); an all-zero bias is dropped."""
    if attention_mask is None:
        return None, None
    if attention_mask.dtype == torch.bool:
        return attention_mask, None
    allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    bias = torch.where(allowed, attention_mask, torch.zeros((), dtype=attention_mask.dtype))
    return allowed, bias.to(dtype) if bias.any() else None


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


def _attention_function(score: Score | None, align: Alignment, kernel: str | None):
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
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads != heads:
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        mask, bias = _split_mask(attention_mask, query.dtype)
        # The masks are built as for transformers' eager attention (see swap_attention), which
        # never leaves causality to the kernel: no mask means every key, as in eager.
        position_bias = kwargs.get("position_bias")
        if position_bias is not None:  # T5's relative position bias (B or 1, H, M, N)
            position_bias = position_bias.to(query.dtype)
            bias = position_bias if bias is None else bias + position_bias
        mods = []
        softcap = kwargs.get("softcap")
        if softcap is not None:  # Gemma-2's logit soft-capping: cap · tanh(e / cap)
            mods.append(lambda e, b, h, q_idx, kv_idx: softcap * torch.tanh(e / softcap))
        sinks = kwargs.get("s_aux")
        if sinks is not None:
            key, value, mask, bias, sink_mod = _with_sink(heads, key, value, mask, bias, sinks)
            mods.append(sink_mod)
        score_mod = _chain(mods)

        if score is None:  # the model's own score: scaling · qᵀk
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            q, part = query * scale, "dot"
        else:
            q, part = query, score
        want = bool(kwargs.get("output_attentions", False)) or hooks.listening()
        out = attention(
            q,
            key,
            value,
            score=part,
            align=align,
            mask=mask,
            bias=bias,
            need_weights=want,
            dropout=dropout if module.training else 0.0,
            kernel=kernel,
            score_mod=score_mod,
        )
        weights = out.weights
        if sinks is not None and weights is not None:
            weights = weights[..., :-1]  # the sink's column is no key of the model
        hooks.report(module, weights)
        return out.context.transpose(1, 2).contiguous(), weights

    return attnkit_attention


def swap_attention(
    model: nn.Module,
    *,
    score: str | Score | None = None,
    align: str | Alignment = "softmax",
    kernel: str | None = None,
) -> str:
    """Evaluate every attention layer of a ``transformers`` model with attnkit.

    Args:
        model: a ``transformers.PreTrainedModel`` whose attention goes through the library's
            attention interface (``_supports_attention_backend``).
        score: None for the model's own scaled dot product (its ``scaling``, e.g. 1 for T5), or
            an attnkit score (a name or a module, shared by every layer; build it with
            ``heads=H`` for one parameter set per head).
        align: an attnkit alignment (a name or a module, shared likewise). Both parts are added
            to the model as ``model.attnkit_attention``, so their parameters train with it.
        kernel: force an attnkit kernel (None chooses).

    Returns:
        The name under which the attention function is registered (``model.config.
        _attn_implementation`` now); ``model.set_attn_implementation("eager")`` switches back.

    Raises:
        TypeError: ``model`` is not a ``PreTrainedModel``.
        ValueError: a model in ``model`` computes its attention outside the interface, or is
            listed in :data:`NOT_EXACT`.

    Attention sinks (``s_aux``, GPT-OSS) are one more key per head whose score is the head's
    sink logit and whose value is 0: softmax over [scores, sink] with the sink's column dropped,
    as transformers' eager GPT-OSS attention; any other alignment is applied to the same
    extended row (e.g. sparsemax over [scores, sink]). Weights returned or captured leave the
    sink's column out, so rows sum to less than 1.
    """
    try:
        import transformers
        from transformers.masking_utils import eager_mask
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
    score_part = None if score is None else checks.resolve_score(score)
    align_part = checks.resolve_alignment(align)
    # The parts become a submodule, so that their parameters train with the model and follow
    # .to() (a part with parameters adds them to the model's state_dict).
    model.add_module("attnkit_attention", nn.ModuleDict({"align": align_part}))
    if score_part is not None:
        model.attnkit_attention["score"] = score_part
    name = f"attnkit-{next(_COUNTER)}"
    transformers.AttentionInterface.register(
        name, _attention_function(score_part, align_part, kernel)
    )
    # The masks eager attention gets (additive, causality always spelled out, None only for
    # full attention): what the model's other modules (routers, poolers) read stays as in eager.
    transformers.AttentionMaskInterface.register(name, eager_mask)
    model.set_attn_implementation(name)
    return name
