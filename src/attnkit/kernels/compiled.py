"""Compiled tiles for the chunked kernel: ``torch.compile`` (inductor) of a score's ``pairwise``.

An eager additive tile, wᵀ tanh(W₁q + W₂k), materialises the (M_b, N_b, d_w) pre-activation, its
tanh, and the product, each a separate pass through memory; inductor fuses them into one loop.
A score opts in with ``compile_tile = True`` (the additive family does). The compiled function
is the class's ``pairwise``, shared by every instance of that class (the module is an argument,
its parameters graph inputs); shapes that vary (a ragged last block) are compiled as dynamic after
the first recompilation. The first call of each class and shape class pays the compilation
(seconds). When compilation is unavailable or fails, the kernel warns once and stays eager:
never a wrong answer.

Switch it off with ``ATTNKIT_COMPILE_TILES=0`` in the environment or :func:`set_enabled`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.scores import Score

__all__ = ["enabled", "pairwise", "set_enabled"]

_SWITCH: bool | None = None
_CACHE: dict[Callable, Callable] = {}
_FAILED: set[Callable] = set()
_WARNED = False


def set_enabled(value: bool | None) -> None:
    """Compile tiles (True), never (False), or follow ``ATTNKIT_COMPILE_TILES`` (None, the
    default: on unless the variable is ``0``)."""
    global _SWITCH
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"set_enabled takes True, False or None, got {value!r}")
    _SWITCH = value


def enabled() -> bool:
    if _SWITCH is not None:
        return _SWITCH
    return os.environ.get("ATTNKIT_COMPILE_TILES", "1") != "0"


def pairwise(score: Score) -> Callable[[Tensor | None, Tensor, int], Tensor]:
    """``score.pairwise``, compiled when the score opts in and compilation is on."""
    function = type(score).pairwise
    if (
        not score.compile_tile
        or not enabled()
        or function in _FAILED
        or torch.compiler.is_compiling()
    ):
        return score.pairwise
    compiled = _CACHE.get(function)
    if compiled is None:
        compiled = _CACHE[function] = torch.compile(function, dynamic=None)

    def run(qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        try:
            return compiled(score, qp, kp, key_offset)
        except Exception as err:  # compilation unavailable (no compiler, unsupported op, ...)
            _fail(function, type(score).__name__, err)
            return score.pairwise(qp, kp, key_offset)

    return run


def _fail(function: Callable, name: str, err: Exception) -> None:
    global _WARNED
    _FAILED.add(function)
    _CACHE.pop(function, None)
    if not _WARNED:
        _WARNED = True
        warnings.warn(
            f"attnkit: compiling the {name} tile failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); evaluating it eagerly",
            RuntimeWarning,
            stacklevel=3,
        )
