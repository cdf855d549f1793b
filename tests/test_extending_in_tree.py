"""A per-head part written from docs/extending.md and placed *inside* attnkit, as the page says a
contributor does (the module in its package, one import line in the package's ``__init__.py``),
passes every suite that parametrises over the registered mechanisms and per-head parts.

tests/test_extending.py imports the user's module after those suites have chosen their cases, so
it cannot see what an in-tree part meets. Here a copy of the package gets the page's
``sigmoid_part.py`` in ``attnkit/modern/``; the per-head contract (tests/test_head.py), the
mechanism contract (tests/mechanisms/) and the slot properties (tests/test_slot_properties.py)
then run in a fresh interpreter on that copy, selecting the new part's cases.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attnkit

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(attnkit.__file__).resolve().parent
DOC = REPO / "docs" / "extending.md"
FILE_BLOCK = re.compile(r"^```(python3?)\n# (\w+\.py)\n(.*?)^```", re.S | re.M)
SUITES = ("test_head.py", "mechanisms", "test_slot_properties.py", "conftest.py")


def test_the_documented_part_placed_in_tree_passes_the_registry_wide_suites(tmp_path):
    files = {name: f"# {name}\n{body}" for _, name, body in FILE_BLOCK.findall(DOC.read_text())}
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "attnkit", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "attnkit" / "modern" / "sigmoid_part.py").write_text(files["sigmoid_part.py"])
    init = src / "attnkit" / "modern" / "__init__.py"
    init.write_text(init.read_text() + "\nfrom attnkit.modern import sigmoid_part  # noqa\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in SUITES:
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
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "sigmoid_attention",
         *(f"tests/{n}" for n in SUITES if n != "conftest.py")],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert "failed" not in summary and "error" not in summary, summary
    # the part's cases of every suite ran: the per-head contract, the mechanism contract
    # (output family, truncation, padding, gradients, dtypes, taxonomy, capture) and the slots
    assert passed >= 25, summary
