"""Validate at the door, trust inside (DESIGN 8): a public entry point that has validated its
inputs and built everything below it from them marks the calls it makes as trusted, and the
inner public entry points then skip the checks that the door already made (the dtype and device
of every parameter, shapes that hold by construction). User errors are still reported, once, at
the outermost entry.

A decoding step through :class:`attnkit.models.decoder_lm.DecoderLM` crosses four layers of
multi-head attention, each of which would otherwise check its parameters and its per-head
attention call again for every token.

A door may also state that its inputs are finite (``trusted(finite=True)``: a model's own
activations, made from token ids it checked, hold no NaN or infinity, padding included). The
attention calls below then neither look for non-finite values at masked positions nor clear
them (:func:`inputs_finite`); without that statement a masked position's content is excluded by
construction (see :func:`attnkit.core.prepare_call`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["inputs_finite", "is_trusted", "trusted"]

_TRUSTED: ContextVar[bool] = ContextVar("attnkit_trusted", default=False)
_FINITE: ContextVar[bool] = ContextVar("attnkit_inputs_finite", default=False)


def is_trusted() -> bool:
    """True inside :func:`trusted`: the caller has validated what it passes down. False while
    ``torch.compile`` traces (the checks then run once, at tracing, and cost nothing after)."""
    if torch.compiler.is_compiling():
        return False
    return _TRUSTED.get()


def inputs_finite() -> bool:
    """True inside ``trusted(finite=True)``: the door that opened it stated that the tensors
    passed down hold no NaN or infinity (masked positions included)."""
    if torch.compiler.is_compiling():
        return False
    return _FINITE.get()


@contextmanager
def trusted(*, finite: bool | None = None) -> Iterator[None]:
    """Mark the calls made inside as coming from a validated entry point.

    Args:
        finite: True states that the inputs below are finite everywhere (see
            :func:`inputs_finite`); False withdraws an enclosing statement; None (the default)
            keeps what the enclosing context says.

    Raises:
        TypeError: ``finite`` is not a bool or None.
    """
    if finite is not None and not isinstance(finite, bool):
        raise TypeError(f"finite must be a bool or None, got {finite!r}")
    if torch.compiler.is_compiling():
        yield
        return
    token = _TRUSTED.set(True)
    finite_token = None if finite is None else _FINITE.set(finite)
    try:
        yield
    finally:
        if finite_token is not None:
            _FINITE.reset(finite_token)
        _TRUSTED.reset(token)
