"""Validate at the door, trust inside (DESIGN 8): a public entry point that has validated its
inputs and built everything below it from them marks the calls it makes as trusted, and the
inner public entry points then skip the checks that the door already made (the dtype and device
of every parameter, shapes that hold by construction). User errors are still reported, once, at
the outermost entry.

A decoding step through :class:`attnkit.models.decoder_lm.DecoderLM` crosses four layers of
multi-head attention, each of which would otherwise check its parameters and its per-head
attention call again for every token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["is_trusted", "trusted"]

_TRUSTED: ContextVar[bool] = ContextVar("attnkit_trusted", default=False)


def is_trusted() -> bool:
    """True inside :func:`trusted`: the caller has validated what it passes down. False while
    ``torch.compile`` traces (the checks then run once, at tracing, and cost nothing after)."""
    if torch.compiler.is_compiling():
        return False
    return _TRUSTED.get()


@contextmanager
def trusted() -> Iterator[None]:
    """Mark the calls made inside as coming from a validated entry point."""
    if torch.compiler.is_compiling():
        yield
        return
    token = _TRUSTED.set(True)
    try:
        yield
    finally:
        _TRUSTED.reset(token)
