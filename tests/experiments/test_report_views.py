"""The report's interactive views: which examples get a head view, which a token highlight and
which none; the data they carry equals the example's weights; the written report holds them
with their script once, and a browser draws them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from browser import dump_dom, needs_chromium

from attnkit.experiments.report import write_report
from attnkit.experiments.report_views import MAX_CELLS, interactive_section
from attnkit.tasks.base import Metric


def _item(weights, **extra) -> dict:
    w = np.asarray(weights, dtype=float)
    item = {
        "title": "example",
        "weights": w,
        "gold": np.zeros(w.shape, dtype=bool),
        "x_labels": [f"k{j}" for j in range(w.shape[1])],
        "y_labels": [f"q{i}" for i in range(w.shape[0])],
    }
    item.update(extra)
    return item


def _data(section: str) -> list[dict]:
    blobs = re.findall(r'<script type="application/json" class="ak-data">(.*?)</script>', section)
    return [json.loads(b) for b in blobs]


def test_a_matrix_gets_a_head_view_of_its_weights():
    w = np.random.default_rng(0).dirichlet(np.ones(4), size=3)
    (data,) = _data(interactive_section([_item(w)]))
    np.testing.assert_allclose(np.array(data["weights"])[0, 0], w, atol=1e-6)
    assert data["left"] == ["q0", "q1", "q2"] and data["right"] == ["k0", "k1", "k2", "k3"]


def test_every_layer_and_head_when_the_example_carries_them():
    rng = np.random.default_rng(1)
    layers = rng.dirichlet(np.ones(3), size=(2, 4, 3))  # (L, H, M, N)
    item = _item(layers[1, 0], attention=layers, layer_names=["enc 0", "enc 1"])
    (data,) = _data(interactive_section([item]))
    np.testing.assert_allclose(np.array(data["weights"]), layers, atol=1e-6)
    assert data["layers"] == ["enc 0", "enc 1"] and len(data["heads"]) == 4


def test_a_single_query_row_is_shown_as_coloured_words():
    gold = np.array([[False, True, False]])
    section = interactive_section([_item([[0.2, 0.7, 0.1]], gold=gold, y_labels=["query"])])
    assert 'class="ak-view ak-head-view"' not in section
    assert 'class="ak-view ak-token-view"' in section
    alphas = [float(a) for a in re.findall(r"rgba\(214, 39, 40, ([\d.]+)\)", section)]
    assert alphas == pytest.approx([0.2 / 0.7, 1.0, 0.1 / 0.7], abs=1e-4)
    assert section.count('class="ak-tok ak-gold"') == 1


def test_examples_without_a_view():
    rng = np.random.default_rng(2)
    image = _item(rng.random((4, 4)) / 4, image=np.zeros((8, 8)))
    signed = _item([[-0.5, 1.0], [0.2, 0.3]])
    unlabelled = {"title": "t", "weights": np.eye(2), "gold": np.eye(2, dtype=bool)}
    side = int(np.sqrt(MAX_CELLS)) + 1
    huge = _item(np.full((side, side), 1.0 / side))
    assert interactive_section([image, signed, unlabelled, huge]) == ""
    assert len(_data(interactive_section([signed, _item(np.eye(2))]))) == 1


def _report(tmp_path):
    rng = np.random.default_rng(3)
    items = [_item(rng.dirichlet(np.ones(5), size=4)), _item(rng.dirichlet(np.ones(3), size=2))]
    items[1]["weights"][0, 1] = 0.0
    path = write_report(
        tmp_path, {"seed": 0}, {"a": 0.5}, [], items, {"a": Metric("a metric")}, None
    )
    return path, items


def test_the_report_holds_the_views_and_their_script_once(tmp_path):
    path, items = _report(tmp_path)
    page = path.read_text(encoding="utf-8")
    assert "<h2>Interactive view</h2>" in page
    assert page.count('class="ak-view ak-head-view"') == 2
    assert page.count("window.attnkitViews") == 1
    for data, item in zip(_data(page), items, strict=True):
        np.testing.assert_allclose(np.array(data["weights"])[0, 0], item["weights"], atol=1e-6)


@needs_chromium
def test_a_browser_draws_the_reports_views(tmp_path):
    path, items = _report(tmp_path)
    views = dump_dom(path, tmp_path / "profile").split('class="ak-view ak-head-view"')[1:]
    assert len(views) == 2
    for view, item in zip(views, items, strict=True):
        lines = re.findall(r"<line [^>]*>", view)
        assert len(lines) == int(np.count_nonzero(item["weights"]))
        for line in lines:
            i, j = (int(re.search(rf'data-{k}="(\d+)"', line).group(1)) for k in ("query", "key"))
            opacity = float(re.search(r'stroke-opacity="([\d.e-]+)"', line).group(1))
            assert opacity == pytest.approx(item["weights"][i, j], abs=1e-6)
