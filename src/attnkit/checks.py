"""Validation at the public boundary: clear ValueError/TypeError naming arguments and shapes."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import masks
from attnkit.alignments import REGISTRY as ALIGNMENTS
from attnkit.alignments import Alignment
from attnkit.inputs import broadcast_shapes, broadcasts_to, part_matches, same_kind, tensor
from attnkit.scores import REGISTRY as SCORES
from attnkit.scores import Score
from attnkit.scores.base import check_heads

__all__ = [
    "boolean_mask",
    "distributions",
    "feature_mask",
    "features",
    "floating",
    "nonnegative",
    "optional_score",
    "part_matches",
    "resolve_alignment",
    "resolve_score",
    "same_batch",
    "same_shape",
    "scores_shape",
    "tensor",
    "validate",
    "without_padding",
]


def _resolve(part, registry, base, what: str, device=None, dtype=None):
    if isinstance(part, base):
        return part
    if isinstance(part, str):
        # device=/dtype= reach a part built by name: through its constructor where it takes
        # them, else by moving what it was built with.
        given = {"device": device, "dtype": dtype}
        factory = {k: v for k, v in given.items() if v is not None}
        accepted = registry.accepts(part) if factory else set()
        try:
            built = registry.build(part, **{k: v for k, v in factory.items() if k in accepted})
        except TypeError as err:
            raise TypeError(
                f"{what} {part!r} has parameters and cannot be built from its name alone; "
                f"construct it, e.g. attnkit.{what}s.build({part!r}, ...) ({err})"
            ) from None
        return built.to(**factory) if factory else built
    raise TypeError(
        f"{what} must be a registered name or an attnkit {base.__name__} module, "
        f"got {type(part).__name__}"
    )


def resolve_score(score: str | Score, *, device=None, dtype=None) -> Score:
    """A Score module from a registered name (parameter-free scores only), built on
    ``device``/``dtype`` when given, or a module (returned as it is)."""
    return _resolve(score, SCORES, Score, "score", device, dtype)


def resolve_alignment(align: str | Alignment, *, device=None, dtype=None) -> Alignment:
    """An Alignment module from a registered name (ones that can be built from the name alone),
    built on ``device``/``dtype`` when given, or a module (returned as it is)."""
    return _resolve(align, ALIGNMENTS, Alignment, "alignment", device, dtype)


def scores_shape(q: Tensor | None, k: Tensor) -> torch.Size:
    """(B, …, M, N) from q (…, M, d_q) and k (…, N, d_k); M = 1 without a query."""
    m = 1 if q is None else q.shape[-2]
    lead = k.shape[:-2] if q is None else broadcast_shapes(q.shape[:-2], k.shape[:-2])
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
    check_parts: bool = True,
) -> torch.Size:
    """Validate an attention call; returns the scores' (B, …, M, N) shape.

    ``check_parts=False`` leaves out the walk over the score's and the alignment's parameters
    (their dtype and device against the inputs'), which a layer that checked its own parameters
    at its entry has already done.

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
    if check_parts:
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
        broadcast_shapes(k.shape[:-2], v.shape[:-2])
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


def floating(x: object, name: str, layout: str = "(…, N)", *, min_dim: int = 1) -> Tensor:
    """``x`` if it is a floating tensor with at least ``min_dim`` dims; ``layout`` names the
    expected shape in the message (e.g. "(…, N)")."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor {layout}, got dtype {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")
    return x


def same_shape(*named: tuple[str, Tensor]) -> None:
    """Raise unless the given tensors have one shape (no broadcasting)."""
    first_name, first = named[0]
    for name, x in named[1:]:
        if x.shape != first.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {first_name} has {tuple(first.shape)}; "
                "they must have one shape"
            )


def boolean_mask(
    mask: object, name: str, shape: tuple[int, ...], *, meaning: str = "True = may attend"
) -> Tensor:
    """``mask`` if it is a boolean tensor broadcastable to exactly ``shape``. A float or integer
    tensor is refused rather than read as a mask: 0.5 is not a truth value."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a boolean torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        hint = "; additive float biases are not masks" if meaning == "True = may attend" else ""
        raise TypeError(
            f"{name} must be boolean ({meaning}), got dtype {mask.dtype}; convert a 0/1 "
            f"tensor with {name}.bool(){hint}"
        )
    if not broadcasts_to(tuple(mask.shape), tuple(shape)):
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}"
        )
    return mask


def nonnegative(x: Tensor, name: str, what: str = "attention weights") -> Tensor:
    """``x`` if no entry is negative or NaN (a value check over the whole tensor: for
    evaluation functions, not for hot paths)."""
    bad = ~(x >= 0)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must be non-negative ({what}), got {float(x[idx])} at index {idx}"
        )
    return x


def distributions(x: Tensor, name: str) -> Tensor:
    """``x`` (…, N) if each row is a probability distribution over the last dim: non-negative,
    summing to 1 (or to 0: an empty row, e.g. a query with no key allowed). The tolerance on the
    sum follows the dtype (1e-3, or 4 ε for half precision)."""
    nonnegative(x, name, "probabilities")
    sums = x.sum(-1, dtype=torch.float64)
    tol = max(1e-3, 4 * torch.finfo(x.dtype).eps)
    bad = ((sums - 1).abs() > tol) & (sums.abs() > tol)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} must hold probability distributions over its last dim (rows summing to "
            f"1, or 0 for an empty row), but row {idx} sums to {float(sums[idx]):.6g}"
        )
    return x
