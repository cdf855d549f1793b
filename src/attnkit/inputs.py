"""Checks on input tensors and on parts that every public entry point shares (scores,
alignments, mechanisms, :mod:`attnkit.checks`). Imports only :mod:`attnkit.masks` from attnkit,
so any part may use it."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from attnkit import masks

__all__ = [
    "alignment_inputs",
    "broadcast_shapes",
    "broadcasts_to",
    "part_matches",
    "same_kind",
    "score_mod",
    "tensor",
]


def tensor(x: object, name: str, *, min_dim: int = 2) -> Tensor:
    """Check that ``x`` is a floating tensor with at least ``min_dim`` dims; return it."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(
            f"{name} must have at least {min_dim} dims (…, length, features), got shape "
            f"{tuple(x.shape)}"
        )
    return x


def part_matches(
    part: nn.Module, what: str, name: str, x: Tensor, *, check_dtype: bool = True
) -> None:
    """Raise unless every floating parameter and buffer of ``part`` has the dtype and device of
    the input ``x`` (named ``name``): a part on "meta" would return uninitialised numbers, and
    a float64 part with float32 inputs would be a raw matmul error deep inside."""
    for pname, p in (*part.named_parameters(), *part.named_buffers()):
        if not p.is_floating_point():
            continue
        if p.device != x.device:
            raise ValueError(
                f"the {what} ({type(part).__name__}) has {pname} on {p.device} but {name} is on "
                f"{x.device}; move one of them (e.g. {what}.to({str(x.device)!r}))"
            )
        if check_dtype and p.dtype != x.dtype:
            raise TypeError(
                f"the {what} ({type(part).__name__}) has {pname} of dtype {p.dtype} but {name} "
                f"has {x.dtype}; convert one of them (e.g. {what}.to({x.dtype}))"
            )


def broadcast_shapes(*shapes: tuple[int, ...]) -> torch.Size:
    """``torch.broadcast_shapes`` for concrete shapes, in plain Python (torch's goes through its
    symbolic-shape machinery: about 0.3 ms a call, which a decoding step pays many times).
    Raises RuntimeError when the shapes do not broadcast, as torch's does."""
    out: list[int] = []
    for shape in shapes:
        shape = tuple(shape)
        if len(shape) > len(out):
            out[:0] = [1] * (len(shape) - len(out))
        for i, size in enumerate(shape, len(out) - len(shape)):
            if size != out[i]:
                if out[i] == 1:
                    out[i] = size
                elif size != 1:
                    raise RuntimeError(f"shapes {shapes} do not broadcast")
    return torch.Size(out)


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to exactly ``target`` (never beyond it)."""
    try:
        return tuple(broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


def same_kind(*named: tuple[str, Tensor | None]) -> None:
    """Raise unless the given tensors share one dtype and one device."""
    present = [(n, x) for n, x in named if x is not None]
    for name, x in present[1:]:
        first_name, first = present[0]
        if x.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {x.dtype} but {first_name} has {first.dtype}; "
                "convert them to one dtype"
            )
        if x.device != first.device:
            raise ValueError(
                f"{name} is on {x.device} but {first_name} is on {first.device}; "
                "move them to one device"
            )


def alignment_inputs(part: nn.Module, scores: object, mask: object) -> Tensor:
    """Check an alignment's scores (…, M, N) and mask (boolean, broadcastable to the scores,
    on their device) and the device of the alignment's parameters; return the scores. (Their
    dtype may differ: kernels align half-precision scores in float32.)"""
    scores = tensor(scores, "scores")
    masks.check(mask, scores.shape)  # type: ignore[arg-type]
    if mask is not None and mask.device != scores.device:  # type: ignore[union-attr]
        raise ValueError(f"mask is on {mask.device} but the scores are on {scores.device}")  # type: ignore[union-attr]
    part_matches(part, "alignment", "the scores", scores, check_dtype=False)
    return scores


def score_mod(fn: object) -> None:
    """Raise unless ``fn`` can be a score_mod: a callable taking the five arguments
    ``(score, b, h, q_idx, kv_idx)`` (FlexAttention's signature), so that a wrong arity is
    named here rather than by Python deep inside a kernel."""
    if not callable(fn):
        raise TypeError(f"score_mod must be callable, got {type(fn).__name__}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: its arity cannot be read, the call will tell
    try:
        signature.bind(*range(5))
    except TypeError:
        raise TypeError(
            f"score_mod must take five arguments (score, b, h, q_idx, kv_idx), as "
            f"FlexAttention's; got {getattr(fn, '__name__', type(fn).__name__)}{signature}"
        ) from None
