"""Linear attention (Katharopoulos, Vyas, Pappas and Fleuret, "Transformers are RNNs: Fast
Autoregressive Transformers with Linear Attention", ICML 2020; Soydaner 5.3): softmax's
similarity replaced by a kernel φ(q)·φ(k), so attention costs O(N) (see
:mod:`attnkit.efficient.kernelized` for the sums and their masks).

The feature map is pluggable: ``"elu+1"`` (the paper's φ(x) = elu(x) + 1, eq. 7), ``"relu"``, or
any module mapping (…, L, d) to non-negative features (…, L, m). Non-causal attention is eq. 5;
``causal=True`` is eqs. 8-9 by prefix sums; :meth:`LinearAttention.step` is the recurrent form
(eqs. 18-20) for decoding one position at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, hooks, masks
from attnkit import taxonomy as tx
from attnkit.efficient import kernelized as kz
from attnkit.efficient.lsh import HeadOutput, broadcast_shapes, check_head_inputs
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["FEATURE_MAPS", "EluPlusOne", "LinearAttention", "ReLUFeatures", "make_feature_map"]


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

    Causal kernelized attention answers row i from keys j ≤ i and its own query only, so the
    queries are front-padded with zero rows to N, the whole causal sequence is evaluated, and
    its last M rows are returned (weights too; parts report only those rows to listeners). The
    cost is that of the whole sequence, O(N); :meth:`LinearAttention.step` carries the
    recurrent state instead."""
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
        out = part.forward(q, k, v, mask=mask, bias=bias, need_weights=need_weights)
    for r in reports:
        hooks.report(r.module, r.weights[..., -m:, :], r.name)
    return type(out)(*(x[..., -m:, :] if isinstance(x, Tensor) else x for x in out))


def check_causal(q: Tensor, k: Tensor, who: str) -> None:
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"{who}(causal=True) needs as many queries as keys (self-attention), got q "
            f"{tuple(q.shape)} and k {tuple(k.shape)}"
        )


@REGISTRY.register("linear")
class LinearAttention(nn.Module):
    """Linear attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with q
    (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        feature_map: ``"elu+1"``, ``"relu"`` or a module giving non-negative features.
        causal: query i attends keys j ≤ i (needs M = N).
        chunk_size: block length of the causal prefix sums (memory vs. parallelism).

    Masks: key padding masks (…, 1, N) are honoured; a mask varying over queries is refused
    (ValueError). A bias cannot be added to a kernel's factorised scores and is refused.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    # causal=True: queries after a KV cache are the last rows of the causal sequence
    takes_q_offset: ClassVar[bool] = True

    def __init__(
        self, feature_map: str | nn.Module = "elu+1", *, causal: bool = False, chunk_size: int = 64
    ) -> None:
        super().__init__()
        self.phi = make_feature_map(feature_map)
        self.causal = arguments.boolean(causal, "causal")
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        self.align = kz.KernelNormalized()

    @property
    def decodes_with_cache(self) -> bool:
        """Causal, a decoding step over the cached keys equals its rows of the causal pass."""
        return self.causal

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (1, 2, 3))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.AlignmentKind.SOFT]

    def extra_repr(self) -> str:
        return f"causal={self.causal}, chunk_size={self.chunk_size}"

    def features(self, x: Tensor) -> Tensor:
        """φ(x) (…, L, m)."""
        return self.phi(x)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        need_weights: bool = False,
        q_offset: int = 0,
    ) -> HeadOutput:
        who = type(self).__name__
        rows = causal_rows(self, q, k, v, q_offset, mask=mask, bias=bias, need_weights=need_weights)
        if rows is not None:  # queries after a KV cache: the last rows of the causal sequence
            return rows
        arguments.boolean(need_weights, "need_weights")
        lead = check_head_inputs(q, k, v, mask, bias, who)
        refuse_bias(bias, who)
        if self.causal:
            check_causal(q, k, who)
        keep = kz.key_mask(mask, torch.Size((*lead, q.shape[-2], k.shape[-2])), who)
        # Elementwise maps (…, L, d) are the inputs' size: formed whole, they cost no more
        # memory than the inputs and no recomputation in the backward pass.
        fq, fk = self.features(q), self.features(k)
        return attend(self, fq, fk, v, keep, need_weights)

    def step(
        self, q: Tensor, k: Tensor, v: Tensor, state: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One decoding step of causal linear attention (Katharopoulos eqs. 18-20).

        Args:
            q, k: (B, …, d) the current position's query and key; v: (B, …, d_v).
            state: what the previous step returned, or None at the first position.

        Returns:
            the context (B, …, d_v) and the state (S (B, …, m, d_v), z (B, …, m)).
        """
        return kz.step(state, self.features(q), self.features(k), v)


def refuse_bias(bias: Tensor | None, who: str) -> None:
    if bias is not None:
        raise ValueError(
            f"{who}: an additive bias cannot be applied to kernelized attention (its scores are "
            "never formed); pass bias=None"
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
) -> HeadOutput:
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
    return HeadOutput(context, None)


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
) -> HeadOutput:
    """Kernelized attention with ``part``'s ``causal``/``chunk_size``/``align``; weights formed
    densely only when asked for or listened to."""
    if part.causal:
        context = kz.causal_feature_attention(fq, fk, v, keep, part.chunk_size)
    else:
        context = kz.feature_attention(fq, fk, v, keep)
    weights = None
    if need_weights or hooks.listening():
        weights = kz.dense_feature_weights(part.align, fq, fk, keep, part.causal)
        hooks.report(part, weights)
    return HeadOutput(context, weights if need_weights else None)
