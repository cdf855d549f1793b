"""Deprecated: what a caller knows about an attention call is stated in the call itself.

A layer that validated its inputs at its door calls its per-head part with ``checked=True``; a
layer whose inputs are finite everywhere (``MultiHeadAttention.inputs_finite``, set by
:class:`attnkit.models.decoder_lm.DecoderLM`) adds ``finite=True``; a part that declares
``takes_facts`` receives both in :meth:`attnkit.HeadAttention.attend`, and
:func:`attnkit.kernels.prepare.prepare_call` takes them as keywords (see
:class:`attnkit.HeadAttention` and :mod:`attnkit.call_plan`). No ambient state remains.
"""

from __future__ import annotations

__all__ = ["inputs_finite"]


def inputs_finite() -> bool:
    """False: no caller states finiteness outside its call any more. Code that asks here
    takes its ``finite`` keyword instead (``takes_facts``), or scans the keys itself."""
    return False
