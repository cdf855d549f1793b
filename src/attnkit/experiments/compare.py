"""The combined result of ``attnkit run --compare KEY=V1,V2,... [--compare KEY2=...]``: one row
per run, as a markdown table (printed and saved as ``compare.md``) and an HTML page
(``compare.html``) with the metrics explained, the runs' learning curves overlaid, their
attention heatmaps side by side and a link to each run's report.

When ``seed`` is one of the compared keys, a summary table comes first: one row per combination
of the other keys, each metric as mean ± sample standard deviation over the seeds (divisor
n - 1), with n the number of seeds; the per-run table follows it.
"""

from __future__ import annotations

import base64
import csv
import html
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from attnkit import viz
from attnkit.experiments.report import html_page, html_table
from attnkit.tasks.base import Metric

__all__ = [
    "SEED",
    "Summary",
    "Variant",
    "curves_figure",
    "markdown",
    "markdown_table",
    "seed_summary",
    "summary_table",
    "write_comparison",
]

# (value of each compared key, as given, in the keys' order; run dir; held-out metrics). With a
# single compared key the value may be a plain str.
Variant = tuple[str | tuple[str, ...], Path, Mapping[str, float]]
# (values of the compared keys other than the seed; n runs; metric -> the values over seeds)
Summary = tuple[tuple[str, ...], int, dict[str, list[float]]]

SEED = "seed"
CURVE_METRICS = 3  # validation panels at most, besides the training loss


def _keys(key: str | Sequence[str]) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)


def _values(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _label(keys: Sequence[str], values: Sequence[str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True)) or "all runs"


def _columns(variants: Sequence[Variant], info: Mapping[str, Metric]) -> list[str]:
    seen = {k for _, _, metrics in variants for k in metrics}
    return [k for k in info if k in seen] + sorted(seen - set(info))


def _head(columns: list[str], info: Mapping[str, Metric]) -> list[str]:
    return [f"{c} ({info[c].reading})" if c in info else c for c in columns]


def _cell(metrics: Mapping[str, float], key: str) -> str:
    value = metrics.get(key)
    return "" if value is None else f"{value:.3f}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown_table(
    key: str | Sequence[str], variants: Sequence[Variant], info: Mapping[str, Metric]
) -> str:
    """``| key ... | metric (higher is better) | ... | report |``, one row per run."""
    keys, columns = _keys(key), _columns(variants, info)
    rows = [
        [*_values(value), *(_cell(metrics, c) for c in columns), str(run_dir / "report.html")]
        for value, run_dir, metrics in variants
    ]
    return _markdown([*keys, *_head(columns, info), "report"], rows)


def seed_summary(
    key: str | Sequence[str], variants: Sequence[Variant], seed: str = SEED
) -> list[Summary]:
    """The runs grouped by the values of every compared key but ``seed``, in order of first
    appearance: (those values, number of runs, metric -> its values over the group's runs)."""
    keys = _keys(key)
    if seed not in keys:
        raise ValueError(f"seed_summary: {seed!r} is not one of the compared keys {keys}")
    at = keys.index(seed)
    runs: dict[tuple[str, ...], int] = {}
    found: dict[tuple[str, ...], dict[str, list[float]]] = {}
    for value, _, metrics in variants:
        values = _values(value)
        rest = values[:at] + values[at + 1 :]
        runs[rest] = runs.get(rest, 0) + 1
        for name, x in metrics.items():
            found.setdefault(rest, {}).setdefault(name, []).append(float(x))
    return [(rest, n, found.get(rest, {})) for rest, n in runs.items()]


def _mean_std(values: list[float], n: int) -> str:
    """``mean ± s`` with the sample standard deviation s (divisor k - 1) of the k values; only
    the mean for one value; ``(n=k)`` when fewer than the group's n runs gave the metric."""
    k = len(values)
    mean = math.fsum(values) / k
    text = f"{mean:.3f}"
    if k > 1:
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in values) / (k - 1))
        text += f" ± {std:.3f}"
    return text + (f" (n={k})" if k != n else "")


def _summary_rows(
    keys: tuple[str, ...], variants: Sequence[Variant], info: Mapping[str, Metric]
) -> tuple[list[str], list[list[str]]]:
    columns = _columns(variants, info)
    header = [
        *(k for k in keys if k != SEED),
        "n",
        *(f"{c} mean ± std" for c in _head(columns, info)),
    ]
    rows = [
        [*rest, str(n), *(_mean_std(found[c], n) if c in found else "" for c in columns)]
        for rest, n, found in seed_summary(keys, variants)
    ]
    return header, rows


def summary_table(
    key: str | Sequence[str], variants: Sequence[Variant], info: Mapping[str, Metric]
) -> str:
    """The markdown summary over seeds (``seed`` must be a compared key): one row per
    combination of the other keys, its number of seeds ``n`` and each metric as mean ± sample
    standard deviation."""
    return _markdown(*_summary_rows(_keys(key), variants, info))


def markdown(
    key: str | Sequence[str], variants: Sequence[Variant], info: Mapping[str, Metric]
) -> str:
    """What ``compare.md`` holds: the per-run table, preceded by the summary over seeds when
    ``seed`` is a compared key."""
    keys = _keys(key)
    if SEED not in keys:
        return markdown_table(keys, variants, info)
    return (
        f"Mean ± sample standard deviation over seeds (n seeds):\n\n"
        f"{summary_table(keys, variants, info)}\n\nEach run:\n\n"
        f"{markdown_table(keys, variants, info)}"
    )


def _history(run_dir: Path) -> list[dict[str, float]]:
    """The run's ``epochs.csv`` (epoch, loss, val_*), numbers only; empty when absent."""
    path = run_dir / "epochs.csv"
    if not path.is_file():
        return []
    records = []
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            record = {}
            for name, text in row.items():
                try:
                    record[name] = float(text)
                except (TypeError, ValueError):
                    continue
            if "epoch" in record:
                records.append(record)
    return records


def curves_figure(
    key: str | Sequence[str], variants: Sequence[Variant], info: Mapping[str, Metric]
):
    """Learning curves of every run overlaid, from each run's ``epochs.csv``: the training loss
    and up to ``CURVE_METRICS`` validation metrics that have a better direction, per epoch. Runs
    that differ only in the seed share a colour (labelled once). None when no run has an epoch
    recorded."""
    keys = _keys(key)
    histories = [(_values(v), _history(d)) for v, d, _ in variants]
    if not any(h for _, h in histories):
        return None
    present = {k[4:] for _, h in histories for r in h for k in r if k.startswith("val_")}
    shown = [m for m in info if m in present and info[m].better][:CURVE_METRICS]
    fig, axes = plt.subplots(1, 1 + len(shown), figsize=(4.2 * (1 + len(shown)), 3.4))
    axes = [axes] if not shown else list(axes)
    colours = plt.get_cmap("tab10" if len(variants) <= 10 else "tab20")
    groups: dict[tuple[str, ...], int] = {}
    for values, history in histories:
        rest = tuple(v for k, v in zip(keys, values, strict=True) if k != SEED)
        first = rest not in groups
        colour = colours(groups.setdefault(rest, len(groups)) % colours.N)
        if SEED in keys:  # one label per colour: the runs of its seeds share it
            label = _label([k for k in keys if k != SEED], rest) if first else None
        else:
            label = _label(keys, values)
        epochs = [r["epoch"] for r in history]
        axes[0].plot(epochs, [r.get("loss", math.nan) for r in history], marker="o",
                     markersize=3, color=colour, label=label)  # fmt: skip
        for ax, metric in zip(axes[1:], shown, strict=True):
            ax.plot(epochs, [r.get(f"val_{metric}", math.nan) for r in history], marker="o",
                    markersize=3, color=colour)  # fmt: skip
    axes[0].set(title="training loss (lower is better)", xlabel="epoch", ylabel="loss")
    for ax, metric in zip(axes[1:], shown, strict=True):
        ax.set(title=f"validation {metric} ({info[metric].reading})", xlabel="epoch")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=7 if len(groups) <= 8 else 5)
    return fig


def _img(data: bytes, alt: str) -> str:
    encoded = base64.b64encode(data).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'


def _png_width(data: bytes) -> int | None:
    """The width in pixels of PNG ``data`` (from its IHDR chunk), None if it is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big")


def _has_gold(variants: Sequence[Variant]) -> bool:
    """Whether a compared run's task has gold attention (read from its config.json)."""
    import json

    from attnkit import tasks

    for _, run_dir, _ in variants:
        try:
            name = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["task"]
            if tasks.get(name).gold_alignment:
                return True
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return False


def _heatmaps(run_dir: Path) -> list[Path]:
    found = [p for p in run_dir.glob("heatmap_*.png") if p.stem[8:].isdigit()]
    return sorted(found, key=lambda p: int(p.stem[8:]))


def _heatmap_section(keys: tuple[str, ...], variants: Sequence[Variant], examples: int) -> str:
    images = [(_label(keys, _values(v)), _heatmaps(d)[:examples]) for v, d, _ in variants]
    count = max((len(paths) for _, paths in images), default=0)
    if count == 0:
        return "<p>no heatmaps were written</p>"
    gold = "; red boxes mark the gold alignment" if _has_gold(variants) else ""
    parts = [
        "<p>The same held-out example in each run's report (runs with the same seed see the "
        f"same examples); each heatmap is the run's attention weights{gold}, shown at its full "
        "size (scroll sideways for the runs that do not fit).</p>"
    ]
    for i in range(count):
        cells = []
        for label, paths in images:
            if i >= len(paths):
                continue
            data = paths[i].read_bytes()
            width = _png_width(data)
            size = f' width="{width}"' if width else ""
            encoded = base64.b64encode(data).decode()
            cells.append(
                f'<figure style="margin:0; flex:none"><img alt="{html.escape(label)}"{size} '
                f'style="max-width:none" src="data:image/png;base64,{encoded}">'
                f"<figcaption>{html.escape(label)}</figcaption></figure>"
            )
        parts.append(
            f'<h3>Example {i + 1}</h3><div class="heatmaps" style="display:flex; gap:1em; '
            f'overflow-x:auto; align-items:flex-start">{"".join(cells)}</div>'
        )
    return "".join(parts)


def _link(directory: Path, run_dir: Path) -> str:
    report = run_dir / "report.html"
    return str(report.relative_to(directory) if report.is_relative_to(directory) else report)


def write_comparison(
    directory: Path,
    key: str | Sequence[str],
    variants: Sequence[Variant],
    info: Mapping[str, Metric],
    *,
    examples: int = 4,
) -> Path:
    """Write ``compare.md``, ``compare.html`` and (when the runs logged epochs)
    ``compare_curves.png`` into ``directory``; return the HTML page.

    Args:
        directory: where the files go (the runs' parent directory, for relative links).
        key: the compared key, or the compared keys in order.
        variants: one per run: its values of the keys, its directory and its held-out metrics.
        info: metric name -> :class:`~attnkit.tasks.base.Metric` (meaning and direction).
        examples: heatmaps of at most this many examples per run, side by side.
    """
    keys = _keys(key)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "compare.md").write_text(markdown(keys, variants, info) + "\n")
    columns = _columns(variants, info)
    rows = [[*_values(v), *(_cell(m, c) for c in columns)] for v, _, m in variants]
    per_run = html_table([*keys, *columns], rows)
    tables = f"<h2>Held-out metrics</h2>{per_run}"
    if SEED in keys:
        summary = html_table(*_summary_rows(keys, variants, info))
        tables = (
            "<h2>Held-out metrics over seeds</h2><p>Mean ± sample standard deviation (divisor "
            f"n - 1) over the n seeds of each combination.</p>{summary}"
            f"<h2>Held-out metrics of each run</h2>{per_run}"
        )
    fig = curves_figure(keys, variants, info)
    if fig is None:
        curves = "<p>no epochs were logged</p>"
    else:
        data = viz.to_png(fig)
        (directory / "compare_curves.png").write_bytes(data)
        curves = _img(data, "learning curves of every run")
    links = "".join(
        f'<li><a href="{html.escape(_link(directory, d))}">'
        f"{html.escape(_label(keys, _values(v)))}</a></li>"
        for v, d, _ in variants
    )
    meaning = [[c, info[c].reading, info[c].description] for c in columns if c in info]
    title = " ".join(f"--compare {k}" for k in keys)
    body = f"""<h1>attnkit run {html.escape(title)}</h1>
{tables}
<h2>What the metrics mean</h2>{html_table(["metric", "reading", "meaning"], meaning)}
<h2>Learning curves</h2>{curves}
<h2>Attention side by side</h2>{_heatmap_section(keys, variants, examples)}
<h2>Reports of each run</h2><ul>{links}</ul>"""
    path = directory / "compare.html"
    path.write_text(html_page(f"attnkit compare {', '.join(keys)}", body), encoding="utf-8")
    return path
