"""Shared helpers of the kernelized per-head parts (linear attention, Performer, RFA, FMM,
fast weights, the relative-kernel FFT part, the linear family): feature maps φ, the causal rows
of a decoding step, and attention from φ(q), φ(k) (Katharopoulos et al. 2020, eqs. 5-9; Soydaner
5.3). The sums and their masks are in :mod:`attnkit.efficient.kernelized`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, hooks
from attnkit.efficient import kernelized as kz
from attnkit.inputs import broadcast_shapes
from attnkit.output import AttentionOutput

__all__ = [
    "FEATURE_MAPS",
    "EluPlusOne",
    "ReLUFeatures",
    "attend",
    "attend_inputs",
    "causal_rows",
    "check_causal",
    "make_feature_map",
    "whole_maps",
]


class EluPlusOne(nn.Module):
    """φ(x) = elu(x) + 1 (Katharopoulos eq. 7): positive, with gradients everywhere."""

    def forward(self, x: Tensor) -> Tensor:
        return F.elu(x).add_(1)  # elu's backward reads its input, so its output can take the 1


class ReLUFeatures(nn.Module):
    """φ(x) = max(x, 0): non-negative; a query whose features all vanish gets context 0."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


FEATURE_MAPS: dict[str, Callable[[], nn.Module]] = {"elu+1": EluPlusOne, "relu": ReLUFeatures}


def make_feature_map(phi: str | nn.Module) -> nn.Module:
    """A feature map from a name in :data:`FEATURE_MAPS` or a module."""
    if isinstance(phi, nn.Module):
        return phi
    if isinstance(phi, str) and phi in FEATURE_MAPS:
        return FEATURE_MAPS[phi]()
    raise ValueError(
        f"feature_map must be one of {sorted(FEATURE_MAPS)} or an nn.Module mapping (…, L, d) "
        f"to non-negative features, got {phi!r}"
    )


def causal_rows(
    part: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offset: int,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    need_weights: bool,
):
    """A causal part's output for queries at positions ``q_offset`` … ``q_offset`` + M − 1 of
    the N = ``q_offset`` + M keys (decoding with a KV cache: the cached keys, then the new ones),
    or None when there is nothing to do (``q_offset`` 0, or a non-causal part, for which a
    query's position does not matter).

    Called from the part's :meth:`attnkit.HeadAttention.attend` (inputs validated, masked keys
    excluded by the template, which reports the returned weights): causal kernelized attention
    answers row i from keys j ≤ i and its own query only, so the queries are front-padded with
    zero rows to N, the part's ``attend`` evaluates the whole causal sequence, and its last M
    rows are returned (weights too; weights the part reports by name inside ``attend`` are
    reported for those rows only). The cost is that of the whole sequence, O(N);
    :meth:`LinearAttention.step` carries the recurrent state instead."""
    offset = arguments.nonnegative_int(q_offset, "q_offset")
    if offset == 0 or not getattr(part, "causal", False):
        return None
    m = q.shape[-2]
    if m + offset != k.shape[-2]:
        raise ValueError(
            f"{type(part).__name__}(causal=True): queries at positions {offset} … {offset + m - 1} "
            f"need {offset + m} keys (the cache's and the new ones), got k {tuple(k.shape)}"
        )
    q = F.pad(q, (0, 0, offset, 0))
    if mask is not None and mask.dim() >= 2 and mask.shape[-2] == m and m > 1:
        lead = mask.shape[:-2]
        above = torch.ones(*lead, offset, mask.shape[-1], dtype=mask.dtype, device=mask.device)
        mask = torch.cat([above, mask], dim=-2)
    listening = hooks.listening()
    reports: list[hooks.Report] = []
    with hooks.listen(reports.append) if listening else contextlib.nullcontext():
        out = part.attend(q, k, v, mask=mask, bias=bias, need_weights=need_weights, q_offset=0)
    for r in reports:
        hooks.report(r.module, r.weights[..., -m:, :], r.name)
    return out.map(lambda x: x[..., -m:, :])


def check_causal(q: Tensor, k: Tensor, who: str) -> None:
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"{who}(causal=True) needs as many queries as keys (self-attention), got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )


def attend_inputs(
    part: nn.Module,
    phi_q: kz.FeatureMap,
    phi_k: kz.FeatureMap,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    need_weights: bool,
    *,
    params: tuple[Tensor, ...] = (),
    m: int,
) -> AttentionOutput:
    """:func:`attend` from the inputs and row-wise feature maps ``phi(x, *params)`` with m
    features: non-causal context by chunks of rows (:func:`kernelized.chunked_feature_attention`,
    the (…, N, m) maps never formed) once the maps are over :data:`kernelized.WHOLE_BYTES`; the
    whole maps for smaller ones, the causal form or the weights."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if whole_maps(part, q, k, v, need_weights, m):
        return attend(part, phi_q(q, *params), phi_k(k, *params), v, keep, need_weights)
    chunk = kz.chunk_rows(lead, m)
    context = kz.chunked_feature_attention(
        phi_q, phi_k, q, k, v, keep, params=params, chunk_size=chunk
    )
    return AttentionOutput(context, None)


def whole_maps(
    part: nn.Module, q: Tensor, k: Tensor, v: Tensor, need_weights: bool, m: int
) -> bool:
    """Whether :func:`attend_inputs` forms the whole (…, L, m) maps: causal, weights asked for
    or listened to, or maps of at most :data:`kernelized.WHOLE_BYTES`."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    size = lead.numel() * max(q.shape[-2], k.shape[-2]) * m * q.element_size()
    return part.causal or need_weights or hooks.listening() or size <= kz.WHOLE_BYTES


def attend(
    part: nn.Module, fq: Tensor, fk: Tensor, v: Tensor, keep: Tensor | None, need_weights: bool
) -> AttentionOutput:
    """Kernelized attention with ``part``'s ``causal``/``chunk_size``/``align``; weights formed
    densely only when asked for (the template :meth:`attnkit.HeadAttention.forward` asks for
    them when someone listens, and reports them)."""
    if part.causal:
        context = kz.causal_feature_attention(fq, fk, v, keep, part.chunk_size)
    else:
        context = kz.feature_attention(fq, fk, v, keep)
    weights = None
    if need_weights:
        weights = kz.dense_feature_weights(part.align, fq, fk, keep, part.causal)
    return AttentionOutput(context, weights)
