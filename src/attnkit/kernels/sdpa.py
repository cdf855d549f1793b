"""Dispatch to ``torch.nn.functional.scaled_dot_product_attention`` when it computes the same
thing: a score in dot-product form, an alignment that is softmax with a constant temperature, and
no weights requested."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.inputs import broadcast_shapes
from attnkit.kernels.base import Call, Kernel, register
from attnkit.kernels.block_mask import from_dense_auto
from attnkit.kernels.prepare import clear_masked
from attnkit.masks import is_made_causal
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["SDPA", "attend", "can_dispatch", "direct"]

_HALF = (torch.float16, torch.bfloat16)
# bfloat16 holds every integer up to 2^8 exactly; above, adding a bias rounds the score.
_HALF_EXACT = 256.0


def _reasons(score: Score, align: Alignment, *, need_weights: bool) -> list[str]:
    reasons = []
    if need_weights:
        reasons.append("SDPA does not return the weights (need_weights=True)")
    if not score.dot_product_form:
        reasons.append(f"the {type(score).__name__} score is not in dot-product form")
    if score.multi_dimensional:
        reasons.append("multi-dimensional scores are not dot products")
    if align.softmax_temperature() is None:
        reasons.append(
            f"the {type(align).__name__} alignment is not softmax with a constant temperature"
        )
    return reasons


def _is_causal(mask: Tensor | None, m: int, n: int) -> bool:
    """Whether ``mask`` is exactly the causal mask of M = N queries and keys, the same for every
    batch and head (query i attends keys j ≤ i); False inside a compiled graph (a data-dependent
    check would break it)."""
    if mask is None or m != n or m < 2 or mask.shape[-2:] != (m, n):
        return False
    if any(size != 1 for size in mask.shape[:-2]) or torch.compiler.is_compiling():
        return False
    if is_made_causal(mask):
        return True  # (made by attnkit.masks.causal and unchanged: nothing to compare)
    causal = torch.ones(m, n, dtype=torch.bool, device=mask.device).tril_()
    return torch.equal(mask.reshape(m, n), causal)


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether q (B, H, M, d) and k, v (B, H_kv, N, ·) differ only in their heads, H a multiple
    of H_kv (grouped-query attention, which SDPA evaluates without repeating k and v)."""
    if q.dim() != 4 or k.dim() != 4:
        return False
    h, h_kv = q.shape[1], k.shape[1]
    if h == h_kv or h % h_kv:
        return False
    return k.shape[:-2] == v.shape[:-2] and q.shape[0] == k.shape[0]


def can_dispatch(score: Score, align: Alignment, *, need_weights: bool) -> bool:
    """Whether SDPA computes exactly this attention."""
    return not _reasons(score, align, need_weights=need_weights)


def attend(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    score: Score,
    align: Alignment,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    dropout: float = 0.0,
) -> AttentionOutput:
    """Evaluate with SDPA; the caller has checked :func:`can_dispatch`."""
    temperature = align.softmax_temperature()
    assert temperature is not None
    qp, kp, scale = score.dot_form(q, k)
    # softmax((scale·q'ᵀk' + bias) / τ): fold 1/τ into the scale and the bias.
    inv_t = 1.0 / temperature
    scale = scale * inv_t
    gqa = {}
    if _grouped(qp, kp, v):  # H query heads over H_kv key/value heads: SDPA's own mode
        gqa = {"enable_gqa": True}
    elif not (qp.shape[:-2] == kp.shape[:-2] == v.shape[:-2]):  # SDPA wants equal batch dims
        lead = broadcast_shapes(qp.shape[:-2], kp.shape[:-2], v.shape[:-2])
        qp = qp.expand(*lead, *qp.shape[-2:])
        kp = kp.expand(*lead, *kp.shape[-2:])
        v = v.expand(*lead, *v.shape[-2:])
    padded = None  # the values' own size where zero features were added (_one_head_size)
    if qp.shape[-2] >= 64 and v.device.type == "cpu":  # (long calls only: no frame otherwise)
        v = _packed_rows(v, qp.shape[-2])
        qp, kp, v, padded = _one_head_size(qp, kp, v)
    if bias is None and _is_causal(mask, qp.shape[-2], kp.shape[-2]):
        # SDPA's own causal mode skips the tiles above the diagonal (a boolean mask makes it
        # evaluate every tile); every row keeps its diagonal key, so no row is empty
        context = F.scaled_dot_product_attention(
            qp, kp, v, dropout_p=dropout, scale=scale, is_causal=True, **gqa
        )
        return AttentionOutput(context if padded is None else context[..., :padded])
    attn_mask: Tensor | None = mask
    if bias is not None:
        attn_mask = bias if inv_t == 1.0 else bias * inv_t
        if mask is not None:
            attn_mask = torch.where(mask, attn_mask, float("-inf"))
    context = F.scaled_dot_product_attention(
        qp, kp, v, attn_mask=attn_mask, dropout_p=dropout, scale=scale, **gqa
    )
    if padded is not None:
        context = context[..., :padded]
    if mask is not None:
        # SDPA gives NaN for a row with no key; attnkit gives 0 (DESIGN 2).
        any_key = mask.any(dim=-1, keepdim=True)
        context = torch.where(any_key, context, torch.zeros((), dtype=context.dtype))
    return AttentionOutput(context)


def _one_head_size(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, int | None]:
    """q, k, v with one size per head where d_v ≠ d, the smaller side padded with zero
    features, and the values' own size d_v (None where nothing was added); for a call on the
    CPU of at least 64 queries (:func:`attend` asks only then).

    SDPA's CPU kernels run the fused (flash) kernel only on one head size, and otherwise the
    math path, which makes the whole (M, N) weights: zero features of q and k add 0 to every
    dot product, zero features of v give output columns that are cut off, so the result is the
    same, and the fused kernel is 2.4x faster at 1k and 3.6x at 4k (fwd+bwd, 4 heads, d = 48,
    d_v = 32, causal)."""
    d, d_v = k.shape[-1], v.shape[-1]
    if d == d_v:
        return q, k, v, None
    if d_v < d:
        return q, k, F.pad(v, (0, d - d_v)), d_v
    return F.pad(q, (0, d_v - d)), F.pad(k, (0, d_v - d)), v, d_v


def _packed_rows(v: Tensor, m: int) -> Tensor:
    """v with its rows packed when it is a view whose rows lie apart (the value part of one
    packed q/k/v projection) and the call is long enough (M ≥ 512 queries) for a copy of v to
    be small beside the attention: SDPA's CPU kernels read and write contiguous rows about 2 %
    faster (fwd+bwd, 4 × 4096 × 64 causal, rows 512 floats apart). For a call on the CPU
    (:func:`attend` asks only then)."""
    if m < 512 or v.stride(-2) == v.shape[-1] or v.stride(-1) != 1:
        return v
    return v.contiguous()


def direct(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score: Score,
    align: Alignment,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    dropout: float = 0.0,
    additive: Tensor | None = None,
    keep_masked: bool = False,
) -> AttentionOutput | None:
    """The call evaluated here directly, as automatic kernel selection would evaluate it, for a
    caller whose plan has checked its inputs (:mod:`attnkit.call_plan`): q (…, M, d),
    k (…, N, d), v (…, N, d_v) and a mask and bias in the inputs' dtype and device that
    broadcast to the scores; no weights asked for. None when selection could take another
    kernel or path for it: SDPA cannot evaluate this score and alignment, a half-precision
    bias (which SDPA takes only when small), a non-finite key or value under a mask that
    differs per query, or a dense mask that selection evaluates block-sparsely
    (:func:`attnkit.kernels.block_mask.from_dense_auto`). The caller then makes the general
    call, which gives the reasons.

    The two options of :meth:`attnkit.kernels.Kernel.direct`: ``additive`` (the mask and bias
    as one float mask, every query row with a key) is what SDPA gets in place of ``mask`` and
    ``bias`` (so a caller whose mask is exactly causal gives none, and SDPA's causal mode
    runs); with ``keep_masked`` the masked keys and values are neither cleared nor looked at (a
    non-finite one makes its query rows non-finite, as in attention that adds its mask to the
    scores), so no call is refused for one.
    """
    if not can_dispatch(score, align, need_weights=False):
        return None
    if bias is not None and (bias.dtype in _HALF or bias.dtype != k.dtype):
        return None
    if mask is not None:
        if score.mixes_keys:
            return None
        m, n = q.shape[-2], k.shape[-2]
        # (as selection, no block-sparse form is sought while torch.compile traces)
        if not torch.compiler.is_compiling() and from_dense_auto(mask, (m, n)) is not None:
            return None
        if not keep_masked:
            k, v, finite = clear_masked(k, v, mask, scan=False)
            if not finite:
                return None
        if additive is not None:
            mask, bias = None, additive
    return attend(q, k, v, score, align, mask=mask, bias=bias, dropout=dropout)


class SDPA(Kernel):
    """PyTorch's fused kernel for dot-product softmax attention (FlashAttention on CUDA)."""

    name = "sdpa"
    priority = 30
    needs_dot_product_score = True
    supports_multi_dimensional = False
    needs_softmax = True
    masks_key_mixing_scores = False  # the mask reaches SDPA, never the score
    returns_weights = False
    accepts_block_mask = False
    accepts_score_mod = False

    def extra_reasons(self, call: Call) -> list[str]:
        reasons = []
        if call.bias is not None and call.bias.dtype != call.k.dtype:
            reasons.append(f"bias dtype {call.bias.dtype} differs from the inputs' {call.k.dtype}")
        if torch.compiler.is_compiling():
            return reasons  # the data-dependent checks below would break a compiled graph
        half = call.k.dtype in _HALF
        if call.bias is not None and half and bool((call.bias.abs() > _HALF_EXACT).any()):
            reasons.append(
                f"a {call.k.dtype} bias larger than {_HALF_EXACT} in magnitude would round "
                "the scores by more than one unit inside SDPA"
            )
        if (
            call.mask is not None
            and not call.masked_finite
            and not (bool(torch.isfinite(call.k).all()) and bool(torch.isfinite(call.v).all()))
        ):
            reasons.append("a key or value is not finite (SDPA would let a masked one through)")
        return reasons

    def attend(self, call: Call) -> AttentionOutput:
        return attend(*call.parts(), mask=call.mask, bias=call.bias, dropout=call.dropout)

    def direct(self, q, k, v, score, align, **options):  # Kernel.direct: the module's
        return direct(q, k, v, score, align, **options)


register(SDPA())
