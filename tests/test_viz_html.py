"""attnkit.viz's HTML views: the data each view carries equals the weights given (in every
accepted form), token colours follow the values, pages are self-contained and safe for any
token text, errors name the argument, and, in headless Chromium, a click on a head or a change
of layer draws exactly the lines of the selected heads with opacities equal to the weights."""

from __future__ import annotations

import html
import json
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from browser import dump_dom, needs_chromium

import attnkit
from attnkit import viz

ROOT = Path(__file__).resolve().parents[1]


def _weights(seed: int = 0, shape=(2, 3, 4, 5)) -> np.ndarray:
    """Row-normalised random weights with a few exact zeros (as a sparse alignment gives)."""
    rng = np.random.default_rng(seed)
    w = rng.random(shape)
    w[rng.random(shape) < 0.25] = 0.0
    w[..., 0] += 0.1  # no row entirely zero
    return w / w.sum(-1, keepdims=True)


def _data(div: str) -> dict:
    found = re.search(r'<script type="application/json" class="ak-data">(.*?)</script>', div)
    assert found, div[:300]
    return json.loads(found.group(1))


def _dom(page: str, tmp_path: Path) -> str:
    """The page's DOM after its scripts ran, as headless Chromium dumps it."""
    path = tmp_path / "page.html"
    path.write_text(page, encoding="utf-8")
    return dump_dom(path, tmp_path / "profile")


# --- the data written into the page ---------------------------------------------------------


def test_head_view_carries_the_weights_tokens_and_names():
    w = _weights()
    tokens, keys = list("abcd"), ["k0", "k1", "k2", "k3", "k4"]
    data = _data(viz.head_view_div(w, tokens, keys, layer=1, heads=[2, 0]))
    np.testing.assert_allclose(np.array(data["weights"]), w, atol=1e-6)
    assert data["left"] == tokens and data["right"] == keys
    assert data["layers"] == ["layer 0", "layer 1"] and data["heads"] == ["0", "1", "2"]
    assert data["layer"] == 1 and data["selected"] == [0, 2]


def test_every_accepted_form_gives_the_same_view():
    w = _weights(1, (2, 3, 4, 4))
    tokens = list("wxyz")
    reference = _data(viz.head_view_div(w, tokens))
    per_layer = [torch.tensor(w[i]).unsqueeze(0) for i in range(2)]  # HF: (1, H, M, N) each
    assert _data(viz.head_view_div(per_layer, tokens)) == reference
    named = _data(viz.head_view_div({"enc.0": w[0], "enc.1": w[1]}, tokens))
    assert named["layers"] == ["enc.0", "enc.1"]
    assert named["weights"] == reference["weights"]
    one = _data(viz.head_view_div(torch.tensor(w[1, 2]), tokens))  # (M, N): one layer, one head
    assert one["weights"] == [[reference["weights"][1][2]]]
    heads = _data(viz.head_view_div(w[0], tokens, layer_names=["only"]))  # (H, M, N)
    assert heads["weights"] == [reference["weights"][0]] and heads["layers"] == ["only"]


def test_float32_rows_a_little_over_one_are_clipped_not_refused():
    w = np.array([[1.0 + 5e-7, 0.0], [0.5, 0.5]])
    assert _data(viz.head_view_div(w, ["a", "b"]))["weights"][0][0][0] == [1.0, 0.0]


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: viz.head_view_div(np.ones((2, 2)) / 2, ["a"]), ValueError, "tokens has 1"),
        (
            lambda: viz.head_view_div(np.ones((2, 3)) / 3, ["a", "b"]),
            ValueError,
            "tokens (as keys) has 2 tokens for 3 keys",
        ),
        (
            lambda: viz.head_view_div(np.ones((2, 3)) / 3, ["a", "b"], ["x"]),
            ValueError,
            "target_tokens has 1",
        ),
        (lambda: viz.head_view_div(np.eye(2), "ab"), TypeError, "tokens must be"),
        (lambda: viz.head_view_div(np.full((2, 2), 1.5), ["a", "b"]), ValueError, "[0, 1]"),
        (lambda: viz.head_view_div(-np.ones((2, 2)), ["a", "b"]), ValueError, "[0, 1]"),
        (
            lambda: viz.head_view_div(np.array([[np.nan, 1.0], [0.5, 0.5]]), ["a", "b"]),
            ValueError,
            "non-finite",
        ),
        (lambda: viz.head_view_div(np.ones(3) / 3, ["a"]), ValueError, "(L, H, M, N)"),
        (lambda: viz.head_view_div(np.ones((1, 2, 2)) / 2, "ab"), TypeError, "tokens"),
        (
            lambda: viz.head_view_div(np.ones((2, 2)) / 2, ["a", "b"], layer=1),
            ValueError,
            "layer must be an int in [0, 1)",
        ),
        (
            lambda: viz.head_view_div(np.ones((2, 2, 2)) / 2, ["a", "b"], heads=[2]),
            ValueError,
            "heads must hold ints in [0, 2)",
        ),
        (
            lambda: viz.head_view_div(np.ones((2, 2, 2, 2)) / 2, ["a", "b"], layer_names=["x"]),
            ValueError,
            "layer_names has 1 names for 2 layers",
        ),
        (
            lambda: viz.head_view_div([np.ones((1, 2, 2)), np.ones((2, 2, 2))], ["a", "b"]),
            ValueError,
            "attention[1] has shape (2, 2, 2)",
        ),
        (lambda: viz.head_view_div({}, ["a"]), ValueError, "empty mapping"),
        (
            lambda: viz.token_highlight_div(["a", "b"], [1.0]),
            ValueError,
            "scores must have one value per token, shape (2,)",
        ),
        (
            lambda: viz.token_highlight_div(["a"], {"grad": [np.inf]}),
            ValueError,
            "scores['grad'] has non-finite",
        ),
        (
            lambda: viz.token_highlight_div(["a", "b"], [1.0, 2.0], gold=[True]),
            ValueError,
            "gold must have shape (2,)",
        ),
        (lambda: viz.token_highlight_div(["a"], {}), ValueError, "empty mapping"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(call, error, words):
    with pytest.raises(error) as caught:
        call()
    assert words in str(caught.value)


_RGBA = re.compile(r"background-color: rgba\((\d+), (\d+), (\d+), ([\d.]+)\)")


def test_token_colours_follow_the_values_row_by_row():
    values = {"attention": [0.1, 0.6, 0.3], "gradient": [-2.0, 0.5, 1.0]}
    div = viz.token_highlight_div(["x", "y", "z"], values, gold=[False, True, False])
    for name, row in values.items():
        part = div.split(f'data-name="{name}"', 1)[1].split("</div>", 1)[0]
        spans = re.findall(r'<span class="ak-tok[^"]*"[^>]*>', part)
        assert len(spans) == 3
        largest = max(abs(v) for v in row)
        for span, v in zip(spans, row, strict=True):
            r, g, b, a = _RGBA.search(span).groups()
            assert (int(r), int(g), int(b)) == (viz_red() if v >= 0 else viz_blue())
            assert float(a) == pytest.approx(abs(v) / largest, abs=1e-4)
        assert ["ak-gold" in s for s in spans] == [False, True, False]


def viz_red() -> tuple[int, int, int]:
    return (214, 39, 40)


def viz_blue() -> tuple[int, int, int]:
    return (31, 119, 180)


def test_a_row_of_zeros_is_uncoloured():
    div = viz.token_highlight_div(["a", "b"], np.zeros(2))
    assert [float(a) for *_, a in _RGBA.findall(div)] == [0.0, 0.0]


def test_pages_are_self_contained_and_any_token_text_is_inert():
    hostile = "</script><img src=x onerror=alert(1)>&amp;"
    pages = [
        viz.head_view(np.eye(2), [hostile, "b"], title="<b>t</b>"),
        viz.token_highlight([hostile, "b"], [0.5, 0.5], title="<b>t</b>"),
    ]
    for page in pages:
        # one script element for the view's data (head view only) and one for its code
        assert page.count("</script>") == page.count("<script")
        assert "<img src=x" not in page and "<b>t</b>" not in page
        assert not re.search(r"\b(src|href)=[\"']?(https?:)?//", page)
        assert "@import" not in page and "url(" not in page


def test_the_view_script_and_style_ship_with_the_package():
    assets = ROOT / "src" / "attnkit" / "viz_assets"
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["attnkit"]
    shipped = {p for g in globs for p in (ROOT / "src" / "attnkit").glob(g)}
    assert {assets / "views.js", assets / "views.css"} <= shipped
    assert (assets / "views.js").read_text() in viz.view_assets()


def test_viz_exports_the_views():
    assert viz.head_view is attnkit.viz_html.head_view
    assert {"head_view", "token_highlight", "view_assets"} <= set(viz.__all__)


# --- in the browser ---------------------------------------------------------------------------

# Drives the view as a reader would (clicks, double click, the layer menu, pointing at a token)
# and records, after each step, the view's state and every line drawn.
_DRIVER = """<script>
(function () {
  var root = document.querySelector("div.ak-head-view");
  function head(h) { return root.querySelector('button.ak-head[data-head="' + h + '"]'); }
  function snap(step) {
    return {step: step, layer: root.getAttribute("data-layer"),
      heads: root.getAttribute("data-heads"),
      pressed: Array.prototype.map.call(root.querySelectorAll("button.ak-head"),
        function (b) { return b.getAttribute("aria-pressed"); }),
      lines: Array.prototype.map.call(root.querySelectorAll("line.ak-line"), function (l) {
        return [Number(l.getAttribute("data-head")), Number(l.getAttribute("data-query")),
          Number(l.getAttribute("data-key")), Number(l.getAttribute("stroke-opacity")),
          l.getAttribute("stroke")];
      })};
  }
  var out = [snap("start")];
  head(0).click();
  out.push(snap("click head 0"));
  head(1).dispatchEvent(new MouseEvent("dblclick", {bubbles: true}));
  out.push(snap("double click head 1"));
  var menu = root.querySelector("select.ak-layer");
  menu.value = "1";
  menu.dispatchEvent(new Event("change", {bubbles: true}));
  out.push(snap("layer 1"));
  head(2).click();
  out.push(snap("click head 2"));
  var token = root.querySelectorAll("text.ak-left")[2];
  token.dispatchEvent(new MouseEvent("mouseenter"));
  out.push(snap("point at query 2"));
  token.dispatchEvent(new MouseEvent("mouseleave"));
  out.push(snap("pointer away"));
  var keys = root.querySelectorAll("text.ak-right");
  out.push({step: "tokens", left: Array.prototype.map.call(
    root.querySelectorAll("text.ak-left"), function (t) { return t.textContent; }),
    right: Array.prototype.map.call(keys, function (t) { return t.textContent; })});
  var pre = document.createElement("pre");
  pre.id = "ak-result";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


def _expected_lines(w: np.ndarray, layer: int, heads, query=None) -> dict:
    """(head, query, key) -> weight for every non-zero weight of the heads, by loops."""
    out = {}
    for h in heads:
        for i in range(w.shape[2]):
            if query is not None and i != query:
                continue
            for j in range(w.shape[3]):
                if w[layer, h, i, j] != 0:
                    out[(h, i, j)] = w[layer, h, i, j]
    return out


@needs_chromium
def test_clicks_and_the_layer_menu_draw_the_selected_heads_lines(tmp_path):
    w = _weights(3, (2, 3, 4, 5))
    tokens, keys = ["the", "</script>", "cat", "sat"], ["k0", "k1", "k2", "k3", "k4"]
    page = viz.head_view(w, tokens, keys, title="drive")
    page = page.replace("</body>", _DRIVER + "</body>")
    dom = _dom(page, tmp_path)
    found = re.search(r'<pre id="ak-result">(.*?)</pre>', dom, flags=re.S)
    assert found, "the view or its driver did not run:\n" + dom[-2000:]
    steps = json.loads(html.unescape(found.group(1)))
    expected = [
        ("start", 0, [0, 1, 2], None),
        ("click head 0", 0, [1, 2], None),
        ("double click head 1", 0, [1], None),
        ("layer 1", 1, [1], None),
        ("click head 2", 1, [1, 2], None),
        ("point at query 2", 1, [1, 2], 2),
        ("pointer away", 1, [1, 2], None),
    ]
    assert len(steps) == len(expected) + 1
    colours = {}
    for snap, (step, layer, heads, query) in zip(steps, expected, strict=False):
        assert snap["step"] == step
        assert snap["layer"] == str(layer), step
        assert snap["heads"] == ",".join(map(str, heads)), step
        assert snap["pressed"] == [str(h in heads).lower() for h in range(3)], step
        drawn = {(h, i, j): opacity for h, i, j, opacity, _ in snap["lines"]}
        assert len(drawn) == len(snap["lines"]), f"{step}: a line drawn twice"
        want = _expected_lines(w, layer, heads, query)
        assert drawn.keys() == want.keys(), step
        for key, opacity in drawn.items():
            assert opacity == pytest.approx(want[key], abs=1e-6), (step, key)
        for h, *_, stroke in snap["lines"]:
            assert colours.setdefault(h, stroke) == stroke, "a head changed colour"
    assert len(set(colours.values())) == 3, "heads share a colour"
    assert steps[-1] == {"step": "tokens", "left": tokens, "right": keys}


@needs_chromium
def test_several_views_on_one_page_are_each_drawn(tmp_path):
    w = _weights(4, (1, 2, 3, 3))
    page = (
        "<!doctype html><html><head><meta charset='utf-8'></head><body>"
        + viz.head_view_div(w, list("abc"), heads=[0])
        + viz.token_highlight_div(list("abc"), {"attention": w[0, 0, 0]})
        + viz.head_view_div(w, list("xyz"), heads=[1])
        + viz.view_assets()
        + "</body></html>"
    )
    dom = _dom(page, tmp_path)
    views = dom.split('class="ak-view ak-head-view"')[1:]
    assert len(views) == 2
    for view, head in zip(views, (0, 1), strict=True):
        assert f'data-heads="{head}"' in view
        lines = re.findall(r"<line [^>]*>", view.split('class="ak-view ak-token-view"')[0])
        assert len(lines) == int(np.count_nonzero(w[0, head]))
        assert all(f'data-head="{head}"' in line for line in lines)


@needs_chromium
def test_browser_paints_tokens_with_the_value_colours(tmp_path):
    values = [0.5, -1.0, 0.25, 0.0]
    driver = """<script>
    var spans = document.querySelectorAll("span.ak-tok");
    var pre = document.createElement("pre"); pre.id = "ak-result";
    pre.textContent = JSON.stringify(Array.prototype.map.call(spans, function (s) {
      return getComputedStyle(s).backgroundColor; }));
    document.body.appendChild(pre);
    </script>"""
    page = viz.token_highlight(list("abcd"), values).replace("</body>", driver + "</body>")
    dom = _dom(page, tmp_path)
    colours = json.loads(re.search(r'<pre id="ak-result">(.*?)</pre>', dom, flags=re.S).group(1))
    assert len(colours) == 4
    for colour, v in zip(colours, values, strict=True):
        numbers = [float(x) for x in re.findall(r"[\d.]+", colour)]
        rgb = viz_red() if v >= 0 else viz_blue()
        alpha = abs(v) / 1.0
        if alpha == 0:
            assert numbers[3:] == [0.0], colour
            continue
        assert tuple(int(x) for x in numbers[:3]) == rgb, colour
        assert (numbers[3] if len(numbers) == 4 else 1.0) == pytest.approx(alpha, abs=0.01)
