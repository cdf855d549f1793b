"""Record every attention module's weights during a forward pass, by module name."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from torch import Tensor, nn

__all__ = ["capture", "weights_forced"]

_FORCE = ContextVar("attnkit_force_weights", default=False)


def weights_forced() -> bool:
    """True inside :func:`capture`: attention modules then compute their weights."""
    return _FORCE.get()


@contextmanager
def capture(model: nn.Module) -> Iterator[dict[str, list[Tensor]]]:
    """``with capture(model) as records: model(x)`` fills ``records[name]`` with the weights of
    each call of every :class:`attnkit.Attention` and :class:`attnkit.MultiHeadAttention` in
    ``model`` (one entry per call, e.g. per decoding step), detached. Weights are computed even
    when the model's code does not ask for them.
    """
    from attnkit.attention import Attention
    from attnkit.multihead import MultiHeadAttention

    records: dict[str, list[Tensor]] = {}
    handles = []

    def recorder(key: str):
        def hook(mod, args, output):
            if getattr(output, "weights", None) is not None:
                records[key].append(output.weights.detach())

        return hook

    for name, module in model.named_modules():
        if isinstance(module, (Attention, MultiHeadAttention)):
            key = name or type(module).__name__
            records[key] = []
            handles.append(module.register_forward_hook(recorder(key)))
    token = _FORCE.set(True)
    try:
        yield records
    finally:
        _FORCE.reset(token)
        for h in handles:
            h.remove()
