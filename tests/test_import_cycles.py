"""attnkit's modules import each other without cycles: read statically from the source (an
``import attnkit…`` / ``from attnkit… import …`` statement), module by module."""

from __future__ import annotations

import ast
from pathlib import Path

import attnkit

ROOT = Path(attnkit.__file__).parent

# Cycles closed only by imports inside functions (deferred to call time) that are left as they
# are, each inside one package: the task registry and the user's tasks it loads on a lookup
# (attnkit.tasks), the runner's checkpoints, logs and failure records (attnkit.experiments).
# Any other cycle, deferred or not, fails the second test; one through both packages too.
DEFERRED_WITHIN = ("attnkit.tasks.", "attnkit.experiments.")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = ["attnkit", *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(tree: ast.Module, deferred: bool) -> list[ast.stmt]:
    """The import statements run when the module is imported (module level, inside if / try /
    with blocks), and with ``deferred`` those inside functions and classes too; never those
    under ``if TYPE_CHECKING`` (read by type checkers only)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if not _type_checking(node):
                todo += node.body + node.orelse
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if deferred:
                todo += node.body
        else:  # try, with, for, while, match: their statements, one level down
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    todo.append(child)
                elif isinstance(child, (ast.ExceptHandler, ast.match_case)):
                    todo += child.body
    return out


def import_graph(deferred: bool = False, modules: dict[str, Path] | None = None) -> dict:
    """module -> the attnkit modules it imports (the package root excluded: ``import attnkit
    as ak`` inside a function is the public API, not a dependency on one module)."""
    modules = _modules() if modules is None else modules

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in _statements(ast.parse(path.read_text(encoding="utf-8")), deferred):
            if isinstance(node, ast.Import):
                deps |= {resolve(a.name) for a in node.names if a.name.startswith("attnkit")}
                continue
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] != "attnkit":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                deps.add(full if full in modules else resolve(base))
        graph[name] = deps - {name, "attnkit", ""}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_at_module_level():
    assert cycles(import_graph()) == []


def test_no_deferred_import_cycle_but_the_known_ones():
    """Imports inside functions counted too: the cuts stay cut (core and the kernels'
    explanation, the compiled tiles and the additive tile, the diagnostics and the explanation
    suite, the run configuration and the tasks)."""
    found = cycles(import_graph(deferred=True))
    tolerated = [c for c in found if any(all(m.startswith(p) for m in c) for p in DEFERRED_WITHIN)]
    assert [sorted(c) for c in found if c not in tolerated] == []


def test_the_tasks_import_nothing_of_the_experiment_runner():
    """The runner reads the tasks, never the other way, also inside functions: what both need
    (the run configuration's keys, a task's report tables) lives on the tasks' side."""
    graph = import_graph(deferred=True)
    upward = sorted(
        (module, dep)
        for module, deps in graph.items()
        if module.startswith("attnkit.tasks")
        for dep in deps
        if dep.startswith("attnkit.experiments")
    )
    assert upward == []
    assert "attnkit.tasks.run_keys" in graph["attnkit.experiments.config"]


def test_the_walk_finds_a_cycle(tmp_path):
    """The walk sees a cycle through a relative import, one through a ``from attnkit…``, and
    one through an import under ``if``, and ignores one under ``if TYPE_CHECKING``."""
    pkg = tmp_path / "attnkit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from attnkit.sub import b\n")
    (pkg / "sub" / "b.py").write_text("import sys\nif sys:\n    from ..c import x\n")
    (pkg / "c.py").write_text("from attnkit import a\nx = 1\n")
    (pkg / "d.py").write_text("from . import e\n")
    (pkg / "e.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from attnkit import d\n"
        "def f():\n    from attnkit import d\n"
    )
    modules = _modules(pkg)
    assert cycles(import_graph(modules=modules)) == [
        frozenset({"attnkit.a", "attnkit.sub.b", "attnkit.c"})
    ]
    deferred = set(cycles(import_graph(deferred=True, modules=modules)))
    assert frozenset({"attnkit.d", "attnkit.e"}) in deferred
