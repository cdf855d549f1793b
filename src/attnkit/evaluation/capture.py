"""Record the attention weights of every part of a model during a forward pass, by module name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from attnkit import hooks

__all__ = ["capture", "weights_forced"]


def weights_forced() -> bool:
    """True inside :func:`capture` (see :func:`attnkit.hooks.listening`)."""
    return hooks.listening()


@contextmanager
def capture(model: nn.Module) -> Iterator[dict[str, list[Tensor]]]:
    """``with capture(model) as records: model(x)`` fills ``records[name]`` with the weights that
    each attention part inside ``model`` reports (through :mod:`attnkit.hooks`), one entry per
    call (e.g. per decoding step), detached. Weights are computed even when the model's code does
    not ask for them. A part that reports several named weight tensors (e.g. both directions of
    co-attention) appears as ``"name.weights_name"``; parts outside ``model`` are ignored.
    """
    names = {id(module): name or type(module).__name__ for name, module in model.named_modules()}
    records: dict[str, list[Tensor]] = {}

    def keep(rep: hooks.Report) -> None:
        name = names.get(id(rep.module))
        if name is not None:
            key = name if rep.name == "weights" else f"{name}.{rep.name}"
            records.setdefault(key, []).append(rep.weights)

    with hooks.listen(keep):
        yield records
