"""A transformers model's attention masks in attnkit's form, for
:func:`attnkit.integrations.transformers.swap_attention`.

A swapped model calls attnkit's attention once per attention layer per forward pass (per token
when generating), with the same mask tensor for every layer of a pass. The mask is converted at
the swap's door, once per mask tensor, and the conversion is shared by the layers:

- :func:`eager_mask`: the mask function the swap registers, which builds the mask transformers'
  eager attention gets and remembers its boolean form (and whether it is exactly causal), so
  that no layer converts it back;
- :func:`split_mask`: any model mask as attnkit's boolean mask and float bias, converted once
  per mask tensor and reused by every layer of the pass (an in-place change to the mask is seen
  and converted again), and the mask itself when SDPA may add it to the scores as it is; a mask
  that allows every pair is dropped, as attention with it equals attention without it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnkit import masks

__all__ = ["eager_mask", "split_mask"]


class _Converted(NamedTuple):
    """A model mask in attnkit's form: ``mask`` boolean or None (every pair allowed), ``bias``
    float or None (all zero), whether every query row has a key it may attend, and whether
    ``mask`` is exactly the causal mask of M = N queries and keys, (M, M), the same for every
    batch row and head (SDPA then runs in its causal mode)."""

    mask: Tensor | None
    bias: Tensor | None
    every_row: bool
    causal: bool = False


# id(mask) -> (weak reference to the mask, its version, a copy of its values (None for a mask
# eager_mask built), its conversion)
_MASKS: dict[int, tuple[weakref.ref, int, Tensor | None, _Converted]] = {}
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
    rows without a key (the ``additive`` option of :meth:`attnkit.kernels.Kernel.direct`). It
    is not offered for a mask :func:`eager_mask` found exactly causal: that one is returned as
    the (M, M) causal mask, which SDPA evaluates in its causal mode.

    The conversion of a mask tensor is kept while the tensor lives (at most
    ``_MASK_CACHE_SIZE`` of them), keyed by its identity and version and checked against a copy of
    its values, so that the layers of one forward pass, which all get the same mask, convert it
    once; a mask changed in place (also through ``.numpy()`` or ``.data``, which the version
    counter does not see) is converted again. A mask :func:`eager_mask` built, which the model
    hands from its mask function to its layers, is checked by its version only. Inference
    tensors (no version counter), masks that require a gradient and calls traced by
    ``torch.compile`` are converted on every call (under ``torch.compile`` nothing is decided
    from the mask's values: an all-True mask is kept, the additive form is not offered).

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
            and (hit[2] is None or torch.equal(hit[2], attention_mask))
        ):
            converted = hit[3]
        if converted is None:
            converted = _remember(attention_mask, _convert(attention_mask, values=True))
    mask, bias, every_row, causal = converted
    additive = None
    if mask is not None and every_row and not causal and attention_mask.dtype == dtype:
        additive = attention_mask
    return mask, None if bias is None else bias.to(dtype), additive


def _remember(attention_mask: Tensor, converted: _Converted, *, built: bool = False) -> _Converted:
    """Keep ``converted``, the attnkit form of ``attention_mask``, for :func:`split_mask`
    (nothing is kept for an inference tensor or one that requires a gradient); ``built``: the
    mask was built here (:func:`eager_mask`) and no copy of its values is kept."""
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
    copy = None if built else attention_mask.detach().clone()
    _MASKS[key] = (ref, version, copy, converted)
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
    :func:`split_mask`, so that no layer converts it back; an exactly causal mask is
    remembered as the (M, M) causal mask.

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
        _remember(additive, _boolean_form(allowed), built=True)
    return additive


def _boolean_form(allowed: Tensor) -> _Converted:
    """The attnkit form of the boolean mask ``allowed`` (B, 1, M, N): None when it allows every
    pair; the (M, M) causal mask when it is exactly causal in every batch row (no
    padding, M = N queries from position 0), which SDPA evaluates in its causal mode as the
    model's own SDPA attention does; else ``allowed``."""
    if bool(allowed.all()):
        return _Converted(None, None, True)
    m, n = allowed.shape[-2:]
    if m == n and m > 1:
        # (made by attnkit.masks.causal: SDPA's kernel knows it without reading it again)
        causal = masks.causal(m, device=allowed.device)
        if torch.equal(allowed, causal.expand_as(allowed)):
            return _Converted(causal, None, True, causal=True)
    return _Converted(allowed, None, bool(allowed.any(dim=-1).all()))
