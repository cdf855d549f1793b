"""Every ```python block in README.md and docs/ (any depth) runs as written.

Each block must be self-contained (its own imports and inputs): it runs on its own, in a fresh
namespace, compiled under the document's path with the document's line numbers, so a failure
names ``README.md:112`` (the block's first code line) and the traceback points into the
document. Blocks run in this process, so they must be sized to finish in about a second; state
the cost of a big size in the prose next to the block instead of running it. Shell and plain
blocks are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from attnkit.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON_TAGS = {"python", "py"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root, as a reader names it
    line: int  # 1-based line of the first code line (the line after the opening fence)
    lang: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def extract_blocks(text: str, path: str) -> list[Block]:
    """All fenced blocks of a markdown text, any language. An unclosed fence is an error: it
    would silently turn the rest of the document into code (or hide a block from the test)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i + 1
        j = start
        closing = re.compile(rf"^\s*{fence[0]}{{{len(fence)},}}\s*$")
        while j < len(lines) and not closing.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: code fence {fence!r} is never closed")
        body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[start:j]]
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def python_blocks() -> list[Block]:
    found = []
    for doc in DOCUMENTS:
        rel = doc.relative_to(ROOT).as_posix()
        found += [
            b for b in extract_blocks(doc.read_text(encoding="utf-8"), rel) if b.lang in PYTHON_TAGS
        ]
    return found


def run_block(block: Block) -> None:
    """Execute one block in a fresh namespace. Line numbers in tracebacks are the document's."""
    source = "\n" * (block.line - 1) + block.code
    compiled = compile(source, block.path, "exec")
    namespace = {"__name__": "__doc_block__"}
    threads = torch.get_num_threads()
    # Blocks that show how to register a part must not leave it registered for later tests.
    # Each registry's packages are imported first: a block that looks a name up imports them
    # (registering their parts), and a snapshot taken before would drop those parts for good.
    for registry in list(Registry.instances):
        registry.load()
    tables = [(r, r.snapshot()) for r in list(Registry.instances)]
    # The block must not leave global state behind for the tests that run after it.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        try:
            exec(compiled, namespace)
        except Exception as err:
            raise AssertionError(
                f"the python block at {block.name} raised {type(err).__name__}: {err}"
            ) from err
        finally:
            torch.set_num_threads(threads)
            for registry, table in tables:
                registry.restore(table)


BLOCKS = python_blocks()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_block_runs(block: Block) -> None:
    run_block(block)


def test_documents_have_python_blocks() -> None:
    # Guards against the extraction silently finding nothing (which would make the test above
    # collect zero cases and pass).
    names = {b.path for b in BLOCKS}
    assert "README.md" in names
    assert "docs/kernels.md" in names


def test_extraction_and_failure_report() -> None:
    text = (
        "intro\n\n"
        "```python\nx = 1\n```\n\n"  # lines 3-5
        "```bash\nattnkit run\n```\n\n"  # lines 7-9
        "  ```py\n  y = 1 / 0\n  ```\n"  # lines 11-13, indented (as in a list item)
    )
    blocks = extract_blocks(text, "doc.md")
    assert [(b.line, b.lang, b.code) for b in blocks] == [
        (4, "python", "x = 1\n"),
        (8, "bash", "attnkit run\n"),
        (12, "py", "y = 1 / 0\n"),
    ]
    run_block(blocks[0])
    with pytest.raises(AssertionError, match=r"doc\.md:12 raised ZeroDivisionError") as info:
        run_block(blocks[2])
    # The traceback points at the document's own line.
    tb = info.value.__cause__.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert (tb.tb_frame.f_code.co_filename, tb.tb_lineno) == ("doc.md", 12)


def test_unclosed_fence_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"doc\.md:3: code fence"):
        extract_blocks("a\n\n```python\nx = 1\n", "doc.md")
