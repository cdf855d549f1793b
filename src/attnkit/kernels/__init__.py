"""How attention is evaluated: kernels as registered parts (dense reference, SDPA dispatch,
chunked exact attention, FlexAttention on request). ``available()`` lists them by priority;
``get(name)`` returns one; ``select(call, kernel=None)`` picks the kernel that
:func:`attnkit.attention` runs and ``explain(q, k, v, ...)`` says which one it is and why every
other kernel is not."""

from attnkit.kernels import base, block_mask, chunked, dense, explanation, flex, sdpa
from attnkit.kernels.base import REGISTRY, Call, Kernel, available, get, register, select
from attnkit.kernels.block_mask import BlockMask
from attnkit.kernels.explanation import Explanation, Verdict, explain

__all__ = [
    "REGISTRY",
    "BlockMask",
    "Call",
    "Explanation",
    "Kernel",
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
    "register",
    "sdpa",
    "select",
]
