"""Validation of constructor arguments: each helper names the argument and the value it got.

A bool is not accepted where an int is meant (``True`` is an int to Python, not a size), and a
float must be finite unless stated otherwise. Parts validate their own arguments before they
build sub-layers, so an error names the argument the caller wrote (``d_w``), not a sub-layer's
(``d_out``).
"""

from __future__ import annotations

import math

__all__ = [
    "boolean",
    "finite_float",
    "nonnegative_int",
    "optional_positive_int",
    "positive_int",
    "probability",
    "sizes",
]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 1."""
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value  # type: ignore[return-value]


def optional_positive_int(value: object, name: str) -> int | None:
    """``value`` if it is None or an int >= 1."""
    if value is None:
        return None
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value  # type: ignore[return-value]


def nonnegative_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 0."""
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value  # type: ignore[return-value]


def boolean(value: object, name: str) -> bool:
    """``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def finite_float(
    value: object, name: str, *, positive: bool = False, nonnegative: bool = False
) -> float:
    """``value`` as a float if it is a finite real number (and > 0 / >= 0 when asked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and not x > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if nonnegative and not x >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return x


def probability(value: object, name: str = "dropout") -> float:
    """``value`` as a float if it lies in [0, 1) (a dropout probability)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1), got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return float(value)


def sizes(**named: object) -> None:
    """Check that every keyword value is a positive int (feature sizes, counts)."""
    for name, value in named.items():
        positive_int(value, name)
