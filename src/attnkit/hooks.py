"""The core's capture hook: attention parts report their weights when someone is listening.

As Flax's ``sow``: a part that computes attention weights calls :func:`report` with them; nothing
is stored unless a :func:`listen` block is active, and then every part asks its kernel for the
weights (:func:`listening` is True), so parts whose caller did not request weights still have
them to report. Evaluation code (``attnkit.evaluation.capture``) builds on this; the core imports
nothing from evaluation.

Inside a :func:`listen` block a dot-product softmax call that would otherwise run on SDPA runs on
a kernel that returns weights (dense or chunked): the same attention, rounded differently
(≈1e-7 in float32).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["Report", "listen", "listening", "report"]


class Report(NamedTuple):
    """One reported weight tensor: the reporting module, what it calls the weights, the weights
    (detached)."""

    module: nn.Module
    name: str
    weights: Tensor


_SINK: ContextVar[Callable[[Report], None] | None] = ContextVar("attnkit_reports", default=None)


def listening() -> bool:
    """True inside :func:`listen`: attention parts then compute their weights. Code being
    compiled by ``torch.compile`` is never listened to (capture runs eagerly)."""
    if torch.compiler.is_compiling():
        return False
    return _SINK.get() is not None


def report(module: nn.Module, weights: Tensor | None, name: str = "weights") -> None:
    """Report ``weights`` computed by ``module`` (a no-op unless someone listens)."""
    if torch.compiler.is_compiling():
        return
    sink = _SINK.get()
    if sink is not None and weights is not None:
        sink(Report(module, name, weights.detach()))


@contextmanager
def listen(on_report: Callable[[Report], None] | None = None) -> Iterator[list[Report]]:
    """``with listen() as reports: model(x)`` collects every :class:`Report` made inside, in
    call order (or passes each to ``on_report`` as it is made, and the list stays empty).
    Blocks nest: an inner block receives the reports made inside it."""
    reports: list[Report] = []
    token = _SINK.set(reports.append if on_report is None else on_report)
    try:
        yield reports
    finally:
        _SINK.reset(token)
