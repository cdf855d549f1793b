"""The uniform-weights ablation (Brauwers 4.1): replace every attention distribution by the
uniform average over the attendable keys and measure how much the task metric drops."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from attnkit.alignments import Alignment, Uniform

__all__ = ["uniform_weights"]


@contextmanager
def uniform_weights(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, every alignment part of ``model`` aligns uniformly: each submodule
    registered as ``align`` that is an :class:`attnkit.alignments.Alignment` (in
    :class:`attnkit.Attention`, and in mechanisms that hold their own alignment, such as parallel
    co-attention). The original alignments are restored afterwards, even on error."""
    saved = []
    for module in model.modules():
        align = module._modules.get("align")
        if isinstance(align, Alignment) and not isinstance(align, Uniform):
            saved.append((module, align))
            module.align = Uniform()
    try:
        yield model
    finally:
        for module, align in saved:
            module.align = align
