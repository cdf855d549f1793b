"""The documentation site: `mkdocs build --strict` over docs/ and the docstrings, the API page of
``attnkit.attention`` as built and as a browser renders it, an API page for every public
subpackage, every guide in the index and the navigation, equations rendered and tables that fit
(in a browser), and no resource from the network."""

from __future__ import annotations

import html
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from browser import dump_dom, needs_chromium

import attnkit

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mkdocs.yml"
ENTRY_ID = "attnkit.core.attention"

_MISSING = [
    m
    for m in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "pymdownx.arithmatex")
    if not (importlib.util.find_spec(m.split(".")[0]) and importlib.util.find_spec(m))
]
needs_mkdocs = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"documentation tools not installed ({', '.join(_MISSING)}); "
    "`pip install -e .[docs]` or `make test` installs them",
)


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
@needs_chromium
def test_browser_renders_the_attention_entry(site, tmp_path):
    page = site / "api" / "attnkit.html"
    dom = dump_dom(page, tmp_path / "profile")
    _check_attention_entry(dom)
    # The theme's own scripts (served from the site, not a CDN) ran: they mark every table.
    tables = re.findall(r"<table\b[^>]*>", dom)
    assert tables and all("docutils" in t for t in tables), tables[:3]


# --- every public subpackage documented, every guide reachable ------------------------------


def _nav_pages() -> list[str]:
    """Every page the navigation lists, in order."""
    import yaml  # installed with mkdocs

    def walk(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [p for item in node for p in walk(item)]
        if isinstance(node, dict):
            return [p for value in node.values() for p in walk(value)]
        return []

    return walk(yaml.safe_load(CONFIG.read_text(encoding="utf-8"))["nav"])


def _public_modules() -> list[str]:
    """The subpackages and modules ``import attnkit`` names as public, and attnkit.viz."""
    names = [n for n in attnkit.__all__ if isinstance(getattr(attnkit, n), types.ModuleType)]
    return [*names, "viz"]


def _api_page(module: str) -> str:
    return "api/integrations.md" if module == "integrations" else f"api/{module}.md"


@needs_mkdocs
def test_every_public_subpackage_has_an_api_page_with_its_names(site):
    nav = _nav_pages()
    every_api_page = "".join(p.read_text(encoding="utf-8") for p in (site / "api").glob("*.html"))
    for module in _public_modules():
        page = _api_page(module)
        assert page in nav, f"attnkit.{module} has no API page in the navigation ({page})"
        assert f"({page.removeprefix('api/')})" in (ROOT / "docs/api/index.md").read_text(), (
            f"the API overview does not link {page}"
        )
        built = (site / page).with_suffix(".html").read_text(encoding="utf-8")
        package = importlib.import_module(f"attnkit.{module}")
        for name in getattr(package, "__all__", []):
            obj = getattr(package, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            here = f'id="attnkit.{module}.{name}"'
            home = f'id="{obj.__module__}.{obj.__qualname__}"'
            # Re-exported from elsewhere (a name of attnkit.output, a function named like its
            # module): documented under the name of the module that defines it.
            assert here in built or home in built or home in every_api_page, (
                f"attnkit.{module}.{name} is documented on no API page"
            )


def test_every_guide_is_in_the_index_and_the_navigation():
    index = (ROOT / "docs/index.md").read_text(encoding="utf-8")
    nav = _nav_pages()
    guides = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    assert len(guides) >= 15
    for guide in guides:
        assert f"]({guide})" in index, f"docs/index.md does not list {guide}"
        assert guide in nav, f"mkdocs.yml's nav does not list {guide}"


# --- equations and tables, as a browser shows them ------------------------------------------

# For each page in an iframe (file pages may read each other's DOM with
# --allow-file-access-from-files): the math elements, whether KaTeX drew each, KaTeX's errors,
# math delimiters left in the text, how far the page overflows sideways, and where each table is
# shown against the text column.
_PAGE_CHECK = r"""<script>
window.addEventListener("load", function () {
  function report(frame) {
    var d = frame.contentDocument, w = frame.contentWindow;
    var r = {page: frame.getAttribute("data-page"), width: Number(frame.getAttribute("width"))};
    var math = Array.prototype.slice.call(d.querySelectorAll(".arithmatex"));
    r.math = math.length;
    r.unrendered = math.filter(function (m) { return !m.querySelector(".katex"); })
      .map(function (m) { return m.textContent.slice(0, 80); });
    r.errors = Array.prototype.map.call(d.querySelectorAll(".katex-error"),
      function (e) { return e.textContent.slice(0, 80); });
    r.raw = [];
    var walker = d.createTreeWalker(d.querySelector(".rst-content"), NodeFilter.SHOW_TEXT);
    while (walker.nextNode()) {
      var node = walker.currentNode;
      if (node.parentElement.closest("code, pre, script, style, .katex")) continue;
      if (/\$\$|\\\(|\\\)|\\\[|\\\]|\$[^\s$][^$]*\$/.test(node.textContent))
        r.raw.push(node.textContent.slice(0, 80));
    }
    r.overflow = d.documentElement.scrollWidth - d.documentElement.clientWidth;
    var column = d.querySelector(".rst-content").getBoundingClientRect();
    r.column = [column.left, column.right];
    r.tables = Array.prototype.map.call(d.querySelectorAll(".rst-content table"), function (t) {
      var box = t;
      while (box && box !== d.body && !/(auto|scroll)/.test(w.getComputedStyle(box).overflowX))
        box = box.parentElement;
      var scroller = box && box !== d.body ? box : null;
      var shown = (scroller || t).getBoundingClientRect();
      return {width: t.scrollWidth, scroller: scroller ? scroller.clientWidth : null,
        left: shown.left, right: shown.right};
    });
    return r;
  }
  var out = Array.prototype.map.call(document.querySelectorAll("iframe"), report);
  var pre = document.createElement("pre");
  pre.id = "page-check";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def _browser_report(site: Path, frames: list[tuple[str, int]], profile: Path) -> list:
    frames = "".join(
        f'<iframe src="{page}" data-page="{page}" width="{w}" height="800"></iframe>'
        for page, w in frames
    )
    check = site / "page_check.html"
    check.write_text(f"<!doctype html><html><body>{frames}{_PAGE_CHECK}</body></html>")
    dom = dump_dom(check, profile, "--allow-file-access-from-files", timeout=300)
    found = re.search(r'<pre id="page-check">(.*?)</pre>', dom, flags=re.S)
    assert found, "the page check did not run:\n" + dom[-2000:]
    return json.loads(html.unescape(found.group(1)))


@needs_mkdocs
@needs_chromium
def test_browser_renders_the_equations_and_fits_the_tables(site, tmp_path):
    guides = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    pages = [g.removesuffix(".md") + ".html" for g in guides] + ["api/index.html"]
    # every page in a narrow window, where wide tables must scroll; the widest tables' pages
    # also in a wide one, whose text column is wider than the theme's 800 px
    frames = [(p, 700) for p in pages] + [("experiments.html", 1280), ("taxonomy.html", 1280)]
    reports = _browser_report(site, frames, tmp_path / "profile")
    assert len(reports) == len(frames)
    scrolled = 0
    for r in reports:
        where = f"{r['page']} at {r['width']} px"
        # as many math elements as the built page holds, every one drawn by KaTeX
        built = (site / r["page"]).read_text(encoding="utf-8")
        assert r["math"] == len(re.findall(r'class="arithmatex"', built)), where
        assert r["unrendered"] == [] and r["errors"] == [], (where, r["unrendered"], r["errors"])
        assert r["raw"] == [], f"{where}: math delimiters left in the text: {r['raw'][:3]}"
        # the page never scrolls sideways; each table lies inside the text column, scrolling
        # there when it is wider
        assert r["overflow"] <= 0, f"{where} is {r['overflow']} px wider than the window"
        left, right = r["column"]
        if r["width"] == 1280:
            assert right - left > 800, f"{where}: the text column is {right - left} px wide"
        for t in r["tables"]:
            assert t["scroller"] is not None, f"{where}: a table with no scrolling box"
            assert left - 1 <= t["left"] and t["right"] <= right + 1, (where, t, r["column"])
            scrolled += t["width"] > t["scroller"] + 1
    # the guides' equations: the taxonomy's score and alignment formulas at least
    taxonomy = next(r for r in reports if r["page"] == "taxonomy.html")
    assert taxonomy["math"] >= 25
    assert scrolled > 0, "no table was wide enough to scroll: the check saw no wide table"
