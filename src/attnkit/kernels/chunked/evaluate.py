"""The chunked kernel's two paths (:mod:`attnkit.kernels.paths`): :class:`Fused`, the fused
CPU block-sparse path, and :class:`Tiled`, the general one; :func:`evaluate` runs a call on
either."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnkit.alignments.streaming import Streaming
from attnkit.inputs import broadcast_shapes
from attnkit.kernels import dense
from attnkit.kernels.base import Call
from attnkit.kernels.chunked import fused as fused_path
from attnkit.kernels.chunked.forms import is_additive
from attnkit.kernels.chunked.plan import (
    TILE_ELEMENTS,
    WIDE_TILE_ELEMENTS,
    Plan,
    default_chunk_size,
    tile_width,
    work_dtype,
)
from attnkit.kernels.chunked.streaming import TiledAttention, recomputed_weights, rows_with_a_key
from attnkit.kernels.paths import Path
from attnkit.output import AttentionOutput

__all__ = ["Fused", "Tiled", "evaluate", "rank2", "sizes"]


def rank2(x: Tensor | None) -> Tensor | None:
    """A mask or bias of rank < 2 with the (…, M, N) rank (it broadcasts over rows and keys)."""
    if x is None or x.dim() >= 2:
        return x
    return x.reshape((1,) * (2 - x.dim()) + tuple(x.shape))


def sizes(q, k, v, mask, bias) -> tuple[torch.Size, int, int]:
    """The output's batch dims (values, masks and biases may carry more than q and k do), M, N."""
    lead = broadcast_shapes(
        k.shape[:-2],
        () if q is None else q.shape[:-2],
        v.shape[:-2],
        *(x.shape[:-2] for x in (mask, bias) if x is not None and x.dim() > 2),
    )
    return lead, 1 if q is None else q.shape[-2], k.shape[-2]


def evaluate(call: Call, fused: bool) -> AttentionOutput:
    """Evaluate ``call`` on the fused block-sparse path (``fused``) or the tiled one; the
    caller has checked that the path serves the call."""
    q, k, v, score, align = call.parts()
    mask, bias, block_mask = rank2(call.mask), rank2(call.bias), call.block_mask
    lead, m, n = sizes(q, k, v, mask, bias)
    if m == 0 or n == 0 or math.prod(lead) == 0 or v.shape[-1] == 0:
        # Nothing to stream; the dense path returns the empty result with its autograd graph.
        return dense.attend(
            q,
            k,
            v,
            score,
            align,
            mask=mask,
            bias=bias,
            need_weights=call.need_weights,
            block_mask=block_mask,
            score_mod=call.score_mod,
        )
    assert isinstance(align, Streaming)
    if block_mask is not None:
        block_q, block_k = block_mask.block_q, block_mask.block_k
        # Adjacent visited tiles merge into one as long as it holds about a tile budget.
        per_key = block_q * tile_width(score) * max(1, math.prod(lead))
        budget = TILE_ELEMENTS if tile_width(score) == 1 else WIDE_TILE_ELEMENTS
        span_k = max(block_k, (budget // per_key) // block_k * block_k)
    else:
        span_k = 0
        chunk = call.chunk_size
        block_k = min(default_chunk_size(n, score) if chunk is None else chunk, n)
        per_row = block_k * tile_width(score) * max(1, math.prod(lead))
        budget = TILE_ELEMENTS if tile_width(score) == 1 else WIDE_TILE_ELEMENTS
        block_q = max(1, min(m, budget // per_row))
    has_key = None if mask is None else mask.any(dim=-1, keepdim=True)
    if block_mask is not None:
        has_key = block_mask.has_key if mask is None else rows_with_a_key(mask, block_mask)
    masked = mask is not None or block_mask is not None
    plan = Plan(
        score=score,
        align=align,
        mask=mask,
        has_key=has_key,
        lead=lead,
        multi=score.multi_dimensional,
        m=m,
        n=n,
        block_q=block_q,
        block_k=block_k,
        work=work_dtype(v.dtype),
        guard=masked and not fused and not call.masked_finite and not fused_path.all_finite(v),
        block_mask=block_mask,
        score_mod=call.score_mod,
        span_k=span_k,
    )
    if fused:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v)):
            return AttentionOutput(fused_path.sparse_fused_grad(plan, q, k, v, bias, score, align))
        return AttentionOutput(fused_path.sparse_fused(plan, q, k, v, bias, score, align))
    qp = score.project_query(q)
    kp = score.project_key(k)
    score_mod = call.score_mod
    mod_params = score_mod.parameters() if isinstance(score_mod, nn.Module) else ()
    params = [p for p in (*score.parameters(), *align.parameters(), *mod_params) if p.requires_grad]
    # A strided v (heads split off by a transpose) would be copied by every tile's matmuls.
    context = TiledAttention.apply(plan, qp, kp, v.contiguous(), bias, *params)
    if not call.need_weights:
        return AttentionOutput(context)
    weights, scores = recomputed_weights(plan, qp, kp, v, bias)
    return AttentionOutput(context, weights, scores)


class Fused(Path):
    """Block-sparse dot-product softmax attention through PyTorch's fused CPU kernel, piece by
    piece, merged by the log-sum-exp (:func:`sparse_fused`); gradients for q, k and v through
    the fused kernel's backward (:func:`sparse_fused_grad`). Same result as the tiled path."""

    kernel = "chunked"
    name = "fused"
    supports_dtypes = frozenset({torch.float32, torch.float64})
    supports_devices = frozenset({"cpu"})
    needs_dot_product_score = True
    needs_equal_head_sizes = True  # the fused kernel wants one head size for q, k and v
    supports_multi_dimensional = False
    needs_softmax = True
    returns_weights = False
    needs_block_mask = True
    gradients = "inputs"
    runs_compiled = False

    def extra_reasons(self, call: Call) -> list[str]:
        """The fused kernel's presence, a score_mod of the form e + f, one dtype, and (only
        when nothing else refuses: it reads the tensors) finite keys and masked values (the
        pieces add the mask to the scores, and NaN + −inf is NaN)."""
        label = self.label
        reasons = []
        if fused_path.FLASH is None:
            reasons.append(
                f"{label} needs torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"
            )
        if call.score_mod is not None and is_additive(call.score_mod) is None:
            reasons.append(f"{label} takes a score_mod of the form e + f(b, h, q_idx, kv_idx) only")
        dtypes = {t.dtype for t in (call.q, call.k, call.v) if t is not None}
        if len(dtypes) > 1:
            reasons.append(f"{label} takes q, k and v of one dtype")
        if call.bias is not None and call.bias.dtype != call.v.dtype:
            reasons.append(
                f"{label} takes a bias of the values' dtype {call.v.dtype}, not {call.bias.dtype}"
            )
        wants_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (call.q, call.k, call.v)
        )
        if wants_grad and fused_path.FLASH_BACKWARD is None:
            reasons.append(
                f"{label} gives gradients with "
                "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward only"
            )
        if reasons or self.capability_reasons(call) or call.masked_finite:
            return reasons
        if not fused_path.all_finite(call.v):
            reasons.append(f"{label} needs finite values (a masked one is not)")
        elif not fused_path.all_finite(call.k):
            reasons.append(
                f"{label} needs finite keys (a masked one would reach the rows it is hidden from)"
            )
        return reasons

    def attend(self, call: Call) -> AttentionOutput:
        return evaluate(call, fused=True)


class Tiled(Path):
    """The general path: query × key tiles of any score and streaming alignment, with the
    kernel's own backward (:class:`TiledAttention`); it serves every call the kernel supports."""

    kernel = "chunked"
    name = "tiled"

    def attend(self, call: Call) -> AttentionOutput:
        return evaluate(call, fused=False)
