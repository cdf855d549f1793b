"""Kernels as registered parts: what a kernel is, the call it is asked to evaluate, the registry.

A kernel evaluates one validated attention call (:class:`Call`). It states what it supports as
data: :meth:`Kernel.reasons_not_supported` lists why it cannot evaluate a call (empty when it
can), and :meth:`Kernel.prefers` says whether automatic selection should take it for a call it
supports. :func:`select` picks by priority, or runs the kernel the caller forces and, when that
kernel cannot run the call, raises with its reasons.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = [
    "Call",
    "Kernel",
    "available",
    "get",
    "guarded_sum",
    "register",
    "select",
]


@dataclass(frozen=True)
class Call:
    """One validated attention call: q (B, …, M, d_q) or None, k (B, …, N, d_k),
    v (B, …, N, d_v), the score and alignment modules, mask/bias broadcastable to
    ``shape`` = (B, …, M, N), and optionally a sparse pattern's block mask and a score_mod."""

    q: Tensor | None
    k: Tensor
    v: Tensor
    score: Score
    align: Alignment
    shape: torch.Size
    mask: Tensor | None = None
    bias: Tensor | None = None
    need_weights: bool = False
    chunk_size: int | None = None
    dropout: float = 0.0
    block_mask: BlockMask | None = None
    score_mod: ScoreMod | None = None

    def parts(self) -> tuple[Tensor | None, Tensor, Tensor, Score, Alignment]:
        """(q, k, v, score, align), the positional arguments of the functional kernels."""
        return self.q, self.k, self.v, self.score, self.align


class Kernel:
    """How attention is evaluated. Subclasses set ``name`` and ``priority`` (higher is tried
    first by automatic selection) and implement the three methods."""

    name: ClassVar[str]
    priority: ClassVar[int]

    def reasons_not_supported(self, call: Call) -> list[str]:
        """Why this kernel cannot evaluate ``call`` exactly; empty when it can."""
        raise NotImplementedError

    def prefers(self, call: Call) -> bool:
        """Whether automatic selection should take this kernel for a supported ``call``."""
        return True

    def attend(self, call: Call) -> AttentionOutput:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kernel {self.name!r}>"


_KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Add a kernel instance under its ``name``; a name registered twice is an error."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"register takes a Kernel instance, got {type(kernel).__name__}")
    if kernel.name in _KERNELS:
        raise ValueError(f"kernel {kernel.name!r} is already registered ({_KERNELS[kernel.name]})")
    _KERNELS[kernel.name] = kernel
    return kernel


def available() -> list[str]:
    """Registered kernel names, highest priority first."""
    return [k.name for k in sorted(_KERNELS.values(), key=lambda k: -k.priority)]


def get(name: str) -> Kernel:
    """The kernel registered as ``name``; unknown names fail with the options and a hint."""
    if not isinstance(name, str):
        raise TypeError(f"kernel must be a registered name (str) or None, got {name!r}")
    if name not in _KERNELS:
        close = difflib.get_close_matches(name, _KERNELS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown kernel {name!r}{hint} Available: {', '.join(available())}")
    return _KERNELS[name]


def select(call: Call, kernel: str | None = None) -> Kernel:
    """The kernel that evaluates ``call``: ``kernel`` when given (or ``"chunked"`` when the call
    sets ``chunk_size``), else the highest-priority kernel that supports and prefers it."""
    if kernel is None and call.chunk_size is not None:
        kernel = "chunked"
    if kernel is not None:
        chosen = get(kernel)
        reasons = chosen.reasons_not_supported(call)
        if reasons:
            raise ValueError(f"kernel {kernel!r} cannot evaluate this call: " + "; ".join(reasons))
        return chosen
    for name in available():
        candidate = _KERNELS[name]
        if not candidate.reasons_not_supported(call) and candidate.prefers(call):
            return candidate
    raise ValueError("no registered kernel can evaluate this call")  # dense supports every call


def guarded_sum(combine: Callable[[Tensor, Tensor], Tensor], p: Tensor, v: Tensor) -> Tensor:
    """``combine(p, v)`` (Σ_l p_l v_l) in which a value with weight 0 has no influence even when it
    is NaN or infinite (a masked padding position); rows that give a non-finite value positive
    weight still get the non-finite result, as the plain sum would."""
    finite = torch.isfinite(v)
    zero = torch.zeros((), dtype=v.dtype)
    out = combine(p, torch.where(finite, v, zero))
    hit = combine((p != 0).to(p.dtype), (~finite).to(p.dtype))
    return out + torch.where(hit > 0, combine(p.detach(), v.detach()), zero)
