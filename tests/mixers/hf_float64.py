"""Running a transformers module's torch path in float64 throughout.

The torch paths of transformers' recurrent mixers cast their inputs to float32 on the way (the
gated norms, Mamba-2's SSD scan, Qwen3-Next's delta rule), whatever the input's dtype, so a
float64 comparison would stop at float32 precision. :func:`widened` lets one module file run
with those casts widened: ``torch.float32`` read through the module's ``torch`` is float64, and
``Tensor.float()`` keeps float64. Nothing else in the module changes, so the reference is the same
computation in float64; the tests also compare with the module as it is at float32 tolerance.
"""

import contextlib
import types

import torch


class _Torch(types.ModuleType):
    """torch, except that float32 is float64."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str):
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@contextlib.contextmanager
def widened(*modules: types.ModuleType):
    """Within the block, the given transformers module files compute in float64."""
    saved = [m.torch for m in modules]
    original = torch.Tensor.float

    def wide(self, *args, **kwargs):
        return self.to(torch.promote_types(self.dtype, torch.float32))

    try:
        for m in modules:
            m.torch = _Torch()
        torch.Tensor.float = wide
        yield
    finally:
        torch.Tensor.float = original
        for m, t in zip(modules, saved, strict=True):
            m.torch = t
