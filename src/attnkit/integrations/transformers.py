"""Any attnkit attention inside Hugging Face ``transformers`` models, with their own weights.

``transformers`` routes the attention of its models (BERT, GPT-2, ViT, T5, BART, Llama, …)
through a registry of attention functions chosen by ``config._attn_implementation``. This module
registers one function per :func:`swap_attention` call that evaluates the model's per-head
queries, keys and values with :func:`attnkit.attention`, and switches the model to it. The
model's projections, head layout, masks (padding, causal, T5's relative position bias), key/value
cache and generation are untouched, so with the defaults (``score=None``: the model's own
scaled dot product; ``align="softmax"``) the swapped model is the same model.

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


def _split_mask(attention_mask: Tensor | None, dtype: torch.dtype) -> tuple[Tensor | None, ...]:
    """The model's mask as attnkit's boolean mask (True = may attend) and a float bias.

    Models hand over either a boolean mask or an additive float mask whose masked entries are
    near the dtype's minimum (T5 adds its relative position bias to it)."""
    if attention_mask is None:
        return None, None
    if attention_mask.dtype == torch.bool:
        return attention_mask, None
    allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    bias = torch.where(allowed, attention_mask, torch.zeros((), dtype=attention_mask.dtype))
    return allowed, bias.to(dtype)


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
        # As transformers' SDPA path: without a mask, a causal module (or call) is causal.
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        m, n = query.shape[-2], key.shape[-2]
        if mask is None and causal and m > 1:
            mask = torch.ones(m, n, dtype=torch.bool, device=query.device).tril()
        position_bias = kwargs.get("position_bias")
        if position_bias is not None:  # T5's relative position bias (B or 1, H, M, N)
            position_bias = position_bias.to(query.dtype)
            bias = position_bias if bias is None else bias + position_bias
        softcap = kwargs.get("softcap")
        score_mod = None
        if softcap is not None:  # Gemma-2's logit soft-capping: cap · tanh(e / cap)

            def score_mod(e, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(e / softcap)

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
        hooks.report(module, out.weights)
        return out.context.transpose(1, 2).contiguous(), out.weights

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
    """
    try:
        import transformers
        from transformers.masking_utils import sdpa_mask
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
    # Boolean masks, True = may attend: attnkit's convention, as SDPA's.
    transformers.AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return name
