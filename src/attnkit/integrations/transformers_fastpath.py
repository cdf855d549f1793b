"""The per-call path of :func:`attnkit.integrations.transformers.swap_attention`, kept lean.

A swapped model calls attnkit's attention once per attention layer per forward pass (per token
when generating), with tensors that transformers built: q (B, H, M, d), k and v (B, H, N, d) from
the model's own projections and the same mask tensor for every layer of a pass. So the swap
validates at the door (when it is made: the parts are resolved and built there) and trusts the
calls inside (DESIGN 8):

- :class:`ModelScaledDot`: the model's own score, s·qᵀk with the model's ``scaling`` s, one
  parameter-free instance per scale, built once (not resolved by name on every call).
- :func:`split_mask`: the model's mask in attnkit's form, converted once per mask tensor and
  reused by every layer of the pass (an in-place change to the mask is seen and converted again);
  a mask that allows every pair is dropped, as attention with it equals attention without it.
- :class:`SdpaPath`: a call that SDPA evaluates exactly (parameter-free dot-product score,
  softmax with a constant temperature, no weights) goes straight to attnkit's SDPA kernel
  (:mod:`attnkit.kernels.sdpa`), without :func:`attnkit.attention`'s per-call validation and
  kernel selection. Keys and values are taken as the model's attention takes them: a non-finite
  masked key or value is not zeroed first (the model's own eager and SDPA attention do not zero
  it either).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnkit import kernels
from attnkit.alignments import Alignment
from attnkit.inputs import broadcast_shapes
from attnkit.kernels import sdpa
from attnkit.kernels.base import Call
from attnkit.kernels.block_mask import from_dense_auto
from attnkit.output import AttentionOutput
from attnkit.scores import Score
from attnkit.scores.multiplicative import FixedScaleDot

__all__ = ["ModelScaledDot", "SdpaPath", "eager_mask", "model_score", "split_mask"]

_HALF = (torch.float16, torch.bfloat16)


class ModelScaledDot(FixedScaleDot):
    """The score of a transformers model's own attention: e_l = s · qᵀ k_l (Brauwers Table II,
    scaled multiplicative) with the model's ``scaling`` s (1/√d for most models, 1 for T5,
    1/(√d · (layer + 1)) for GPT-2 with ``scale_attn_by_inverse_layer_idx``).

    The product is formed as the model's eager attention forms it, (qᵀk) · s, and SDPA gets s as
    its ``scale`` as the model's SDPA attention does. Not registered: :func:`model_score` builds
    it for the swap.

    Args:
        scale: s, the model's ``scaling``.
    """


_SCORES: dict[float, ModelScaledDot] = {}


def model_score(scaling: float | None, head_dim: int) -> ModelScaledDot:
    """The :class:`ModelScaledDot` of scale ``scaling`` (``head_dim ** -0.5`` when None), one
    instance per scale (it has neither parameters nor buffers, so every layer and device can
    share it)."""
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    score = _SCORES.get(scale)
    if score is None:
        score = _SCORES[scale] = ModelScaledDot(scale)
    return score


class _Converted(NamedTuple):
    """A model mask in attnkit's form: ``mask`` boolean or None (every pair allowed), ``bias``
    float or None (all zero), and whether every query row has a key it may attend."""

    mask: Tensor | None
    bias: Tensor | None
    every_row: bool


# id(mask) -> (weak reference to the mask, its version, a copy of its values, its conversion)
_MASKS: dict[int, tuple[weakref.ref, int, Tensor, _Converted]] = {}
# At most this many masks are held (a mask kept alive by its caller is evicted oldest first).
_MASK_CACHE_SIZE = 8


def _convert(attention_mask: Tensor, values: bool) -> _Converted:
    """``values=False`` (under ``torch.compile``): no decision read from the mask's values."""
    if attention_mask.dtype == torch.bool:
        allowed, bias = attention_mask, None
    else:
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2
        bias = torch.where(allowed, attention_mask, torch.zeros((), dtype=attention_mask.dtype))
        if not bool(bias.any()):
            bias = None
    if not values:
        return _Converted(allowed, bias, False)
    if bool(allowed.all()):
        return _Converted(None, bias, True)  # the same attention as without a mask
    return _Converted(allowed, bias, bool(allowed.any(dim=-1).all()))


def split_mask(
    attention_mask: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The model's mask as attnkit's boolean mask (True = may attend) and a float bias, and the
    mask itself when SDPA may take it in their place.

    Models hand over either a boolean mask or an additive float mask whose masked entries are
    near the dtype's minimum and whose other entries are 0 (eager masks) or a bias some models
    add to it (ALiBi); an all-zero bias is dropped, and so is a mask that allows every pair.

    An additive mask in ``dtype`` under which every query row has a key is the same attention
    as the boolean mask with the bias (a masked score plus the dtype's minimum has weight
    exactly 0 after softmax); SDPA can take it as it is, with no conversion and no handling of
    rows without a key.

    The conversion of a mask tensor is kept while the tensor lives (at most
    ``_MASK_CACHE_SIZE`` of them), keyed by its identity and version and checked against a copy of
    its values, so that the layers of one forward pass, which all get the same mask, convert it
    once; a mask changed in place (also through ``.numpy()`` or ``.data``, which the version
    counter does not see) is converted again. Inference tensors (no version counter), masks that
    require a gradient and calls traced by ``torch.compile`` are converted on every call (under
    ``torch.compile`` nothing is decided from the mask's values: an all-True mask is kept, the
    additive form is not offered).

    Returns:
        (mask, bias, additive): mask boolean or None, bias in ``dtype`` or None, each
        broadcastable to the scores (B, H, M, N); additive: ``attention_mask`` when SDPA may
        take it in place of mask and bias, else None.
    """
    if attention_mask is None:
        return None, None, None
    if torch.compiler.is_compiling():
        converted = _convert(attention_mask, values=False)
    else:
        try:
            version = attention_mask._version
        except RuntimeError:  # an inference tensor has no version counter: not cached
            version = None
        hit = _MASKS.get(id(attention_mask))
        converted = None
        # the version counter misses writes through .numpy() or .data: the values are compared
        # with the copy kept (one pass, cheaper than converting again)
        if (
            version is not None
            and hit is not None
            and hit[0]() is attention_mask
            and hit[1] == version
            and torch.equal(hit[2], attention_mask)
        ):
            converted = hit[3]
        if converted is None:
            converted = _remember(attention_mask, _convert(attention_mask, values=True))
    mask, bias, every_row = converted
    additive = None
    if mask is not None and every_row and attention_mask.dtype == dtype:
        additive = attention_mask
    return mask, None if bias is None else bias.to(dtype), additive


def _remember(attention_mask: Tensor, converted: _Converted) -> _Converted:
    """Keep ``converted``, the attnkit form of ``attention_mask``, for :func:`split_mask`
    (nothing is kept for an inference tensor or one that requires a gradient)."""
    try:
        version = attention_mask._version
    except RuntimeError:  # an inference tensor has no version counter: not cached
        return converted
    if attention_mask.requires_grad:
        return converted
    key = id(attention_mask)
    if len(_MASKS) >= _MASK_CACHE_SIZE:
        _MASKS.pop(next(iter(_MASKS)))
    # (the reference's callback drops the entry when the mask is freed)
    ref = weakref.ref(attention_mask, lambda _, key=key: _MASKS.pop(key, None))
    _MASKS[key] = (ref, version, attention_mask.detach().clone(), converted)
    return converted


def eager_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    allow_is_causal_skip: bool = False,
    **kwargs: Any,
) -> Tensor | None:
    """The mask transformers' eager attention gets (``transformers.masking_utils.eager_mask``:
    additive, 0 where a pair may attend and the dtype's minimum elsewhere, (B, 1, M, N); None
    only for full attention without padding), built with its boolean form remembered for
    :func:`split_mask`, so that no layer converts it back.

    A decoding step (one query) that transformers' SDPA path would run without a mask (every
    key allowed: ``sdpa_mask`` skips the causal mask) gets None, as full attention does: adding
    the eager mask of that case, zeros, would change nothing.

    Takes the arguments of ``transformers.masking_utils.eager_mask``, and the
    ``allow_is_causal_skip`` that transformers passes to every mask function."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    # (a skipped bidirectional mask is None in eager too: the decoding shortcut is only taken
    # where None can mean nothing but "every key of one query", a skipped causal mask)
    decoding = (
        bool(allow_is_causal_skip)
        and not allow_is_bidirectional_skip
        and isinstance(q_length, int)
        and q_length == 1
    )
    allowed = sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=causal_mask_function if mask_function is None else mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=decoding,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        use_vmap=use_vmap,
        device=device,
        **kwargs,
    )
    if allowed is None:  # full attention (or one decoding query seeing every key): no mask
        return None
    zero = torch.zeros((), device=allowed.device, dtype=dtype)
    additive = torch.where(allowed, zero, torch.finfo(dtype).min)
    if not torch.compiler.is_compiling():
        if bool(allowed.all()):
            _remember(additive, _Converted(None, None, True))
        else:
            _remember(additive, _Converted(allowed, None, bool(allowed.any(dim=-1).all())))
    return additive


class SdpaPath:
    """attnkit's SDPA kernel (:mod:`attnkit.kernels.sdpa`) on the calls of one swap that it
    evaluates exactly, without :func:`attnkit.attention`'s per-call validation and kernel
    selection.

    Whether SDPA takes a call is read from the capabilities the kernel declares
    (:meth:`attnkit.kernels.Kernel.capability_reasons`: score, alignment, dtype, device, mask,
    bias, dropout) once per kind of call and remembered; the kernel's value checks (a non-finite
    masked key, the size of a half-precision bias) are left out, the first because the model's
    own attention does not guard against it either, the second by sending every half-precision
    call with a bias to :func:`attnkit.attention`.
    """

    def __init__(self) -> None:
        self._kernel = kernels.get("sdpa")
        self._verdicts: dict[tuple, bool] = {}

    def _takes(self, call: Call) -> bool:
        if self._kernel.capability_reasons(call):
            return False
        return not (call.bias is not None and call.k.dtype in _HALF)

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        score: Score,
        align: Alignment,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        dropout: float,
        additive: Tensor | None = None,
    ) -> AttentionOutput | None:
        """The attention of one call, or None when it needs the general path
        (:func:`attnkit.attention`): SDPA does not evaluate it exactly, or its dense mask would
        be evaluated block-sparsely there (:func:`attnkit.kernels.block_mask.from_dense_auto`).

        Args:
            q: queries (B, H, M, d).
            k: keys (B, H, N, d).
            v: values (B, H, N, d_v).
            score: a parameter-free score.
            align: a parameter-free alignment.
            mask: boolean (True = may attend) or None, broadcastable to (B, H, M, N).
            bias: additive, in the inputs' dtype, or None.
            dropout: dropout probability on the weights (0 in eval).
            additive: the model's additive mask when it stands for ``mask`` and ``bias`` (see
                :func:`split_mask`): SDPA then gets it as its float mask, in place of both.
        """
        m, n = q.shape[-2], k.shape[-2]
        limit = self._kernel.max_tokens
        key = (score, align, k.device, k.dtype, mask is None, bias is None, dropout > 0.0)
        if limit is not None:
            key += (max(m, n) > limit,)
        takes = self._verdicts.get(key)
        shape = None
        if takes is None or mask is not None:
            lead = q.shape[:-2]
            if k.shape[:-2] != lead:
                lead = broadcast_shapes(lead, k.shape[:-2])
            shape = torch.Size((*lead, m, n))
        if takes is None:
            call = Call(q, k, v, score, align, shape, mask=mask, bias=bias, dropout=dropout)
            takes = self._verdicts[key] = self._takes(call)
        if not takes:
            return None
        # (as attnkit.attention, no block-sparse form is sought while torch.compile traces)
        tracing = torch.compiler.is_compiling()
        if mask is not None and not tracing and from_dense_auto(mask, shape) is not None:
            return None
        if additive is not None:
            mask, bias = None, additive
        return sdpa.attend(q, k, v, score, align, mask=mask, bias=bias, dropout=dropout)
