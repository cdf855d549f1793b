"""Hand a block-sparse dot-product softmax call to PyTorch's FlexAttention
(``torch.nn.attention.flex_attention`` under ``torch.compile``; Wikipedia "FlexAttention").

Opt-in: ``ak.attention(..., block_mask=bm, score_mod=f, kernel="flex")``. Automatic selection
never takes it, because its first call per shape, mask function and score_mod compiles for tens
of seconds (and ``create_block_mask`` runs once per block mask, cached here by the attnkit block
mask). It pays for many calls of the same shape, in a model evaluated repeatedly. On the CPU
FlexAttention has no backward, so calls that need a gradient there are refused (use the chunked
kernel). When compilation is unavailable or fails, the call falls back to the chunked kernel
with a warning (once): never a wrong answer.

The block mask must come from a mask function (:meth:`BlockMask.from_mask_mod`, e.g.
:mod:`attnkit.patterns`) written with tensor operations FlexAttention can trace; ``score_mod``
is passed as it is (divided by the softmax temperature when that is not 1).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.kernels import chunked
from attnkit.kernels.base import Call, Kernel, register
from attnkit.kernels.block_mask import BlockMask
from attnkit.output import AttentionOutput

__all__ = ["Flex", "available", "set_compiled"]

_COMPILED: Callable | None = None
_USE_COMPILE = True
_WARNED = False
# id(attnkit block mask) -> (weak reference, FlexAttention's block mask)
_BLOCK_MASKS: dict[int, tuple[weakref.ref, object]] = {}


def _module():
    """``torch.nn.attention.flex_attention``, imported on first use; None without it."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:  # torch without FlexAttention
        return None
    return flex_attention


def available() -> bool:
    """Whether this torch has FlexAttention."""
    return _module() is not None


def set_compiled(value: bool) -> None:
    """Run FlexAttention compiled (True, the default) or eagerly (False: slow, for checks)."""
    global _USE_COMPILE
    if not isinstance(value, bool):
        raise TypeError(f"set_compiled takes True or False, got {value!r}")
    _USE_COMPILE = value


def _function() -> Callable:
    global _COMPILED
    module = _module()
    assert module is not None
    if not _USE_COMPILE:
        return module.flex_attention
    if _COMPILED is None:
        _COMPILED = torch.compile(module.flex_attention)
    return _COMPILED


def _flex_block_mask(bm: BlockMask, device: torch.device):
    """FlexAttention's block mask of ``bm`` (same mask function and blocks), built once."""
    hit = _BLOCK_MASKS.get(id(bm))
    if hit is not None and hit[0]() is bm:
        return hit[1]
    module = _module()
    assert module is not None
    batch = bm.lead[0] if len(bm.lead) >= 1 else None
    heads = bm.lead[1] if len(bm.lead) >= 2 else None
    made = module.create_block_mask(
        bm.mask_mod,
        batch,
        heads,
        bm.m,
        bm.n,
        device=device,
        BLOCK_SIZE=(bm.block_q, bm.block_k),
    )
    _BLOCK_MASKS[id(bm)] = (weakref.ref(bm), made)
    weakref.finalize(bm, _BLOCK_MASKS.pop, id(bm), None)
    return made


class Flex(Kernel):
    """FlexAttention for block-sparse dot-product softmax attention (opt-in, forward on CPU)."""

    name = "flex"
    priority = 5
    needs_dot_product_score = True
    supports_multi_dimensional = False
    needs_softmax = True
    returns_weights = False
    accepts_mask = False  # fold a mask into the mask function
    accepts_bias = False  # fold a bias into the score_mod
    accepts_dropout = False
    preference = 'when named (kernel="flex"): its first call per shape compiles for seconds'

    def extra_reasons(self, call: Call) -> list[str]:
        if not available():
            return ["this torch has no torch.nn.attention.flex_attention"]
        reasons = []
        if call.block_mask is None or call.block_mask.mask_mod is None:
            reasons.append("the flex kernel takes a block mask built from a mask function")
        if call.q is None or call.q.dim() != 4 or call.k.dim() != 4 or call.v.dim() != 4:
            reasons.append("the flex kernel takes q, k, v of shape (B, H, L, d)")
        elif len({call.q.dtype, call.k.dtype, call.v.dtype}) != 1:
            reasons.append("q, k and v differ in dtype")
        if call.k.device.type == "cpu" and torch.is_grad_enabled():
            tensors = [call.q, call.k, call.v, *call.score.parameters()]
            if any(t is not None and t.requires_grad for t in tensors):
                reasons.append("FlexAttention has no backward on the CPU (a gradient is required)")
        return reasons

    def prefers(self, call: Call) -> bool:
        return False  # opt-in: its compilation takes seconds

    def attend(self, call: Call) -> AttentionOutput:
        bm = call.block_mask
        assert bm is not None
        try:
            context = _attend(call)
        except Exception as err:  # compilation unavailable or failed: the chunked kernel
            _warn(err)
            return chunked.attend(*call.parts(), block_mask=bm, score_mod=call.score_mod)
        return AttentionOutput(context)


def _attend(call: Call) -> Tensor:
    bm = call.block_mask
    assert bm is not None and call.q is not None
    temperature = call.align.softmax_temperature()
    assert temperature is not None
    qp, kp, scale = call.score.dot_form(call.q, call.k)
    lead = torch.broadcast_shapes(qp.shape[:-2], kp.shape[:-2], call.v.shape[:-2])
    qp, kp, v = (x.expand(*lead, *x.shape[-2:]) for x in (qp, kp, call.v))
    score_mod = call.score_mod
    if temperature != 1.0:
        inner, inv_t = score_mod, 1.0 / temperature

        def score_mod(e, b, h, q_idx, kv_idx):
            return (e if inner is None else inner(e, b, h, q_idx, kv_idx)) * inv_t

        if inner is None:
            scale, score_mod = scale * inv_t, None
    out = _function()(
        qp, kp, v, score_mod=score_mod, block_mask=_flex_block_mask(bm, qp.device), scale=scale
    )
    # Rows with no allowed key: attnkit gives context 0.
    return torch.where(bm.has_key.to(out.device), out, torch.zeros((), dtype=out.dtype))


def _warn(err: Exception) -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        first = str(err).splitlines()[0] if str(err) else ""
        warnings.warn(
            f"attnkit: FlexAttention failed ({type(err).__name__}: {first}); evaluating with "
            "the chunked kernel",
            RuntimeWarning,
            stacklevel=4,
        )


register(Flex())
