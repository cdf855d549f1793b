"""The uniform-weights ablation (Brauwers 4.1): replace every attention distribution by the
uniform average over the attendable keys and measure how much the task metric drops."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from attnkit.alignments import Uniform

__all__ = ["uniform_weights"]


@contextmanager
def uniform_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every :class:`attnkit.Attention` / :class:`attnkit.MultiHeadAttention`
    of ``model`` aligns uniformly; the original alignments are restored afterwards, even on
    error."""
    from attnkit.attention import Attention
    from attnkit.multihead import MultiHeadAttention

    saved = []
    for module in model.modules():
        if isinstance(module, (Attention, MultiHeadAttention)):
            saved.append((module, module.align))
            module.align = Uniform()
    try:
        yield model
    finally:
        for module, align in saved:
            module.align = align
