"""The run report: one self-contained HTML page (metrics with what they mean, configuration,
the environment (versions, command line, machine, wall time), training curves, and attention
heatmaps of held-out examples with the gold alignment overlaid), plus the PNGs."""

from __future__ import annotations

import base64
import html
import json
import textwrap
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from attnkit import viz
from attnkit.experiments.environment import rows as env_rows
from attnkit.experiments.report_views import interactive_section
from attnkit.tasks.base import Metric

__all__ = [
    "PAGE_STYLE",
    "curves_figure",
    "heatmap_figure",
    "html_page",
    "html_table",
    "metric_rows",
    "write_report",
]

PAGE_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.7em; text-align: left; }
th { background: #f3f3f3; }
img { max-width: 100%; margin: 0.5em 0; border: 1px solid #eee; }
.grid { display: flex; flex-wrap: wrap; gap: 1em; }
"""


def _png(fig) -> bytes:
    return viz.to_png(fig)


def curves_figure(history: list[dict], info: Mapping[str, Metric] | None = None):
    """Training loss and validation metrics per epoch (integer epoch ticks). With ``info``,
    the validation panel shows the metrics that have a better direction (descriptive ones,
    such as entropy, live on other scales), labelled with it."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    epochs = [h["epoch"] for h in history]
    axes[0].plot(epochs, [h["loss"] for h in history], marker="o")
    axes[0].set(title="training loss (lower is better)", xlabel="epoch", ylabel="loss")
    keys = [k for k in history[0] if k.startswith("val_")]
    if info is not None:
        keys = [k for k in keys if k[4:] in info and info[k[4:]].better]
    for k in keys:
        label = f"{k[4:]} ({info[k[4:]].reading})" if info else k[4:]
        axes[1].plot(epochs, [h[k] for h in history], marker="o", label=label)
    axes[1].set(title="validation", xlabel="epoch", ylabel="metric value")
    if keys:
        axes[1].legend(fontsize=7)
    else:
        axes[1].text(0.5, 0.5, "no validation metrics", ha="center", va="center")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def heatmap_figure(item: dict):
    """One example's weights with the gold links outlined, a colour bar and axis titles (drawn
    by :func:`attnkit.viz.heatmap`), the example's title above; the figure is sized by the
    number and length of the labels and laid out so that no text overlaps."""
    w = np.asarray(item["weights"])
    gold = np.asarray(item["gold"], dtype=bool)
    if "image" in item:  # square grid over an image: keep cells square, image beside it
        fig, axes = plt.subplots(1, 2, figsize=(7.8, 3.8), layout="constrained")
        axes[0].imshow(item["image"], cmap="gray")
        axes[0].set(title="input image", xlabel="pixel column", ylabel="pixel row")
        ax = axes[1]
        aspect = "equal"
    else:
        size = viz.heatmap_size(w.shape, item.get("x_labels"), item.get("y_labels"))
        fig, ax = plt.subplots(figsize=size, layout="constrained")
        aspect = "auto"
    viz.heatmap(
        w,
        ax=ax,
        x_labels=item.get("x_labels"),
        y_labels=item.get("y_labels"),
        gold=gold,
        x_title=item.get("x_title", "key"),
        y_title=item.get("y_title", "query"),
        title="attention weights" + (" (red boxes: gold)" if gold.any() else ""),
        aspect=aspect,
    )
    if "image" in item:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    width = fig.get_size_inches()[0] * 72
    fig.suptitle("\n".join(textwrap.wrap(item["title"], max(20, int(width / 5.2)))), fontsize=9)
    return fig


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(data: bytes, alt: str) -> str:
    encoded = base64.b64encode(data).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'


def html_page(title: str, body: str) -> str:
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{PAGE_STYLE}</style></head><body>\n{body}\n</body></html>\n"
    )


def metric_rows(metrics: Mapping[str, float], info: Mapping[str, Metric]) -> list[list[str]]:
    """[name, value, reading, meaning] in the task's order; metrics it does not describe last."""
    names = [k for k in info if k in metrics] + sorted(k for k in metrics if k not in info)
    rows = []
    for name in names:
        value = metrics[name]
        text = f"{value:.4f}" if isinstance(value, float) else str(value)
        about = info.get(name)
        rows.append(
            [name, text, about.reading if about else "", about.description if about else ""]
        )
    return rows


def _setting(key: str, value) -> str:
    """A configuration value for the report; an unset score or alignment is one the model does
    not read."""
    if value is None and key in ("score", "align"):
        return "not used by this model"
    return "-" if value is None else str(value)


def write_report(
    run_dir: Path,
    config: dict,
    metrics: dict,
    history: list[dict],
    heatmaps: list[dict],
    info: Mapping[str, Metric],
    environment: Mapping[str, Any] | None = None,
    *,
    best: Mapping[str, Any] | None = None,
    tables: list[dict] | None = None,
) -> Path:
    """Write heatmap_*.png, curves.png and report.html into ``run_dir``; return the report.
    With ``environment`` (from :func:`attnkit.experiments.environment.collect`: versions,
    command line, machine, wall time) the page shows it and ``environment.json`` holds it.
    ``best`` (``{"epoch": e, "value": v}``) says that the held-out metrics are those of the
    best epoch's weights (the configuration's ``best_metric``); ``tables`` are the task's
    extra tables (:meth:`attnkit.tasks.base.Task.report_tables`: ``title``, ``header``,
    ``rows`` and an optional ``note``), shown after the metrics."""
    if environment is not None:
        (run_dir / "environment.json").write_text(
            json.dumps(dict(environment), indent=2, default=str), encoding="utf-8"
        )
    images = []
    for i, item in enumerate(heatmaps):
        data = _png(heatmap_figure(item))
        (run_dir / f"heatmap_{i}.png").write_bytes(data)
        images.append(_img(data, item["title"]))
    curves = _png(curves_figure(history, info)) if history else None
    if curves:
        (run_dir / "curves.png").write_bytes(curves)
    environment_section = (
        "<h2>Environment</h2>\n"
        + html_table(["what", "value"], env_rows(environment))
        + "\n<p>Also in <code>environment.json</code>; memory use is in "
        "<code>cost.json</code>.</p>\n"
        if environment is not None
        else ""
    )
    weights = (
        f"<p>With the weights of epoch {best['epoch']} of {len(history)}, the best by validation "
        f"{html.escape(str(config.get('best_metric')))} ({best['value']:.4f}).</p>"
        if best is not None
        else ""
    )
    extra = "".join(
        f"<h3>{html.escape(t['title'])}</h3>\n"
        + (f"<p>{html.escape(t['note'])}</p>\n" if t.get("note") else "")
        + html_table(list(t["header"]), [[str(c) for c in row] for row in t["rows"]])
        for t in tables or []
    )
    has_gold = any(np.asarray(item["gold"], dtype=bool).any() for item in heatmaps)
    gold_note = "; red boxes mark the gold alignment" if has_gold else ""
    body = f"""<h1>attnkit run <code>{html.escape(run_dir.name)}</code></h1>
<h2>Metrics (held-out)</h2>
{weights}
{html_table(["metric", "value", "reading", "meaning"], metric_rows(metrics, info))}
{extra}
<h2>Configuration</h2>
{html_table(["key", "value"], [[k, _setting(k, v)] for k, v in config.items()])}
{environment_section}
<h2>Training</h2>{_img(curves, "training curves") if curves else "<p>no epochs run</p>"}
<h2>Attention on held-out examples</h2>
<p>Each heatmap shows the weights of one example (colour bar: weight){gold_note}.</p>
<div class="grid">{"".join(images)}</div>
{interactive_section(heatmaps)}"""
    path = run_dir / "report.html"
    path.write_text(html_page(f"attnkit run: {run_dir.name}", body), encoding="utf-8")
    return path


EXPLANATION_START = "<!-- attnkit explain -->"
EXPLANATION_END = "<!-- /attnkit explain -->"


def _number(x) -> str:
    return "n/a" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def explanation_section(results: dict) -> str:
    """The "Is it explanation?" section of the report, from the dict of
    :func:`attnkit.evaluation.suite.explanation_suite`: tables with what each number means,
    and for a few examples attention, adversarial attention and importance side by side."""
    eps = results["epsilon"]
    parts = [
        "<h2>Is it explanation?</h2>",
        f"<p>{results['n_examples']} held-out examples; the output explained is the "
        "log-probability of the predicted class. Written by <code>attnkit explain</code>; "
        "the numbers are in <code>explanation.json</code>.</p>",
        "<h3>Does attention rank the items as importance measures do?</h3>",
        html_table(
            ["importance measure", "Kendall τ with attention", "top-k overlap"],
            [
                [
                    name,
                    _number(v["kendall_tau"]),
                    _number(next(x for k, x in v.items() if k.startswith("top_"))),
                ]
                for name, v in results["agreement"].items()
            ],
        ),
    ]
    if "rationale" in results:
        parts += [
            "<h3>Which ranking finds the gold rationale?</h3>",
            "<p>Share of the gold items among each ranking's top |gold| items (1 = all found).</p>",
            html_table(
                ["ranking", "recall at |gold|"],
                [[k, _number(v)] for k, v in results["rationale"].items()],
            ),
        ]
    c = results["counterfactual"]
    counterfactual = [
        ["permuted weights: median output change", c["permuted_median_output_change"],
         "TVD between output distributions, median over permutations, mean over examples "
         "(Jain & Wallace 4.1)"],
        [f"share of examples with median change < ε = {eps}",
         c["share_permutation_median_below_epsilon"],
         "examples whose output ignores the order of the weights"],
        ["uniform weights: output change", c["uniform_output_change"],
         "TVD with uniform weights over the items (Wiegreffe & Pinter 3.1)"],
        ["adversarial weights: JSD from the learned ones", c["adversarial_jsd"],
         f"mean over examples, output change < ε (largest seen "
         f"{_number(c['adversarial_max_output_change'])}); at most ln 2 = 0.693 "
         "(Jain & Wallace 4.2)"],
        ["share with adversarial JSD > ln 2 / 2", c["share_adversarial_jsd_above_half_max"],
         "examples where very different attention gives the same output"],
    ]  # fmt: skip
    parts += [
        "<h3>Do other weights give the same output?</h3>",
        html_table(
            ["measure", "value", "meaning"], [[k, _number(v), m] for k, v, m in counterfactual]
        ),
        "<h3>Erasure: how soon does the decision flip?</h3>",
        "<p>Items removed one by one in each order (Serrano & Smith); a faithful ranking flips the "
        "decision early and often.</p>",
        html_table(
            ["order", "share of decisions flipped", "fraction of items removed when flipped"],
            [
                [k, _number(v["share_flipped"]), _number(v["fraction_removed_when_flipped"])]
                for k, v in results["erasure"].items()
            ],
        ),
    ]  # fmt: skip
    if "confidence" in results:
        parts += [
            "<h3>Is sharp attention a sign of a correct prediction?</h3>",
            html_table(
                ["signal", "AUROC for correctness", "point-biserial r"],
                [
                    [k, _number(v["auroc"]), _number(v["point_biserial"])]
                    for k, v in results["confidence"].items()
                ],
            ),
            "<p>n/a: every prediction right (or every one wrong): nothing to separate.</p>"
            if any(v["auroc"] is None for v in results["confidence"].values())
            else "",
        ]
    if "wiegreffe_pinter" in results:
        wp = results["wiegreffe_pinter"]
        parts += [
            "<h3>Does the attention carry what a model needs? (Wiegreffe &amp; Pinter)</h3>",
            "<p>A trained adversary (the model fine-tuned to keep its predictions while its "
            "attention moves away, W&amp;P 4) on held-out examples: JSD from the learned attention "
            f"{_number(wp['adversary_jsd'])}, output change (TVD) "
            f"{_number(wp['adversary_output_change'])}, same prediction on "
            f"{_number(wp['adversary_agreement'])} of them. An MLP that sees each item alone, "
            "pooled with frozen weights (W&amp;P 3.3): if the model's attention beats uniform "
            "pooling, it marks what the task needs.</p>",
            html_table(
                ["pooling weights", "held-out accuracy"],
                [[k, _number(v)] for k, v in wp["frozen_mlp_accuracy"].items()],
            ),
        ]
    if "heads" in results:
        curve = results["heads"]["pruning"]
        fig = viz.pruning_curve(SimpleNamespace(**curve), metric_name="accuracy").figure
        parts += ["<h3>Heads</h3>", _img(viz.to_png(fig), "pruning curve")]
    images = []
    for i, ex in enumerate(results.get("examples", [])):
        measures = {
            "attention": ex["scores"]["attention"],
            "adversarial attention": ex["adversarial"],
        }
        for name in ("integrated_gradients", "leave_one_out"):
            measures[name] = ex["scores"][name]
        fig = viz.importance_comparison(
            measures,
            labels=ex["tokens"],
            gold=ex["gold"],
            title=f"example {i}: predicted {ex['predicted']}, label {ex['label']}",
        )
        images.append(_img(viz.to_png(fig), f"example {i}"))
    if images:
        parts += [
            "<h3>Examples</h3><p>Each measure scaled by its largest absolute value; gold items in "
            "red.</p>",
            f'<div class="grid">{"".join(images)}</div>',
        ]
    return "\n".join(parts)


def add_section(report: Path, section: str, title: str) -> Path:
    """Put ``section`` into the HTML page ``report`` between the explain markers, replacing an
    earlier one (so running twice leaves one section); a missing page is created."""
    block = f"{EXPLANATION_START}\n{section}\n{EXPLANATION_END}"
    if report.is_file():
        page = report.read_text(encoding="utf-8")
        if EXPLANATION_START in page and EXPLANATION_END in page:
            head, _, rest = page.partition(EXPLANATION_START)
            _, _, tail = rest.partition(EXPLANATION_END)
            page = head + block + tail
        else:
            page = page.replace("\n</body>", f"\n{block}\n</body>", 1)
    else:
        page = html_page(title, block)
    report.write_text(page, encoding="utf-8")
    return report
