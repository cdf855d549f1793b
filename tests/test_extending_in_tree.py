"""A per-head part written from docs/extending.md and placed *inside* attnkit, as the page says a
contributor does (the module in its package, one import line in the package's ``__init__.py``),
registers in the per-head registry and passes every suite that parametrises over registered
parts; a deliberately broken copy of it fails the per-head contract.

tests/test_extending.py imports the user's module after those suites have chosen their cases, so
it cannot see what an in-tree part meets. Here a copy of the package gets the page's
``sigmoid_part.py`` in ``attnkit/modern/``; the per-head contract (tests/test_head_contract.py),
the mechanism suites (tests/mechanisms/, which still list per-head names through the mechanism
registry) and the slot properties (tests/test_slot_properties.py) then run in a fresh
interpreter on that copy, selecting the new part's cases.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from test_extending import broken_part

import attnkit

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(attnkit.__file__).resolve().parent
DOC = REPO / "docs" / "extending.md"
FILE_BLOCK = re.compile(r"^```(python3?)\n# (\w+\.py)\n(.*?)^```", re.S | re.M)
SUITES = ("test_head_contract.py", "mechanisms", "test_slot_properties.py", "conftest.py")


def _part_text() -> str:
    files = {name: f"# {name}\n{body}" for _, name, body in FILE_BLOCK.findall(DOC.read_text())}
    return files["sigmoid_part.py"]


def _run_in_tree(tmp_path: Path, part_text: str, suites: tuple[str, ...]):
    """pytest over ``suites`` (selecting the part's cases) in a copy of the package holding
    ``part_text`` as ``attnkit/modern/sigmoid_part.py``; the finished process and its last
    summary line."""
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "attnkit", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "attnkit" / "modern" / "sigmoid_part.py").write_text(part_text)
    init = src / "attnkit" / "modern" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom attnkit.modern import sigmoid_part  # noqa\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in (*suites, "conftest.py"):
        origin = REPO / "tests" / name
        if origin.is_dir():
            shutil.copytree(origin, tests / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(origin, tests / name)

    env = {**os.environ, "PYTHONPATH": str(src)}
    where = subprocess.run(
        [sys.executable, "-c", "import attnkit; print(attnkit.__file__)"],
        env=env, capture_output=True, text=True, check=True, cwd=tmp_path,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(src), "the copy, not the installed package"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
         "-k", "sigmoid_attention", *(f"tests/{n}" for n in suites if n != "conftest.py")],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr
    return run, summary


def test_the_documented_part_placed_in_tree_passes_the_registry_wide_suites(tmp_path):
    run, summary = _run_in_tree(tmp_path, _part_text(), SUITES)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "failed" not in summary and "error" not in summary, summary
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    # the part's cases of every suite ran: the per-head contract (shapes with d_v ≠ d_k,
    # truncation, NaN padding, empty rows, B = 0, refusals, mask forms, bias, cache), the
    # mechanism suites that list it by name, and the slots
    ran = [line for line in run.stdout.splitlines() if line.startswith("PASSED tests/")]
    contract = [line for line in ran if line.startswith("PASSED tests/test_head_contract.py")]
    assert len(contract) >= 12, run.stdout[-4000:]
    assert {line.split("::")[0] for line in ran} > {"PASSED tests/test_head_contract.py"}, ran
    assert passed >= 20, summary


def test_a_broken_copy_placed_in_tree_fails_the_per_head_contract(tmp_path):
    """The same part with its mask not applied fails the contract it is placed under."""
    run, summary = _run_in_tree(tmp_path, broken_part(_part_text()), ("test_head_contract.py",))
    assert run.returncode == 1, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\d+ failed", summary), summary
    assert "test_declared_mask_forms_are_honoured_and_others_refused[sigmoid_attention]" in (
        run.stdout
    ), run.stdout[-4000:]
