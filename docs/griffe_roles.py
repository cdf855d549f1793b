"""Griffe extension for the documentation site: the docstrings' cross-reference roles.

The docstrings name other objects with reStructuredText roles (``:func:`attnkit.attention```,
``:class:`Score```). Markdown does not know them, so this extension, run once the package is
loaded, resolves each named object the way Python would (a full dotted path, or a name in the
scope of the documented object or of one of its parents), else as the one object of the
package with that name, and replaces the role with an optional cross-reference: a link where
the object has an entry in the API reference, plain code where it has none. A role that names
nothing in the package (a misspelt or renamed object) is reported as a warning, which fails
``mkdocs build --strict``; a dotted name in another library is left as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(func|class|mod|data|meth|attr|obj|exc|const):`(~?)([^`]+)`")

logger = griffe.get_logger("griffe_roles")


def _lookup(obj: griffe.Object, name: str) -> griffe.Object | griffe.Alias | None:
    collection = obj.modules_collection
    if name.split(".", 1)[0] in collection.members:
        try:
            return collection[name]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            return None
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            return scope[name]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            scope = scope.parent
    return None


def _target_path(found: griffe.Object | griffe.Alias) -> str:
    try:
        return found.final_target.path if found.is_alias else found.path
    except (griffe.AliasResolutionError, griffe.CyclicAliasError):
        return found.path


def _objects(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _objects(member)


class RstRoles(griffe.Extension):
    """Turn ``:role:`name``` into cross-references and report names that resolve to nothing."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        by_name: dict[str, list[str]] = {}
        for obj in _objects(pkg):
            by_name.setdefault(obj.name, []).append(obj.path)
        for obj in _objects(pkg):
            if obj.docstring is None or ":`" not in obj.docstring.value:
                continue
            obj.docstring.value = ROLE.sub(
                lambda m, obj=obj: _replace(obj, m, by_name), obj.docstring.value
            )


def _replace(obj: griffe.Object, match: re.Match, by_name: dict[str, list[str]]) -> str:
    _role, short, written = match.groups()
    name = "".join(written.split()).removesuffix("()")
    title = name.rsplit(".", 1)[-1] if short else name
    found = _lookup(obj, name)
    collection = obj.modules_collection
    if found is None and "." in name and name.split(".", 1)[0] not in collection.members:
        return f"`{title}`"  # another library's object (torch.nn.Linear, ...)
    if found is None and len(by_name.get(name, ())) == 1:
        found = collection[by_name[name][0]]  # the one object of the package so named
    if found is None:
        line = obj.docstring.lineno if obj.docstring else obj.lineno
        logger.warning(
            f"{obj.relative_filepath}:{line}: {match.group(0)!r} in the docstring of "
            f"{obj.path} names no object of the package"
        )
        return f"`{title}`"
    return f'<autoref identifier="{_target_path(found)}" optional>`{title}`</autoref>'
