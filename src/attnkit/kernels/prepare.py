"""The validated call of one attention evaluation (:class:`attnkit.kernels.Call`), built from
:func:`attnkit.attention`'s arguments: what every kernel takes and
:func:`attnkit.kernels.explain` reads. Masked keys and values are made unable to reach anything
here, once, and a dense mask that is mostly empty tiles becomes a block mask."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from attnkit import checks, inputs
from attnkit.alignments import Alignment
from attnkit.kernels.base import Call, get
from attnkit.kernels.block_mask import BlockMask, ScoreMod, check_type, from_dense_auto
from attnkit.scores import Score
from attnkit.scores.base import check_heads

__all__ = ["check_for_score", "clear_masked", "prepare_call"]


def _all_finite(x: Tensor) -> bool:
    """Whether every element of ``x`` is finite: one reduction (a NaN or an infinity makes the
    sum non-finite; only a sum that overflows needs the element-wise look)."""
    x = x.detach()
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())


def _dead_keys(mask: Tensor) -> Tensor:
    """(…, N, 1): True for the keys that no query row may attend (a mask of rank < 2 is the same
    for every row)."""
    keep = mask.any(dim=-2) if mask.dim() >= 2 else mask
    return ~keep.unsqueeze(-1) if keep.dim() else ~keep


def clear_masked(
    k: Tensor, v: Tensor, mask: Tensor, *, scan: bool, finite: bool = False
) -> tuple[Tensor, Tensor, bool]:
    """k and v with the keys and values that ``mask`` hides from every query made unable to
    reach anything, and whether no masked key or value is left non-finite (``masked_finite``).

    A masked position's content must not influence anything: not the scores of other keys, not
    the context (0·NaN is NaN), not the gradients. (A score that mixes neighbouring keys takes
    the mask itself and reads a masked key as zeros, per query row.) In order:

    - inputs stated finite by the caller (``finite``: k and v hold no NaN or infinity anywhere,
      e.g. a model's own activations): nothing to do;
    - a mask the same for every query, (…, 1, N) — key padding, and every step of decoding —
      unless ``scan``: the masked keys and values are set to zero by construction (one
      ``torch.where`` each; the values are not read on the host);
    - otherwise (masks that differ per query, or ``scan`` for calls whose raw scores at masked
      positions are returned as they are): keys and values are looked at once; when one is not
      finite, the keys and values masked for every query are set to zero, and False says that
      the kernel must guard the rest per row.
    """
    if finite:
        return k, v, True
    if not scan and (mask.dim() < 2 or mask.shape[-2] == 1):
        dead = _dead_keys(mask)
        zero = k.new_zeros(())
        return torch.where(dead, zero, k), torch.where(dead, zero.to(v.dtype), v), True
    k_ok, v_ok = _all_finite(k), _all_finite(v)
    if k_ok and v_ok:
        return k, v, True
    dead = _dead_keys(mask)
    zero = k.new_zeros(())
    k = k if k_ok else torch.where(dead, zero, k)
    v = v if v_ok else torch.where(dead, zero.to(v.dtype), v)
    return k, v, False


def _exclude_masked(call: Call, finite: bool) -> Call:
    """The call whose masked keys and values cannot reach anything (:func:`clear_masked`), with
    :attr:`Call.masked_finite` set where that is established (kernels then do not look). A
    block mask or weights asked for make the keys and values be looked at, unless the caller
    states them ``finite``."""
    if call.mask is None:
        return call
    if finite:
        return dataclasses.replace(call, masked_finite=True)
    if torch.compiler.is_compiling():
        return call  # (a data-dependent check would break a compiled graph)
    scan = call.block_mask is not None or call.need_weights
    k, v, finite = clear_masked(call.k, call.v, call.mask, scan=scan)
    return dataclasses.replace(call, k=k, v=v, masked_finite=finite)


def prepare_call(
    q: Tensor | None,
    k: Tensor,
    v: Tensor | None = None,
    *,
    score: str | Score = "scaled_dot",
    align: str | Alignment = "softmax",
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    need_weights: bool = False,
    chunk_size: int | None = None,
    dropout: float = 0.0,
    kernel: str | None = None,
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
    checked: bool = False,
    finite: bool = False,
) -> Call:
    """The validated call that :func:`attention` hands to a kernel, for the same arguments
    (what :func:`attnkit.kernels.explain` reads); raises as :func:`attention` does.

    Two facts a caller may state (both False by default; a wrong statement is not caught):
    ``checked`` — the caller validated q, k, v, the mask and the bias at its door and shaped
    them itself (the per-head call of a layer's plan): only what it cannot know about this
    score is checked (:func:`check_for_score`); ``finite`` — k and v hold no NaN or infinity
    anywhere, padding included: masked keys are neither looked at nor cleared
    (:func:`clear_masked`)."""
    score_part = checks.resolve_score(score)
    align_mod = checks.resolve_alignment(align)
    if v is None:
        v = k
    if checked:
        shape = _checked_shape(q, k, v, score_part)
    else:
        shape = checks.validate(q, k, v, score_part, mask=mask, bias=bias, align=align_mod)
    if not isinstance(need_weights, bool):
        raise TypeError(f"need_weights must be a bool, got {need_weights!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)):
        raise TypeError(f"dropout must be a number in [0, 1), got {dropout!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if block_mask is not None:
        check_type(block_mask)
        block_mask.check(shape)
    if score_mod is not None:
        inputs.score_mod(score_mod)
    call = Call(
        q,
        k,
        v,
        score_part,
        align_mod,
        shape,
        mask=mask,
        bias=bias,
        need_weights=need_weights,
        chunk_size=chunk_size,
        dropout=float(dropout),
        block_mask=block_mask,
        score_mod=score_mod,
    )
    call = _exclude_masked(call, finite)
    if kernel is None:
        call = _block_sparse(call)
    return call


def _checked_shape(q: Tensor | None, k: Tensor, v: Tensor, score: Score) -> torch.Size:
    """The scores' shape (B, …, M, N) of a call whose caller states it ``checked``.

    The door (e.g. :meth:`attnkit.MultiHeadAttention.forward`) checked the tensors, the mask and
    the bias and shaped q, k and v itself; what it cannot know is checked by
    :func:`check_for_score`."""
    check_for_score(q, k, v, score)
    return checks.scores_shape(q, k)


def check_for_score(q: Tensor | None, k: Tensor, v: Tensor, score: Score) -> None:
    """What a layer that checked and shaped q, k and v cannot know: whether this score suits
    them (its head count and, for a multi-dimensional score, d_out) and whether any key is
    left."""
    check_heads(score, q, k)
    if k.shape[-2] == 0:
        raise ValueError(f"k has no keys (N = 0, shape {tuple(k.shape)}); attention needs N >= 1")
    if score.multi_dimensional and score.d_out != v.shape[-1]:
        raise ValueError(
            f"the multi-dimensional score gives d_out = {score.d_out} scores per key but v has "
            f"d_v = {v.shape[-1]} features (shape {tuple(v.shape)}); they must match (eq. 30)"
        )


def _block_sparse(call: Call) -> Call:
    """The call with its dense mask as a block mask, when most of the mask's tiles are empty
    (:func:`attnkit.kernels.block_mask.from_dense_auto`) and the chunked kernel evaluates the call
    as it is (no weights asked for: the chunked kernel's weights carry no gradient). The result
    equals the dense masked result; the cost follows the share of tiles holding an allowed pair."""
    if (
        call.mask is None
        or call.block_mask is not None
        or call.chunk_size is not None
        or call.need_weights
        or torch.compiler.is_compiling()
    ):
        return call
    block_mask = from_dense_auto(call.mask, call.shape)
    if block_mask is None or get("chunked").reasons_not_supported(call):
        return call
    return dataclasses.replace(call, mask=None, block_mask=block_mask)
