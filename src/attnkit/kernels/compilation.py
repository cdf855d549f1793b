"""Whether the chunked kernel's tiles are compiled, how a tile is compiled, and which tiles
failed to compile in this process (they then run eagerly, with one warning per process).

Switch compilation off with ``ATTNKIT_COMPILE_TILES=0`` in the environment or
:func:`set_enabled`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

__all__ = ["compile_tile", "enabled", "fail", "failed", "set_enabled"]

_SWITCH: bool | None = None
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
    global _WARNED
    _FAILED.add(function)
    if not _WARNED:
        _WARNED = True
        warnings.warn(
            f"attnkit: compiling the {name} tile failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); evaluating it eagerly",
            RuntimeWarning,
            stacklevel=3,
        )
