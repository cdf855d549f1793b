"""The run report: one self-contained HTML page (configuration, metrics, training curves, and
attention heatmaps of held-out examples with the gold alignment overlaid), plus the PNGs."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

__all__ = ["write_report"]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _curves(history: list[dict]) -> bytes:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    epochs = [h["epoch"] for h in history]
    axes[0].plot(epochs, [h["loss"] for h in history], marker="o")
    axes[0].set(title="training loss", xlabel="epoch")
    keys = [k for k in history[0] if k.startswith("val_")] if history else []
    for k in keys:
        axes[1].plot(epochs, [h[k] for h in history], marker="o", label=k[4:])
    axes[1].set(title="validation", xlabel="epoch")
    if keys:
        axes[1].legend()
    return _png(fig)


def _heatmap(item: dict) -> bytes:
    w, gold = np.asarray(item["weights"]), np.asarray(item["gold"], dtype=bool)
    if "image" in item:
        fig, axes = plt.subplots(1, 2, figsize=(6.4, 3.2))
        axes[0].imshow(item["image"], cmap="gray")
        axes[0].set_title("input")
        ax = axes[1]
    else:
        fig, ax = plt.subplots(figsize=(max(4, 0.28 * w.shape[1] + 1.5), 0.3 * w.shape[0] + 1.2))
    ax.imshow(w, cmap="viridis", aspect="auto", vmin=0)
    ys, xs = np.nonzero(gold)
    ax.scatter(xs, ys, s=12, facecolors="none", edgecolors="red", linewidths=0.8, label="gold")
    if "x_labels" in item:
        ax.set_xticks(range(len(item["x_labels"])), item["x_labels"], fontsize=7)
        ax.set_yticks(range(len(item["y_labels"])), item["y_labels"], fontsize=7)
    ax.set_title("attention (red: gold)", fontsize=8)
    fig.suptitle(item["title"], fontsize=8)
    return _png(fig)


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _img(data: bytes, alt: str) -> str:
    encoded = base64.b64encode(data).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}">'


def write_report(
    run_dir: Path, config: dict, metrics: dict, history: list[dict], heatmaps: list[dict]
) -> Path:
    """Write heatmap_*.png, curves.png and report.html into ``run_dir``; return the report."""
    images = []
    for i, item in enumerate(heatmaps):
        data = _heatmap(item)
        (run_dir / f"heatmap_{i}.png").write_bytes(data)
        images.append(_img(data, item["title"]))
    curves = _curves(history) if history else None
    if curves:
        (run_dir / "curves.png").write_bytes(curves)
    fmt = {k: (f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in metrics.items()}
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>attnkit run: {html.escape(run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1100px; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.7em; text-align: left; }}
th {{ background: #f3f3f3; }}
img {{ max-width: 100%; margin: 0.5em 0; border: 1px solid #eee; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 1em; }}
</style></head><body>
<h1>attnkit run <code>{html.escape(run_dir.name)}</code></h1>
<h2>Metrics (held-out)</h2>{_table(sorted(fmt.items()))}
<h2>Configuration</h2>{_table([(k, str(v)) for k, v in config.items()])}
<h2>Training</h2>{_img(curves, "training curves") if curves else "<p>no epochs run</p>"}
<h2>Attention on held-out examples</h2>
<p>Each heatmap shows the weights of one example; red circles mark the gold alignment.</p>
<div class="grid">{"".join(images)}</div>
</body></html>
"""
    path = run_dir / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
