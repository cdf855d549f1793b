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
import types
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.scores import Score

__all__ = ["compile_tile", "enabled", "fail", "failed", "pairwise", "set_enabled"]

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
    """``score.pairwise``, compiled when the score opts in and compilation is on.

    The additive and concat scores with tanh take the fused tile of
    :mod:`attnkit.kernels.additive_tile` (its own compiled backward and a rational tanh); the
    other tanh scores of the additive family (deep, multi-dimensional) are compiled with the
    rational tanh of :mod:`attnkit.kernels.fast_tanh` in place of ``torch.tanh``.
    """
    function = type(score).pairwise
    if (
        not score.compile_tile
        or not enabled()
        or function in _FAILED
        or torch.compiler.is_compiling()
    ):
        return score.pairwise
    from attnkit.kernels import additive_tile

    if additive_tile.applies(score):
        return additive_tile.tile(score)
    if _fast_tanh_applies(score):
        function = _fast_tanh_pairwise(type(score))
        if function in _FAILED:
            return score.pairwise
    compiled = _CACHE.get(function)
    if compiled is None:
        compiled = _CACHE[function] = compile_tile(function)

    def run(qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        try:
            return compiled(score, qp, kp, key_offset)
        except Exception as err:  # compilation unavailable (no compiler, unsupported op, ...)
            _fail(function, type(score).__name__, err)
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


def compile_tile(function: Callable) -> Callable:
    """``torch.compile(function)`` for a tile: shapes dynamic after the first recompilation,
    and, where inductor offers it, multiply-adds contracted into fused multiply-adds (one
    rounding instead of two: as exact or more, and faster)."""
    options = {}
    try:
        from torch._inductor import config as inductor_config

        if hasattr(inductor_config.cpp, "enable_floating_point_contract_flag"):
            options["cpp.enable_floating_point_contract_flag"] = "fast"
    except Exception:  # no inductor here: the first call fails and the tile stays eager
        pass
    return torch.compile(function, dynamic=None, options=options or None)


def failed(function: Callable) -> bool:
    """Whether compiling ``function`` has failed in this process (it then runs eagerly)."""
    return function in _FAILED


def fail(function: Callable, name: str, err: Exception) -> None:
    """Record that compiling ``function`` (of the ``name`` tile) failed; warn once."""
    _fail(function, name, err)


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
