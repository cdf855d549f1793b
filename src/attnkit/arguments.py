"""Validation of constructor arguments: each helper names the argument and the value it got.

A bool is not accepted where an int is meant (``True`` is an int to Python, not a size), and a
float must be finite unless stated otherwise. Parts validate their own arguments before they
build sub-layers, so an error names the argument the caller wrote (``d_w``), not a sub-layer's
(``d_out``).

:func:`renamed` keeps the one spelling of sizes in public signatures (``embed_dim``,
``num_heads``, ``head_dim``, ``num_kv_heads``, ``max_len``): a call that still writes an older
keyword (``d_model=``, ``heads=``) raises TypeError naming the new one. :func:`deprecated_names`
is its gentler form for a release after a rename: the old keyword still works, with a
``DeprecationWarning`` naming the new one.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "boolean",
    "deprecated_names",
    "finite_float",
    "nonnegative_int",
    "optional_positive_int",
    "positive_int",
    "probability",
    "renamed",
    "sizes",
]

F = TypeVar("F", bound=Callable[..., Any])


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


def renamed(**old_to_new: str) -> Callable[[F], F]:
    """A decorator that refuses keywords spelt the old way, naming the new spelling.

    Put on a function, a method or a class (its ``__init__`` is wrapped). A call that passes an
    old keyword raises ``TypeError`` such as ``"TransformerEncoderLayer: `heads` is now
    `num_heads`"``; positional calls and the new keywords pass through untouched, and
    :func:`inspect.signature` still shows the wrapped signature.

    Args:
        **old_to_new: each old keyword mapped to the parameter that replaces it; the new name
            must be a parameter of the wrapped callable.

    Raises:
        TypeError: at decoration, if a new name is not a str, if an old name is still a
            parameter of the wrapped callable or a new one is not.

    Example:
        >>> @renamed(d_model="embed_dim")
        ... def width(embed_dim: int) -> int:
        ...     return embed_dim
        >>> width(embed_dim=8), width(8)
        (8, 8)
    """
    return _decorator(old_to_new, deprecated=False)


def deprecated_names(**old_to_new: str) -> Callable[[F], F]:
    """A decorator that still accepts keywords spelt the old way for one release, warning.

    The form of :func:`renamed` for the release after a rename: a call that passes an old
    keyword gets a ``DeprecationWarning`` such as ``"Performer: d= is renamed head_dim=; d= will
    be removed"`` and runs as if it had passed the new keyword. A call that gives the same
    argument both ways (the old keyword and the new one, or the old keyword and the new
    parameter's position) raises ``TypeError`` naming both. Positional calls and the new
    keywords pass through untouched, and :func:`inspect.signature` shows the wrapped signature
    (the new names only). Applied together with :func:`renamed`, or again on a subclass, the
    tables merge; a later decoration that refuses a name ends its deprecation.
    :meth:`attnkit.registry.Registry.build` accepts the old keywords too (with the warning).

    Args:
        **old_to_new: each old keyword mapped to the parameter that replaces it; the new name
            must be a parameter of the wrapped callable.

    Raises:
        TypeError: at decoration, as :func:`renamed`.

    Example:
        >>> import warnings
        >>> @deprecated_names(d="head_dim")
        ... def size(head_dim: int) -> int:
        ...     return head_dim
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     size(d=4), size(head_dim=4)
        (4, 4)
        >>> str(caught[0].message)
        'size: d= is renamed head_dim=; d= will be removed'
    """
    return _decorator(old_to_new, deprecated=True)


def _decorator(old_to_new: dict[str, str], *, deprecated: bool) -> Callable[[F], F]:
    for old, new in old_to_new.items():
        if not isinstance(new, str) or not new.isidentifier():
            raise TypeError(f"renamed: the new name for {old!r} must be an identifier, got {new!r}")

    def decorate(target: F) -> F:
        if isinstance(target, type):
            target.__init__ = _wrapped(target.__init__, old_to_new, deprecated)  # type: ignore[misc]
            return target
        return _wrapped(target, old_to_new, deprecated)  # type: ignore[return-value]

    return decorate


def _wrapped(
    fn: Callable[..., Any], old_to_new: dict[str, str], deprecated: bool
) -> Callable[..., Any]:
    """``fn`` wrapped so that a keyword in the refused table (``__renamed__``) raises TypeError
    and one in the deprecated table (``__deprecated_names__``) warns and is passed on under its
    new name; ``old_to_new`` joins the table ``deprecated`` says, and leaves the other."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for old, new in old_to_new.items():
        if old in params:
            raise TypeError(f"renamed: {fn.__qualname__} still takes {old!r}; rename it {new!r}")
        if new not in params and not takes_any:
            raise TypeError(f"renamed: {fn.__qualname__} has no parameter {new!r} (for {old!r})")
    refused = dict(getattr(fn, "__renamed__", {}))
    warned = dict(getattr(fn, "__deprecated_names__", {}))
    mine, other = (warned, refused) if deprecated else (refused, warned)
    mine.update(old_to_new)
    for old in old_to_new:
        other.pop(old, None)
    base = getattr(fn, "__renamed_wrapped__", fn)
    signature = inspect.signature(base)
    is_init = fn.__name__ == "__init__"

    @functools.wraps(base)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not (refused or warned) or not kwargs:
            return base(*args, **kwargs)
        who = type(args[0]).__name__ if is_init and args else base.__qualname__
        for key in kwargs:
            if key in refused:
                raise TypeError(f"{who}: `{key}` is now `{refused[key]}`")
        old_keys = [key for key in kwargs if key in warned]
        if old_keys:
            try:
                positional = signature.bind_partial(*args).arguments
            except TypeError:  # too many positional arguments: the call below says so
                positional = {}
            for old in old_keys:
                new = warned[old]
                if new in kwargs or new in positional:
                    raise TypeError(
                        f"{who}: got both `{old}` and `{new}`; `{old}` is renamed `{new}`, "
                        f"pass only `{new}`"
                    )
                warnings.warn(
                    f"{who}: {old}= is renamed {new}=; {old}= will be removed",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = kwargs.pop(old)
        return base(*args, **kwargs)

    wrapper.__renamed__ = refused  # type: ignore[attr-defined]
    wrapper.__deprecated_names__ = warned  # type: ignore[attr-defined]
    wrapper.__renamed_wrapped__ = base  # type: ignore[attr-defined]
    return wrapper
