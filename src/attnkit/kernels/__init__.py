"""How attention is evaluated: kernels as registered parts (dense reference, SDPA dispatch,
chunked exact attention, FlexAttention on request). ``available()`` lists them by priority;
``get(name)`` returns one; ``select(call, kernel=None)`` picks the kernel that
:func:`attnkit.attention` runs and ``explain(q, k, v, ...)`` says which one it is, which of its
paths (:class:`Path`) evaluates the call, and why every other kernel and path is not."""

from attnkit.kernels import base, block_mask, chunked, dense, explanation, flex, paths, sdpa
from attnkit.kernels.base import (
    REGISTRY,
    Call,
    Capabilities,
    Kernel,
    available,
    get,
    register,
    select,
)
from attnkit.kernels.block_mask import BlockMask
from attnkit.kernels.explanation import Explanation, Verdict, explain
from attnkit.kernels.paths import Path

__all__ = [
    "REGISTRY",
    "BlockMask",
    "Call",
    "Capabilities",
    "Explanation",
    "Kernel",
    "Path",
    "Verdict",
    "available",
    "base",
    "block_mask",
    "chunked",
    "dense",
    "explain",
    "explanation",
    "flex",
    "get",
    "paths",
    "register",
    "sdpa",
    "select",
]
