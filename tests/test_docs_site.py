"""The documentation site: `mkdocs build --strict` over docs/ and the docstrings, the API page of
``attnkit.attention`` as built and as a browser renders it, and no resource from the network."""

from __future__ import annotations

import html
import importlib.util
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import attnkit

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"
ENTRY_ID = "attnkit.core.attention"

_MISSING = [
    m
    for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python")
    if not (importlib.util.find_spec(m.split(".")[0]) and importlib.util.find_spec(m))
]
needs_mkdocs = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"documentation tools not installed ({', '.join(_MISSING)}); "
    "`pip install -e .[docs]` or `make test` installs them",
)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = _build(CONFIG, out)
    assert result.returncode == 0, (
        f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    )
    return out


def _text(fragment: str) -> str:
    """Visible text of an HTML fragment, whitespace collapsed."""
    fragment = re.sub(r"<(script|style)\b.*?</\1>", " ", fragment, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", fragment)).split())


def _entry(page: str, entry_id: str) -> str:
    """The HTML of one mkdocstrings entry: from its heading to the next object at any level."""
    start = page.find(f'id="{entry_id}"')
    assert start >= 0, f"no element with id {entry_id!r} in the page"
    end = page.find('<div class="doc doc-object ', start)
    return page[start : end if end >= 0 else len(page)]


def _expected_signature_parts() -> list[str]:
    """`name: annotation = default` for each parameter, as the source declares them."""
    parts = []
    for p in inspect.signature(attnkit.attention).parameters.values():
        part = f"{p.name}: {p.annotation}"
        if p.default is not inspect.Parameter.empty:
            default = json.dumps(p.default) if isinstance(p.default, str) else repr(p.default)
            part += f" = {default}"
        parts.append(part)
    return parts


def _docstring_excerpts() -> list[str]:
    """The summary line and the first few words of each argument's description."""
    doc = inspect.getdoc(attnkit.attention)
    excerpts = [doc.splitlines()[0]]
    args = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
    for _name, description in re.findall(r"^    (\w+): (.*)$", args, flags=re.M):
        words = []
        for word in description.split():  # plain words only: markup renders differently
            if not re.fullmatch(r"[\w(),;.…-]+", word):
                break
            words.append(word)
        if words:
            excerpts.append(" ".join(words[:6]))
    assert len(excerpts) > 5, "the docstring's Args section was not found"
    return excerpts


def _check_attention_entry(page: str) -> None:
    entry = _text(_entry(page, ENTRY_ID))
    assert "attention(" in entry
    for part in _expected_signature_parts():
        assert part in entry, f"signature part {part!r} missing from the rendered entry"
    ret = inspect.signature(attnkit.attention).return_annotation
    assert f") -> {ret}" in entry
    for excerpt in _docstring_excerpts():
        assert excerpt in entry, f"docstring text {excerpt!r} missing from the rendered entry"
    # The docstring's reStructuredText roles are rendered as names, each documented one a link.
    roles = re.findall(r":(\w+):`([^`]+)`", inspect.getdoc(attnkit.attention))
    assert roles, "the docstring names no object with a role"
    html_entry = _entry(page, ENTRY_ID)
    for role, name in roles:
        assert f":{role}:" not in entry
        assert f"<code>{name}</code>" in html_entry, name
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="[^"]*#attnkit\.', html_entry)


@needs_mkdocs
def test_every_guide_and_api_page_is_built(site):
    for md in (ROOT / "docs").rglob("*.md"):
        built = site / md.relative_to(ROOT / "docs").with_suffix(".html")
        assert built.is_file(), f"{md.name} was not built"
    # Each class and function a public subpackage exports has its entry, under the name of the
    # module that defines it or of the subpackage that exports it.
    for module in ("masks", "scores", "alignments", "kernels", "positions", "patterns"):
        page = (site / "api" / f"{module}.html").read_text(encoding="utf-8")
        package = getattr(attnkit, module)
        for name in package.__all__:
            obj = getattr(package, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            ids = {f'id="attnkit.{module}.{name}"', f'id="{obj.__module__}.{obj.__qualname__}"'}
            assert any(i in page for i in ids), f"{module}.{name} not documented"


@needs_mkdocs
def test_api_page_of_attention_has_its_signature_and_docstring(site):
    _check_attention_entry((site / "api" / "attnkit.html").read_text(encoding="utf-8"))


@needs_mkdocs
def test_pages_load_nothing_from_the_network(site):
    remote = re.compile(r"<(script|link|img|iframe)\b[^>]*\b(src|href)=[\"']?(https?:)?//", re.I)
    css_remote = re.compile(r"url\(\s*[\"']?(https?:)?//|@import\s+[\"']?(url\()?\s*[\"']?https?:")
    for page in site.rglob("*.html"):
        hit = remote.search(page.read_text(encoding="utf-8"))
        assert hit is None, f"{page.name} loads {hit.group(0)!r}"
    for css in site.rglob("*.css"):
        hit = css_remote.search(css.read_text(encoding="utf-8", errors="replace"))
        assert hit is None, f"{css.name} loads {hit.group(0)!r}"


@needs_mkdocs
def test_strict_build_fails_on_broken_links_and_bad_references(tmp_path):
    # The site's own configuration on a few small pages, each with one defect: the build must
    # fail and name every defect.
    docs = tmp_path / "docs"
    docs.mkdir()
    config = tmp_path / "mkdocs.yml"
    source = CONFIG.read_text(encoding="utf-8").split("\nnav:", 1)[0]
    src = tmp_path / "src"
    (src / "tinypkg").mkdir(parents=True)
    (src / "tinypkg" / "__init__.py").write_text(
        '"""A package."""\n\n\ndef f():\n    """Calls :func:`no_such_helper`."""\n'
    )
    source = source.replace(
        "paths: [src]", f"paths: [{json.dumps(str(ROOT / 'src'))}, {json.dumps(str(src))}]"
    )
    extension = "docs/griffe_roles.py"
    config.write_text(source.replace(extension, str(ROOT / extension)))
    (docs / "index.md").write_text("# Home\n\n[fine](other.md#other)\n")
    (docs / "other.md").write_text("# Other\n\n[gone](missing_page.md)\n")
    (docs / "anchor.md").write_text("# Anchor\n\n[gone](other.md#no-such-heading)\n")
    (docs / "ref.md").write_text("# Ref\n\n[gone][attnkit.core.no_such_function]\n")
    (docs / "role.md").write_text("::: tinypkg\n")
    result = _build(config, tmp_path / "site")
    log = result.stdout + result.stderr
    assert result.returncode != 0, log
    for name in (
        "missing_page.md",
        "no-such-heading",
        "attnkit.core.no_such_function",
        ":func:`no_such_helper`",
    ):
        assert name in log, f"the broken {name!r} was not reported:\n{log}"
    assert "fine" not in log

    # An API entry for an object that does not exist stops the build.
    for page in ("other.md", "anchor.md", "ref.md", "role.md"):
        (docs / page).unlink()
    (docs / "api.md").write_text("# API\n\n::: attnkit.core.no_such_object\n")
    result = _build(config, tmp_path / "site2")
    log = result.stdout + result.stderr
    assert result.returncode != 0, log
    assert "attnkit.core.no_such_object" in log, log


@needs_mkdocs
@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install chromium)")
def test_browser_renders_the_attention_entry(site, tmp_path):
    page = site / "api" / "attnkit.html"
    result = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    _check_attention_entry(dom)
    # The theme's own scripts (served from the site, not a CDN) ran: they mark every table.
    tables = re.findall(r"<table\b[^>]*>", dom)
    assert tables and all("docutils" in t for t in tables), tables[:3]
