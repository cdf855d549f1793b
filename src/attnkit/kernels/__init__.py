"""How attention is evaluated: kernels as registered parts (dense reference, SDPA dispatch,
chunked exact attention). ``available()`` lists them by priority; ``get(name)`` returns one;
``select(call, kernel=None)`` picks the kernel that :func:`attnkit.attention` runs."""

from attnkit.kernels import base, block_mask, chunked, dense, sdpa
from attnkit.kernels.base import Call, Kernel, available, get, register, select
from attnkit.kernels.block_mask import BlockMask

__all__ = [
    "BlockMask",
    "Call",
    "Kernel",
    "available",
    "base",
    "block_mask",
    "chunked",
    "dense",
    "get",
    "register",
    "sdpa",
    "select",
]
