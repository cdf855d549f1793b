"""Validation at the public boundary: clear ValueError/TypeError naming arguments and shapes."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import masks
from attnkit.alignments import REGISTRY as ALIGNMENTS
from attnkit.alignments import Alignment
from attnkit.inputs import broadcasts_to, part_matches, same_kind, tensor
from attnkit.scores import REGISTRY as SCORES
from attnkit.scores import Score
from attnkit.scores.base import check_heads

__all__ = [
    "feature_mask",
    "features",
    "optional_score",
    "part_matches",
    "resolve_alignment",
    "resolve_score",
    "same_batch",
    "scores_shape",
    "tensor",
    "validate",
    "without_padding",
]


def _resolve(part, registry, base, what: str):
    if isinstance(part, base):
        return part
    if isinstance(part, str):
        try:
            return registry.build(part)
        except TypeError as err:
            raise TypeError(
                f"{what} {part!r} has parameters and cannot be built from its name alone; "
                f"construct it, e.g. attnkit.{what}s.build({part!r}, ...) ({err})"
            ) from None
    raise TypeError(
        f"{what} must be a registered name or an attnkit {base.__name__} module, "
        f"got {type(part).__name__}"
    )


def resolve_score(score: str | Score) -> Score:
    """A Score module from a registered name (parameter-free scores only) or a module."""
    return _resolve(score, SCORES, Score, "score")


def resolve_alignment(align: str | Alignment) -> Alignment:
    """An Alignment module from a registered name (parameter-free ones only) or a module."""
    return _resolve(align, ALIGNMENTS, Alignment, "alignment")


def scores_shape(q: Tensor | None, k: Tensor) -> torch.Size:
    """(B, …, M, N) from q (…, M, d_q) and k (…, N, d_k); M = 1 without a query."""
    m = 1 if q is None else q.shape[-2]
    lead = k.shape[:-2] if q is None else torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    return torch.Size((*lead, m, k.shape[-2]))


def validate(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    score: Score,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    align: Alignment | None = None,
) -> torch.Size:
    """Validate an attention call; returns the scores' (B, …, M, N) shape.

    Inputs, the bias and the parts' parameters must share one dtype and one device: a float64
    bias with float32 inputs is refused (one rule on every kernel) rather than cast.
    """
    named = [] if q is None else [("q", tensor(q, "q"))]
    k = tensor(k, "k")
    v = tensor(v, "v")
    named += [("k", k), ("v", v)]
    if q is None and not score.query_free:
        raise ValueError(
            f"q is None but the {type(score).__name__} score needs a query; only "
            "query-free (self-attentive) scores accept q=None"
        )
    first_name, first = named[0]
    same_kind(*named)
    for name, x in named:
        if x.shape[-1] == 0:
            raise ValueError(
                f"{name} has no features (size 0 in the last dim, shape {tuple(x.shape)})"
            )
    check_heads(score, q, k)
    part_matches(score, "score", first_name, first)
    if align is not None:
        part_matches(align, "alignment", first_name, first)
    if k.shape[-2] == 0:
        raise ValueError(f"k has no keys (N = 0, shape {tuple(k.shape)}); attention needs N >= 1")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"v has {v.shape[-2]} values (shape {tuple(v.shape)}) but k has {k.shape[-2]} keys "
            f"(shape {tuple(k.shape)}); they must match"
        )
    try:
        shape = scores_shape(q, k)
        torch.broadcast_shapes(k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        qs = "None" if q is None else tuple(q.shape)
        raise ValueError(
            f"batch dims of q {qs}, k {tuple(k.shape)} and v {tuple(v.shape)} do not broadcast"
        ) from None
    if score.multi_dimensional and score.d_out != v.shape[-1]:
        raise ValueError(
            f"the multi-dimensional score gives d_out = {score.d_out} scores per key but v has "
            f"d_v = {v.shape[-1]} features (shape {tuple(v.shape)}); they must match (eq. 30)"
        )
    masks.check(mask, shape)
    if mask is not None and mask.device != k.device:
        raise ValueError(f"mask is on {mask.device} but k is on {k.device}")
    if bias is not None:
        bias = tensor(bias, "bias", min_dim=0)
        if not broadcasts_to(bias.shape, shape):
            raise ValueError(
                f"bias of shape {tuple(bias.shape)} does not broadcast to the scores' shape "
                f"{tuple(shape)} (B, …, M, N)"
            )
        if bias.device != k.device:
            raise ValueError(f"bias is on {bias.device} but k is on {k.device}")
        if bias.dtype != first.dtype:
            raise TypeError(
                f"bias has dtype {bias.dtype} but {first_name} has {first.dtype}; pass the bias "
                f"in the inputs' dtype (bias.to({first.dtype}))"
            )
    return shape


def features(
    x: object, name: str, d: int | None = None, *, what: str = "d", rank: int = 3
) -> Tensor:
    """Check a feature tensor of a mechanism: floating, exactly ``rank`` dims ((B, n, d) by
    default), and ``d`` features when given (``what`` names the constructor argument)."""
    x = tensor(x, name, min_dim=1)
    if x.dim() != rank:
        layout = {2: "(B, d)", 3: "(B, n, d)", 4: "(B, S, W, d)"}.get(rank, f"{rank} dims")
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")
    if d is not None and x.shape[-1] != d:
        raise ValueError(
            f"{name} has {x.shape[-1]} features (shape {tuple(x.shape)}) but the module was "
            f"built for {what} = {d}"
        )
    return x


def same_batch(*named: tuple[str, Tensor | None]) -> None:
    """Check that the given inputs share batch size (dim 0), dtype and device."""
    present = [(n, x) for n, x in named if x is not None]
    if not present:
        return
    first_name, first = present[0]
    for name, x in present[1:]:
        if x.shape[0] != first.shape[0]:
            raise ValueError(
                f"{name} has batch size {x.shape[0]} (shape {tuple(x.shape)}) but {first_name} "
                f"has {first.shape[0]} (shape {tuple(first.shape)})"
            )
        if x.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but {first_name} has {first.dtype}; "
                "convert them to one dtype"
            )
        if x.device != first.device:
            raise ValueError(f"{name} is on {x.device} but {first_name} is on {first.device}")


def feature_mask(mask: object, x: Tensor, name: str, x_name: str) -> Tensor | None:
    """A padding mask over the n features of ``x`` (B, …, n, d), as (B, …, n).

    Accepts (B, …, n) or (B, …, 1, n), the shape :func:`attnkit.masks.from_lengths` returns;
    anything else raises, so a mask never broadcasts across the batch.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be boolean (True = a real feature), got dtype {mask.dtype}")
    rows = tuple(x.shape[:-1])
    if tuple(mask.shape) == rows:
        out = mask
    elif tuple(mask.shape) == (*rows[:-1], 1, rows[-1]):
        out = mask.squeeze(-2)
    else:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not fit {x_name} of shape "
            f"{tuple(x.shape)}: expected {rows} or {(*rows[:-1], 1, rows[-1])} "
            "(as attnkit.masks.from_lengths gives)"
        )
    if mask.device != x.device:
        raise ValueError(f"{name} is on {mask.device} but {x_name} is on {x.device}")
    return out


def without_padding(x: Tensor, mask: Tensor | None) -> Tensor:
    """``x`` (B, …, n, d) with its padded rows (``mask`` (B, …, n) False) set to 0, so that a
    padded feature's content — even NaN or inf — influences nothing (0·NaN would be NaN)."""
    if mask is None:
        return x
    return torch.where(mask.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def optional_score(score: object, name: str) -> Score | None:
    """``score`` if it is None or a :class:`attnkit.scores.Score` module (a mechanism's
    replaceable score part); a TypeError naming the argument otherwise."""
    if score is None or isinstance(score, Score):
        return score
    raise TypeError(f"{name} must be an attnkit Score module or None, got {type(score).__name__}")
