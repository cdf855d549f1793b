"""The combined result of ``attnkit run --compare KEY=V1,V2,...``: one row per variant, as a
markdown table (printed and saved as ``compare.md``) and an HTML page (``compare.html``) with
the metrics explained and a link to each variant's report."""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path

from attnkit.experiments.report import html_page, html_table
from attnkit.tasks.base import Metric

__all__ = ["Variant", "markdown_table", "write_comparison"]

Variant = tuple[str, Path, Mapping[str, float]]  # (value of the compared key, run dir, metrics)


def _columns(variants: list[Variant], info: Mapping[str, Metric]) -> list[str]:
    seen = {k for _, _, metrics in variants for k in metrics}
    return [k for k in info if k in seen] + sorted(seen - set(info))


def _cell(metrics: Mapping[str, float], key: str) -> str:
    value = metrics.get(key)
    return "" if value is None else f"{value:.3f}"


def markdown_table(key: str, variants: list[Variant], info: Mapping[str, Metric]) -> str:
    """``| key | metric (higher is better) | ... | report |``, one row per variant."""
    columns = _columns(variants, info)
    head = [key, *(f"{c} ({info[c].reading})" if c in info else c for c in columns), "report"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for value, run_dir, metrics in variants:
        cells = [value, *(_cell(metrics, c) for c in columns), str(run_dir / "report.html")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _link(directory: Path, run_dir: Path) -> str:
    report = run_dir / "report.html"
    return str(report.relative_to(directory) if report.is_relative_to(directory) else report)


def write_comparison(
    directory: Path, key: str, variants: list[Variant], info: Mapping[str, Metric]
) -> Path:
    """Write ``compare.md`` and ``compare.html`` into ``directory``; return the HTML page."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "compare.md").write_text(markdown_table(key, variants, info) + "\n")
    columns = _columns(variants, info)
    rows = [[value, *(_cell(m, c) for c in columns)] for value, _, m in variants]
    links = "".join(
        f'<li><a href="{html.escape(_link(directory, d))}">{html.escape(key)} = '
        f"{html.escape(v)}</a></li>"
        for v, d, _ in variants
    )
    meaning = [[c, info[c].reading, info[c].description] for c in columns if c in info]
    body = f"""<h1>attnkit run --compare {html.escape(key)}</h1>
<h2>Held-out metrics</h2>{html_table([key, *columns], rows)}
<h2>What the metrics mean</h2>{html_table(["metric", "reading", "meaning"], meaning)}
<h2>Reports of each variant</h2><ul>{links}</ul>"""
    path = directory / "compare.html"
    path.write_text(html_page(f"attnkit compare {key}", body), encoding="utf-8")
    return path
