"""How a registered part is built at given sizes: the one place that says it (DESIGN 8).

Scores, alignments and position schemes derive from :class:`Sized`, which gives them

- ``for_heads(head_dim, num_heads=None, *, embed_dim=None, max_len=None, **overrides)``: the
  part for ``num_heads`` heads of ``head_dim`` features each (``num_heads=None``: one head
  without a head dim, as :class:`attnkit.Attention` uses it), over at most ``max_len`` keys.
  A class declares which constructor argument takes which size as data,
  ``size_arguments = {"d_q": "head_dim", "num_heads": "num_heads", ...}``; ``overrides`` are
  constructor arguments that replace or add to those (``d_w=16``, ``device=``, ``dtype=``).
  A part with no size arguments needs nothing; a class whose constructor needs more than sizes
  overrides ``for_heads``.
- ``example(**sizes)``: a small instance at the example sizes (:data:`EXAMPLE`: head_dim 4,
  max_len 16, value size 3, no head dim), any of which ``sizes`` replaces; tests, docs and
  benchmarks take their instances from it.
- ``examples(**sizes)``: the example under the key ``""`` and named variants (a query-free or
  multi-dimensional form, a learned temperature) under their labels; a contract suite that walks
  a registry covers every variant as ``name[label]``.

``attnkit run`` (:mod:`attnkit.tasks.parts`), :class:`attnkit.MultiHeadAttention` and the
benchmarks build parts by name through ``for_heads``: a part registered in one file needs no
other edit to be usable there.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from torch import nn

from attnkit import arguments
from attnkit.registry import deprecated_keywords, under_new_names

__all__ = ["EXAMPLE", "SIZE_NAMES", "Sized", "Sizes", "build", "example_sizes"]

# The sizes a part can be built from (DESIGN 8's names).
SIZE_NAMES: tuple[str, ...] = ("embed_dim", "num_heads", "head_dim", "max_len")


@dataclass(frozen=True)
class Sizes:
    """The sizes of a model that a part is built for.

    Args:
        head_dim: d, the features of each head's queries and keys.
        num_heads: H, or None for a single head without a head dim.
        embed_dim: E, the model width (E = H·d in multi-head attention).
        max_len: the most keys (positions) an input has, for parts with a table per position.
        value_dim: the values' features, for examples only (a multi-dimensional score's
            d_out must equal it); ``for_heads`` does not take it.
    """

    head_dim: int | None = None
    num_heads: int | None = None
    embed_dim: int | None = None
    max_len: int | None = None
    value_dim: int | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            arguments.optional_positive_int(getattr(self, field.name), field.name)

    def for_heads(self) -> dict[str, int | None]:
        """The keyword arguments of ``for_heads``."""
        return {name: getattr(self, name) for name in SIZE_NAMES}


# The sizes of every part's example: q and k of 4 features, values of 3, at most 16 keys.
EXAMPLE = Sizes(head_dim=4, max_len=16, value_dim=3)


def example_sizes(default: Sizes = EXAMPLE, **given: int | None) -> Sizes:
    """``default`` with the sizes in ``given`` replaced; an unknown size raises TypeError."""
    fields = {f.name for f in dataclasses.fields(Sizes)}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise TypeError(
            f"unknown size {unknown[0]!r} for an example; the sizes are: "
            f"{', '.join(sorted(fields))}"
        )
    return dataclasses.replace(default, **given)


def _name(cls: type) -> str:
    """The registered name of ``cls`` itself (not one inherited from a registered parent)."""
    return cls.__dict__.get("registered_name", cls.__name__)


def _parameters(cls: type) -> tuple[dict[str, inspect.Parameter], bool]:
    """The constructor's named parameters and whether it takes any keyword (``**kwargs``).
    A module without a constructor of its own (``nn.Module.__init__``) takes nothing."""
    if cls.__init__ is nn.Module.__init__:  # type: ignore[misc]
        return {}, False
    params = inspect.signature(cls).parameters
    named = {key: p for key, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return named, any(p.kind == p.VAR_KEYWORD for p in params.values())


def build(cls: type, sizes: Sizes, overrides: Mapping[str, Any]) -> Any:
    """``cls(**arguments)``: each constructor argument in ``cls.size_arguments`` gets its size
    (a size that is None is left out, so the argument keeps its default), then ``overrides``
    replace or add arguments; an override under a name the constructor still accepts for a
    release (:func:`attnkit.arguments.deprecated_names`, e.g. ``d=`` for ``head_dim=``) is
    taken under its new name, with a ``DeprecationWarning``, as ``Registry.build`` takes it.
    ``device``/``dtype`` given to a class whose constructor does not take them move the built
    module instead (a part without parameters has nothing to place).

    Raises TypeError naming the part for an argument the constructor does not take, or a
    required one that neither a size nor ``overrides`` gives.
    """
    what = f"{getattr(cls, 'part_kind', 'part')} {_name(cls)!r}"
    table: Mapping[str, str] = getattr(cls, "size_arguments", {})
    given = {param: getattr(sizes, size) for param, size in table.items()}
    args = {param: value for param, value in given.items() if value is not None}
    params, any_keyword = _parameters(cls)
    # an override under a name the constructor still accepts for a release (d= for head_dim=)
    # is translated as Registry.build translates it, so that it replaces the size given under
    # the new name instead of clashing with it; the class is called with the new name
    translated = under_new_names(cls, dict(overrides), what)
    for old in set(overrides) - set(translated):
        new = deprecated_keywords(cls)[old]
        warnings.warn(
            f"{cls.__name__}: {old}= is renamed {new}=; {old}= will be removed",
            DeprecationWarning,
            stacklevel=3,
        )
    args.update(translated)
    moves = {}
    for key in ("device", "dtype"):
        if key in args and key not in params and not any_keyword:
            value = args.pop(key)
            if value is not None:
                moves[key] = value
    unexpected = [key for key in args if key not in params]
    if unexpected and not any_keyword:
        raise TypeError(
            f"{what} got an unexpected argument {unexpected[0]!r}; it takes: "
            f"{', '.join(params) or 'no arguments'}"
        )
    for key, p in params.items():
        if p.default is not p.empty or key in args:
            continue
        if key in table:
            raise TypeError(
                f"{what} needs {table[key]} (its argument {key!r}), which was not given: "
                f"pass {table[key]}= to for_heads"
            )
        raise TypeError(
            f"{what} needs the argument {key!r}, which no size gives: pass {key}=... to "
            "for_heads, or give the class size_arguments or a for_heads that makes it"
        )
    part = cls(**args)
    return part.to(**moves) if moves else part


class Sized:
    """Mixin of the registered part bases (score, alignment, position scheme): ``for_heads``,
    ``example`` and ``examples`` as the module docstring describes.

    Class data:

    - ``part_kind``: what the part is, for messages ("score", "alignment", ...).
    - ``size_arguments``: constructor argument -> size name (one of :data:`SIZE_NAMES`).
    - ``example_sizes``: the sizes ``example`` starts from.
    """

    part_kind: ClassVar[str] = "part"
    size_arguments: ClassVar[Mapping[str, str]] = {}
    example_sizes: ClassVar[Sizes] = EXAMPLE

    @classmethod
    def for_heads(
        cls,
        head_dim: int,
        num_heads: int | None = None,
        *,
        embed_dim: int | None = None,
        max_len: int | None = None,
        **overrides: Any,
    ) -> Self:
        """This part for ``num_heads`` heads of ``head_dim`` features each (None: no head
        dim), inputs of at most ``max_len`` keys, in a model of width ``embed_dim``; every
        size the part takes is given explicitly. ``overrides`` are constructor arguments that
        replace or add to what the sizes give (e.g. ``device=``, ``dtype=``)."""
        arguments.positive_int(head_dim, "head_dim")
        sizes = Sizes(head_dim=head_dim, num_heads=num_heads, embed_dim=embed_dim, max_len=max_len)
        return build(cls, sizes, overrides)

    @classmethod
    def example(cls, **sizes: int | None) -> Self:
        """A small instance: ``for_heads`` at :attr:`example_sizes`, any of which ``sizes``
        replaces (e.g. ``max_len=40`` for longer inputs)."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads())

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Self]:
        """The example under ``""`` and named variants under their labels (none here)."""
        return {"": cls.example(**sizes)}
