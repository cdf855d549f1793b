"""The five examples of docs/extending.md ("One file plus its test": a score, a per-head part, a
task, a kernel and a position scheme) placed *inside* attnkit, as the page tells a contributor
(the module in its package, one import line in the package's ``__init__.py``, its test under
``tests/`` importing it from there), pass every suite that goes over the registered parts of
their kind, and their own tests; a deliberately broken copy of each fails the suite that checks
what it broke.

tests/test_extending.py imports the user's modules after those suites have chosen their cases, so
it cannot see what an in-tree part meets. Here a copy of the package gets the page's modules, and
pytest runs, in a fresh interpreter on that copy, the registry-wide suites selecting the new
parts' cases (``-k``): the score in the score × alignment contract, the stress and chunked
kernels' suites, the sizes and multi-head attention; the per-head part in the per-head contract,
the mechanism suites and the slot properties; the task in the task contract; the kernel in the
kernel sweep (every registered kernel forced and compared with the dense reference) and the
kernel registry's tests (whole file); the position scheme in the position slot's contract
(whole file: its declarations checked against what it computes).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from test_extending import broken_part, files_in_the_docs

import attnkit

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(attnkit.__file__).resolve().parent


def _replace_once(old: str, new: str) -> Callable[[str], str]:
    def broken(text: str) -> str:
        assert text.count(old) == 1, f"{old!r} is not in the example once"
        return text.replace(old, new)

    return broken


@dataclass(frozen=True)
class Example:
    """One of the page's modules: where it goes, what selects its cases, the suites over its
    kind, a broken copy of it and the test that must fail on that copy."""

    module: str  # the file's stem
    package: str  # its package in attnkit (and its test's folder under tests/)
    name: str  # its registered name: its cases' ids hold it
    suites: tuple[str, ...]  # files and folders under tests/ that go over its kind, by name
    whole: tuple[str, ...]  # test files under tests/ run whole (they loop over the registry)
    broken: Callable[[str], str]  # the module's text -> the deliberately broken text
    catches: str  # a test id (part of a FAILED line) the broken copy fails

    @property
    def test_file(self) -> str:
        return f"tests/{self.package}/test_{self.module}.py"

    @property
    def selects(self) -> str:
        """The -k expression selecting its cases, its own test and the files run whole."""
        whole = [f"({Path(w).parent} and {Path(w).name})" for w in self.whole]
        return " or ".join([self.name, self.module, *whole])


EXAMPLES = (
    Example(
        "manhattan",
        "scores",
        "manhattan",
        (
            "test_core.py",
            "kernels/test_stress.py",
            "kernels/test_chunked.py",
            "test_sizing.py",
            "test_multihead.py",
        ),
        (),
        # the wrong sign: the contract suites cannot know which way a score points, its own
        # test, written from the paper's e_l = −‖q − k_l‖₁, does
        _replace_once(
            "return -(qp.unsqueeze(-2) - kp.unsqueeze(-3))",
            "return (qp.unsqueeze(-2) - kp.unsqueeze(-3))",
        ),
        "tests/scores/test_manhattan.py::test_weights_are_a_softmax_of_minus_the_l1_distance",
    ),
    Example(
        "sigmoid_part",
        "modern",
        "sigmoid_attention",
        ("test_head_contract.py", "mechanisms", "test_slot_properties.py"),
        (),
        broken_part,  # its mask not applied
        "tests/test_head_contract.py::test_declared_mask_forms_are_honoured_and_others_refused"
        "[sigmoid_attention]",
    ),
    Example(
        "marker_task",
        "tasks",
        "marker",
        ("tasks/test_base.py",),
        (),
        # a wrong target: the marker sits on the key after the one the loss and the accuracy
        # ask for
        _replace_once(
            "self.x[torch.arange(n), self.y, 0]", "self.x[torch.arange(n), (self.y + 1) % 6, 0]"
        ),
        "tests/tasks/test_marker_task.py::test_a_quick_run_learns_to_find_the_marker",
    ),
    Example(
        "dense64_kernel",
        "kernels",
        "dense64",
        ("kernels/test_sweep.py",),
        ("kernels/test_base.py",),
        _replace_once(".transpose(-1, -2) * scale", ".transpose(-1, -2)"),  # the scale dropped
        "tests/kernels/test_sweep.py::test_every_kernel_path_equals_the_dense_reference_or_refuses"
        "_by_name[dense64]",
    ),
    Example(
        "nearby_position",
        "positions",
        "nearby",
        ("positions/test_base.py",),
        ("positions/test_base.py",),
        # bias_at (what ring attention evaluates tile by tile) disagrees with forward
        _replace_once(
            "(q_idx - kv_idx).abs().to(e.dtype) / 4", "(q_idx - kv_idx).abs().to(e.dtype) / 2"
        ),
        "tests/positions/test_base.py::test_per_token_and_bias_of_positions_agree_with_the_scheme"
        "_itself[nearby]",
    ),
)


def _in_tree_test(example: Example, text: str) -> str:
    """The example's test as it sits under tests/: importing the module from its package."""
    stem, package = example.module, f"attnkit.{example.package}"
    text, plain = re.subn(rf"^import {stem}\b", f"from {package} import {stem}", text, flags=re.M)
    text, named = re.subn(
        rf"^from {stem} import", f"from {package}.{stem} import", text, flags=re.M
    )
    assert plain + named == 1, f"test_{stem}.py imports {stem} once"
    return text


def _place(root: Path, broken: bool) -> None:
    """A copy of attnkit under ``root/src`` with every example in its package (broken copies if
    ``broken``), the test suite with every example's test under ``root/tests``, and the
    project's pytest settings."""
    files = {name: text for name, (_, text) in files_in_the_docs().items()}
    shutil.copytree(PACKAGE, root / "src" / "attnkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    for example in EXAMPLES:
        text = files[f"{example.module}.py"]
        package = root / "src" / "attnkit" / example.package
        (package / f"{example.module}.py").write_text(example.broken(text) if broken else text)
        init = package / "__init__.py"
        line = f"from attnkit.{example.package} import {example.module}  # noqa: F401\n"
        init.write_text(init.read_text() + "\n" + line)
        test = root / example.test_file
        test.parent.mkdir(exist_ok=True)
        test.write_text(_in_tree_test(example, files[f"test_{example.module}.py"]))


def _run_in_tree(root: Path, broken: bool = False) -> subprocess.CompletedProcess[str]:
    """pytest, in a fresh interpreter on the copy, over every example's suites and its own test,
    selecting the examples' cases."""
    _place(root, broken)
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    where = subprocess.run(
        [sys.executable, "-c", "import attnkit; print(attnkit.__file__)"],
        env=env, capture_output=True, text=True, check=True, cwd=root,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(root / "src"), "the copy, not attnkit"
    suites = {f"tests/{s}" for e in EXAMPLES for s in (*e.suites, *e.whole)}
    paths = sorted(suites | {e.test_file for e in EXAMPLES})
    selects = " or ".join(f"({e.selects})" for e in EXAMPLES)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-k", selects,
         *paths],
        env=env, capture_output=True, text=True, cwd=root,
    )  # fmt: skip


def _lines(run: subprocess.CompletedProcess[str], outcome: str) -> list[str]:
    return [line for line in run.stdout.splitlines() if line.startswith(f"{outcome} tests/")]


def _tail(run: subprocess.CompletedProcess[str]) -> str:
    return run.stdout[-6000:] + run.stderr[-2000:]


def test_the_documented_examples_placed_in_tree_pass_the_registry_wide_suites(tmp_path):
    run = _run_in_tree(tmp_path)
    assert run.returncode == 0, _tail(run)
    passed = _lines(run, "PASSED")
    assert not _lines(run, "FAILED") and not _lines(run, "ERROR"), _tail(run)
    for example in EXAMPLES:
        # its own test, and its cases in every suite over its kind
        assert any(line.startswith(f"PASSED {example.test_file}::") for line in passed), example
        for suite in example.suites:
            ran = [line for line in passed if line.startswith(f"PASSED tests/{suite}")]
            assert any(example.name in line for line in ran), (example.module, suite, _tail(run))
        for suite in example.whole:
            assert any(line.startswith(f"PASSED tests/{suite}::") for line in passed), suite
    # the per-head contract's checks (shapes with d_v ≠ d_k, truncation, NaN padding, empty
    # rows, B = 0, refusals, mask forms, bias, cache), the score × alignment contract, the
    # kernel sweep and the position slot's declarations all ran on the new parts
    count = {
        suite: sum(line.startswith(f"PASSED tests/{suite}") for line in passed)
        for suite in ("test_head_contract.py", "test_core.py", "positions/test_base.py")
    }
    assert count["test_head_contract.py"] >= 12 and count["test_core.py"] >= 20, count
    assert count["positions/test_base.py"] >= 5, count


def test_a_broken_copy_of_each_example_placed_in_tree_fails_its_suite(tmp_path):
    """Each broken copy fails the test that checks what it broke (not an import or collection
    error), and every failure is one of the broken parts' cases."""
    run = _run_in_tree(tmp_path, broken=True)
    assert run.returncode == 1, _tail(run)
    failed = _lines(run, "FAILED")
    assert not _lines(run, "ERROR"), _tail(run)
    for example in EXAMPLES:
        assert any(example.catches in line for line in failed), (example.module, _tail(run))
    names = [e.name for e in EXAMPLES] + [e.module for e in EXAMPLES]
    assert all(any(name in line for name in names) for line in failed), failed
