"""Compiled tiles for the chunked kernel: ``torch.compile`` (inductor) of a score's ``pairwise``.

An eager additive tile, wᵀ tanh(W₁q + W₂k), materialises the (M_b, N_b, d_w) pre-activation, its
tanh, and the product, each a separate pass through memory; inductor fuses them into one loop.
A score opts in with ``compile_tile = True`` (the additive family does). The compiled function
is the class's ``pairwise``, shared by every instance of that class (the module is an argument,
its parameters graph inputs); shapes that vary (a ragged last block) are compiled as dynamic after
the first recompilation. The first call of each class and shape class pays the compilation
(seconds). When compilation is unavailable or fails, the kernel warns once and stays eager:
never a wrong answer.

Switch it off with ``ATTNKIT_COMPILE_TILES=0`` in the environment or :func:`set_enabled`
(:mod:`attnkit.kernels.compilation`).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.kernels import additive_tile
from attnkit.kernels.compilation import compile_tile, enabled, fail, failed, set_enabled
from attnkit.scores import Score

__all__ = ["compile_tile", "enabled", "fail", "failed", "pairwise", "set_enabled"]

_CACHE: dict[Callable, Callable] = {}


def pairwise(score: Score) -> Callable[[Tensor | None, Tensor, int], Tensor]:
    """``score.pairwise``, compiled when the score opts in and compilation is on.

    The additive and concat scores with tanh take the fused tile of
    :mod:`attnkit.kernels.additive_tile` (its own compiled backward and a rational tanh); the
    other tanh scores of the additive family (deep, multi-dimensional) are compiled with the
    rational tanh of :mod:`attnkit.kernels.fast_tanh` in place of ``torch.tanh``.
    """
    function = type(score).pairwise
    if not score.compile_tile or not enabled() or failed(function) or torch.compiler.is_compiling():
        return score.pairwise
    if additive_tile.applies(score):
        return additive_tile.tile(score)
    if _fast_tanh_applies(score):
        function = _fast_tanh_pairwise(type(score))
        if failed(function):
            return score.pairwise
    compiled = _CACHE.get(function)
    if compiled is None:
        compiled = _CACHE[function] = compile_tile(function)

    def run(qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        try:
            return compiled(score, qp, kp, key_offset)
        except Exception as err:  # compilation unavailable (no compiler, unsupported op, ...)
            _CACHE.pop(function, None)
            fail(function, type(score).__name__, err)
            return score.pairwise(qp, kp, key_offset)

    return run


def _fast_tanh_applies(score: Score) -> bool:
    from attnkit.scores.additive import Additive

    return (
        isinstance(score, Additive)
        and type(score).pairwise is Additive.pairwise
        and score.act is torch.tanh
    )


# score class -> its own copy of _with_fast_tanh (dynamo's cache and its recompilation limit are
# per code object: one per class, as for the classes' own pairwise).
_FAST: dict[type, Callable] = {}


def _fast_tanh_pairwise(cls: type) -> Callable:
    function = _FAST.get(cls)
    if function is None:
        code = _with_fast_tanh.__code__.replace(co_name=f"{cls.__name__}_pairwise_fast_tanh")
        function = _FAST[cls] = types.FunctionType(code, _with_fast_tanh.__globals__)
    return function


def _with_fast_tanh(score: Score, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
    """An additive-family tile with the rational tanh (float32, bfloat16; float64 keeps
    ``torch.tanh``), differentiated as tanh."""
    from attnkit.kernels import fast_tanh

    return score.pairwise_with(qp, kp, fast_tanh.tanh_autograd)
