"""Loud registries: named parts that fail clearly on unknown names or arguments (DESIGN 2)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

__all__ = ["Registry", "deprecated_keywords", "under_new_names"]

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> class table for one kind of part (scores, alignments, ...).

    ``build(name, **kw)`` binds ``kw`` against the class signature first, so a misspelt or missing
    argument raises ``TypeError`` naming it, and an unknown name raises ``ValueError`` listing the
    options and the closest match; a keyword that the class still accepts under its old name
    (:func:`attnkit.arguments.deprecated_names`) is bound under its new one, and the class
    warns. ``renamed`` maps a name that a part was registered under before to its name now:
    asking for the old one raises ``ValueError`` naming the new one.
    """

    # Every registry made, so that a sandbox (a documentation example, a test) can put all of
    # them back as they were.
    instances: ClassVar[weakref.WeakSet[Registry]] = weakref.WeakSet()

    def __init__(self, kind: str, *, packages: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self._table: dict[str, type[T]] = {}
        self.renamed: dict[str, str] = {}
        # packages whose modules register parts here, imported on the first look-up (lazy
        # subpackages), so that get() before available() finds every part
        self.packages = packages
        self._loaded = not packages
        Registry.instances.add(self)

    def load(self) -> None:
        """Import :attr:`packages` once (their modules register their parts)."""
        if self._loaded:
            return
        self._loaded = True  # first: a package that looks a part up while importing
        for package in self.packages:
            importlib.import_module(package)

    def snapshot(self) -> dict[str, type[T]]:
        """A copy of the name table, for :meth:`restore`."""
        return dict(self._table)

    def restore(self, table: dict[str, type[T]]) -> None:
        """Put the name table back as a :meth:`snapshot` took it."""
        self._table = dict(table)

    def register(self, name: str, *, override: bool = False) -> Callable[[type[T]], type[T]]:
        """A class decorator that registers the class under ``name``.

        Registering the same definition again is allowed and silent: the same class object, or
        a class with the same ``__module__`` and ``__qualname__`` (a notebook cell or a module
        executed again), which then replaces the older one. A different class under a name
        that is taken raises ``ValueError``, unless ``override=True`` asks to replace it.
        """

        def decorate(cls: type[T]) -> type[T]:
            old = self._table.get(name)
            if old is not None and not override and not _same_definition(old, cls):
                raise ValueError(
                    f"{self.kind} {name!r} is already registered (by "
                    f"{old.__module__}.{old.__qualname__}); register a different name, or "
                    "pass override=True to replace it"
                )
            self._table[name] = cls
            cls.registered_name = name  # type: ignore[attr-defined]
            return cls

        return decorate

    def available(self) -> list[str]:
        self.load()
        return sorted(self._table)

    def get(self, name: str) -> type[T]:
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} name must be a str, got {type(name).__name__}")
        if name not in self._table:
            self.load()
        try:
            return self._table[name]
        except KeyError:
            if name in self.renamed:
                raise ValueError(
                    f"{self.kind} {name!r} is now {self.renamed[name]!r}; use the new name"
                ) from None
            close = difflib.get_close_matches(name, self.available(), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ValueError(
                f"unknown {self.kind} {name!r}{hint} Available: {', '.join(self.available())}"
            ) from None

    def build(self, name: str, **kwargs: Any) -> T:
        cls = self.get(name)
        signature = inspect.signature(cls)
        params = signature.parameters
        moved = getattr(getattr(cls, "__init__", None), "__renamed__", {})
        # old keywords still accepted for a release (arguments.deprecated_names): bound under
        # their new names here, passed as given so that the class warns
        bound = under_new_names(cls, kwargs, f"{self.kind} {name!r}")
        deprecated = deprecated_keywords(cls)
        for key in kwargs:
            if key in moved and key not in params:
                raise TypeError(f"{self.kind} {name!r}: `{key}` is now `{moved[key]}`")
            if key not in params and key not in deprecated:
                close = difflib.get_close_matches(key, params, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise TypeError(
                    f"{self.kind} {name!r} got an unexpected argument {key!r}{hint}; "
                    f"it takes: {', '.join(params)}"
                )
        try:
            signature.bind(**bound)
        except TypeError as err:
            raise TypeError(f"{self.kind} {name!r}: {err}") from None
        return cls(**kwargs)

    def accepts(self, name: str) -> set[str]:
        """Names of the keyword arguments that ``name``'s constructor takes."""
        return set(inspect.signature(self.get(name)).parameters)


def deprecated_keywords(cls: type) -> dict[str, str]:
    """The keywords that ``cls``'s constructor still accepts under an old name for a release
    (:func:`attnkit.arguments.deprecated_names`), old name -> new name; empty when none."""
    return dict(getattr(getattr(cls, "__init__", None), "__deprecated_names__", {}))


def under_new_names(cls: type, kwargs: dict[str, Any], who: str) -> dict[str, Any]:
    """``kwargs`` with each keyword that ``cls``'s constructor still accepts under an old name
    (:func:`deprecated_keywords`) keyed by its new name, the one translation of old keywords
    that :meth:`Registry.build` and :func:`attnkit.sizing.build` (``for_heads``) share.

    Raises:
        TypeError: naming ``who`` when a keyword is given under its old and its new name.
    """
    deprecated = deprecated_keywords(cls)
    params = inspect.signature(cls).parameters
    bound = dict(kwargs)
    for key in kwargs:
        if key in deprecated and key not in params:
            new = deprecated[key]
            if new in kwargs:
                raise TypeError(
                    f"{who}: got both `{key}` and `{new}`; `{key}` is renamed `{new}`, pass "
                    f"only `{new}`"
                )
            bound[new] = bound.pop(key)
    return bound


def _same_definition(old: type, new: type) -> bool:
    """Whether ``new`` is ``old`` or the same definition executed again (same module and
    qualified name)."""
    return old is new or (old.__module__ == new.__module__ and old.__qualname__ == new.__qualname__)
