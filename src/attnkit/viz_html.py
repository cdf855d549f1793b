"""Interactive attention views as self-contained HTML (Galassi VI: inspecting attention by
visualisation), in the spirit of bertviz's head view and of captum/inseq's token highlights.

- :func:`head_view`: query tokens on the left, key tokens on the right and a line for every
  non-zero weight of the selected heads, its opacity the weight; heads are shown or hidden by
  a click (a double click shows one alone), the layer is chosen from a menu, and pointing at a
  token shows only its lines.
- :func:`token_highlight`: tokens coloured by an attribution (attention, gradients, erasure,
  ...), one row per measure; red for positive, blue for negative values, the colour's opacity
  the value over the row's largest absolute value.

Each returns a whole HTML page as a string (write it to a file and open it, or show it in a
notebook with ``IPython.display.HTML``). The ``*_div`` variants return the view alone, for a
page of several views, which then needs :func:`view_assets` once. The pages load nothing: the
script and style ship with attnkit and are written into the page.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any

import numpy as np

__all__ = [
    "head_view",
    "head_view_div",
    "token_highlight",
    "token_highlight_div",
    "view_assets",
]

# Weights are written with this many decimals: the lines' opacities are these numbers.
DECIMALS = 6
# Weights may exceed [0, 1] by this much from rounding (float32 softmax rows) and are clipped.
_SLACK = 1e-5
POSITIVE = (214, 39, 40)  # red
NEGATIVE = (31, 119, 180)  # blue


@cache
def _asset(name: str) -> str:
    text = (resources.files("attnkit") / "viz_assets" / name).read_text(encoding="utf-8")
    if "</script" in text.lower():
        raise RuntimeError(f"viz asset {name} contains '</script' and cannot be inlined")
    return text


def view_assets() -> str:
    """The ``<style>`` and ``<script>`` that the views of :func:`head_view_div` and
    :func:`token_highlight_div` need, once per page (anywhere in the page; views added to the
    page later are drawn by calling ``attnkitViews.start()``)."""
    return f"<style>{_asset('views.css')}</style>\n<script>{_asset('views.js')}</script>\n"


def _page(title: str | None, body: str) -> str:
    name = html.escape(title) if title else "attnkit attention view"
    return (
        f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{name}</title>'
        f"</head><body>\n{body}\n{view_assets()}</body></html>\n"
    )


def _numbers(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name} must be an array or tensor of numbers ({err})") from None
    if not np.isfinite(a).all():
        raise ValueError(f"{name} has non-finite values (NaN or inf)")
    return a


def _layer_stack(attention: Any, layer_names: Sequence[str] | None) -> tuple[np.ndarray, list]:
    """(L, H, M, N) weights and the layers' names from any accepted form of ``attention``."""
    names: list[str] | None = None
    if isinstance(attention, Mapping):
        if not attention:
            raise ValueError("attention is an empty mapping; expected layer name -> weights")
        names = [str(k) for k in attention]
        attention = list(attention.values())
    if isinstance(attention, list | tuple) and attention and hasattr(attention[0], "shape"):
        layers = []
        for i, layer in enumerate(attention):
            a = _numbers(layer, f"attention[{i}]")
            if a.ndim == 4 and a.shape[0] == 1:  # (1, H, M, N): one batch item
                a = a[0]
            if a.ndim == 2:
                a = a[None]
            if a.ndim != 3:
                raise ValueError(
                    f"attention[{i}] must be (H, M, N), (1, H, M, N) or (M, N), got shape "
                    f"{tuple(a.shape)}"
                )
            if layers and a.shape != layers[0].shape:
                raise ValueError(
                    f"attention[{i}] has shape {tuple(a.shape)}, layer 0 has "
                    f"{tuple(layers[0].shape)}; every layer needs the same heads and tokens"
                )
            layers.append(a)
        w = np.stack(layers)
    else:
        w = _numbers(attention, "attention")
        if not 2 <= w.ndim <= 4:
            raise ValueError(
                f"attention must be (M, N), (H, M, N) or (L, H, M, N), got shape {w.shape}"
            )
        w = w.reshape((1,) * (4 - w.ndim) + w.shape)
    if 0 in w.shape:
        raise ValueError(f"attention has an empty dimension: shape (L, H, M, N) = {w.shape}")
    if w.min() < -_SLACK or w.max() > 1 + _SLACK:
        raise ValueError(
            "attention weights must lie in [0, 1] (they are drawn as line opacities), got "
            f"values from {w.min():.4g} to {w.max():.4g}"
        )
    if layer_names is not None:
        names = _strings(layer_names, "layer_names")
    if names is None:
        names = [f"layer {i}" for i in range(w.shape[0])]
    if len(names) != w.shape[0]:
        raise ValueError(f"layer_names has {len(names)} names for {w.shape[0]} layers")
    return np.clip(w, 0.0, 1.0), names


def _strings(values: Any, name: str) -> list[str]:
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a sequence of strings, got {type(values).__name__}")
    return [str(v) for v in values]


def _json(data: Any) -> str:
    """JSON safe inside a <script> element."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _title(title: str | None) -> str:
    return f'<div class="ak-view-title">{html.escape(title)}</div>' if title else ""


def head_view_div(
    attention: Any,
    tokens: Sequence[str],
    target_tokens: Sequence[str] | None = None,
    *,
    layer_names: Sequence[str] | None = None,
    layer: int = 0,
    heads: Iterable[int] | None = None,
    title: str | None = None,
) -> str:
    """The head view of :func:`head_view` as one ``<div>``, without the script and style (add
    :func:`view_assets` once to the page)."""
    w, names = _layer_stack(attention, layer_names)
    n_layers, n_heads, m, n = w.shape
    left = _strings(tokens, "tokens")
    right = left if target_tokens is None else _strings(target_tokens, "target_tokens")
    if len(left) != m:
        raise ValueError(f"tokens has {len(left)} tokens for {m} queries (attention's M)")
    if len(right) != n:
        what = "target_tokens" if target_tokens is not None else "tokens (as keys)"
        raise ValueError(f"{what} has {len(right)} tokens for {n} keys (attention's N)")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise ValueError(f"layer must be an int in [0, {n_layers}), got {layer!r}")
    selected = list(range(n_heads)) if heads is None else list(heads)
    for h in selected:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < n_heads:
            raise ValueError(f"heads must hold ints in [0, {n_heads}), got {h!r}")
    data = {
        "layers": names,
        "heads": [str(h) for h in range(n_heads)],
        "left": left,
        "right": right,
        "weights": np.round(w, DECIMALS).tolist(),
        "layer": layer,
        "selected": sorted(set(selected)),
    }
    return (
        f'<div class="ak-view ak-head-view">{_title(title)}'
        f'<script type="application/json" class="ak-data">{_json(data)}</script></div>'
    )


def head_view(
    attention: Any,
    tokens: Sequence[str],
    target_tokens: Sequence[str] | None = None,
    *,
    layer_names: Sequence[str] | None = None,
    layer: int = 0,
    heads: Iterable[int] | None = None,
    title: str | None = None,
) -> str:
    """An HTML page with an interactive head view of attention weights (bertviz's head view):
    query tokens on the left, key tokens on the right, and for each selected head of the
    shown layer a line from query i to key j of opacity ``attention[layer, head, i, j]`` in
    the head's colour (exact zeros draw no line). A click on a head's button shows or hides
    it, a double click shows it alone; the layer menu switches layers; pointing at a token
    shows only its lines.

    Args:
        attention: weights in [0, 1], as (L, H, M, N), (H, M, N) or (M, N); or one array per
            layer, (H, M, N) or (1, H, M, N) (e.g. a Hugging Face model's ``attentions`` for
            one input), as a sequence or a mapping of layer name to weights (e.g. from
            :func:`attnkit.evaluation.capture`, one item of each record).
        tokens: the M query tokens; also the keys when ``target_tokens`` is None
            (self-attention, M = N).
        target_tokens: the N key tokens (cross-attention).
        layer_names: one name per layer (default: the mapping's keys, else "layer i").
        layer: the layer shown first.
        heads: the heads selected first (default: all).
        title: a line above the view and the page's title.

    Returns:
        The page as a string; it loads nothing from the network.
    """
    view = head_view_div(
        attention, tokens, target_tokens, layer_names=layer_names, layer=layer, heads=heads,
        title=title,
    )  # fmt: skip
    return _page(title, view)


def _colours(value: float, scale: float) -> str:
    """The style of a token of ``value`` in a row whose largest |value| is ``scale``."""
    alpha = 0.0 if scale == 0 else round(abs(value) / scale, 4)
    r, g, b = POSITIVE if value >= 0 else NEGATIVE
    text = "; color: #fff" if alpha > 0.6 else ""  # dark text is hard to read on deep colour
    return f"background-color: rgba({r}, {g}, {b}, {alpha}){text}"


def _format(value: float) -> str:
    return f"{value:.4g}"


def token_highlight_div(
    tokens: Sequence[str],
    scores: Any,
    *,
    gold: Any = None,
    title: str | None = None,
) -> str:
    """The token highlight of :func:`token_highlight` as one ``<div>`` (it needs no script;
    :func:`view_assets` gives its style)."""
    words = _strings(tokens, "tokens")
    rows = dict(scores) if isinstance(scores, Mapping) else {"score": scores}
    if not rows:
        raise ValueError("scores is an empty mapping; expected measure name -> (N,) values")
    arrays = {}
    for name, values in rows.items():
        label = "scores" if not isinstance(scores, Mapping) else f"scores[{name!r}]"
        a = _numbers(values, label)
        if a.ndim != 1 or a.shape[0] != len(words):
            raise ValueError(
                f"{label} must have one value per token, shape ({len(words)},), got "
                f"{tuple(a.shape)}"
            )
        arrays[str(name)] = a
    marks = np.zeros(len(words), dtype=bool)
    if gold is not None:
        g = np.asarray(gold.detach().cpu() if hasattr(gold, "detach") else gold)
        if g.shape != (len(words),):
            raise ValueError(f"gold must have shape ({len(words)},), got {g.shape}")
        marks = g.astype(bool)
    lines = []
    for name, a in arrays.items():
        scale = float(np.abs(a).max())
        spans = "".join(
            f'<span class="ak-tok{" ak-gold" if mark else ""}" data-value="{float(v)!r}" '
            f'title="{html.escape(word)}: {_format(float(v))}" '
            f'style="{_colours(float(v), scale)}">{html.escape(word)}</span>'
            for word, v, mark in zip(words, a, marks, strict=True)
        )
        lines.append(
            f'<div class="ak-token-row" data-name="{html.escape(name)}">'
            f'<span class="ak-row-name">{html.escape(name)}</span> {spans} '
            f'<span class="ak-legend">(largest |value| {_format(scale)})</span></div>'
        )
    legend = (
        "red: positive, blue: negative; the stronger the colour, the larger |value| against "
        "the row's largest" + ("; underlined: gold" if marks.any() else "")
    )
    return (
        f'<div class="ak-view ak-token-view">{_title(title)}{"".join(lines)}'
        f'<div class="ak-legend">{legend}</div></div>'
    )


def token_highlight(
    tokens: Sequence[str],
    scores: Any,
    *,
    gold: Any = None,
    title: str | None = None,
) -> str:
    """An HTML page with the tokens coloured by attribution scores, one row per measure (as
    captum's and inseq's text views): red for positive, blue for negative values, the colour's
    opacity ``|value| / max |value|`` of its row; the value shows when the pointer rests on a
    token.

    Args:
        tokens: the N tokens.
        scores: (N,) values, or a mapping of measure name to (N,) values (e.g. attention,
            gradient × input, erasure from :mod:`attnkit.evaluation`), each row scaled alone.
        gold: (N,) bool, tokens to underline (e.g. a gold rationale).
        title: a line above the view and the page's title.

    Returns:
        The page as a string; it loads nothing from the network.
    """
    return _page(title, token_highlight_div(tokens, scores, gold=gold, title=title))
