"""The alignment-function interface (Brauwers eq. 3: a_l = align(e_l; e)) and its registry."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.alignments.streaming import Streaming
from attnkit.registry import Registry
from attnkit.sizing import Sized

__all__ = [
    "REGISTRY",
    "AlignOutput",
    "Alignment",
    "centered",
    "masked_log_softmax",
    "masked_softmax",
]


class AlignOutput(NamedTuple):
    """Weights (…, M, N) and, for stochastic alignments, log-probability (…, M) of the sample."""

    weights: Tensor
    log_prob: Tensor | None = None


REGISTRY: Registry[Alignment] = Registry("alignment")


def has_key(mask: Tensor | None) -> Tensor | None:
    """(…, M, 1): whether each row may attend at least one key."""
    return None if mask is None else mask.any(dim=-1, keepdim=True)


def _masked_scores(scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Scores with −inf at masked keys, and rows with no key reset to 0 so nothing is NaN."""
    any_key = mask.any(dim=-1, keepdim=True)
    filled = scores.masked_fill(~mask, float("-inf"))
    return torch.where(any_key, filled, torch.zeros((), dtype=scores.dtype)), any_key


def centered(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Scores minus their (detached) row maximum over the keys ``mask`` allows.

    Softmax ignores a constant added to a row; subtracting the maximum before a bias is added or
    a temperature divides keeps the row's differences exact at any offset (at 1e4 in float32 the
    spacing of the floats is 1e-3, which a bias added there would round to). Rows whose maximum
    is not finite (NaN, ±inf, no key) are left as they are.
    """
    filled = scores if mask is None else scores.masked_fill(~mask, float("-inf"))
    top = filled.amax(dim=-1, keepdim=True).detach()
    return scores - torch.where(torch.isfinite(top), top, torch.zeros((), dtype=top.dtype))


def masked_softmax(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax over the last dim (Brauwers eq. 25) restricted to ``mask``; rows with no key -> 0."""
    if mask is None:
        return torch.softmax(scores, dim=-1)
    filled, any_key = _masked_scores(scores, mask)
    return torch.softmax(filled, dim=-1) * any_key


def masked_log_softmax(scores: Tensor, mask: Tensor | None) -> Tensor:
    """log softmax restricted to ``mask``; −inf at masked keys; rows with no key are all −inf."""
    if mask is None:
        return torch.log_softmax(scores, dim=-1)
    filled, any_key = _masked_scores(scores, mask)
    return torch.log_softmax(filled, dim=-1).masked_fill(~(mask & any_key), float("-inf"))


class Alignment(Sized, nn.Module):
    """An alignment (distribution) function over the last dimension of the scores (…, M, N).

    ``forward(scores, mask=None, *, query=None) -> AlignOutput``. ``mask`` is boolean (True = may
    attend) and broadcastable to the scores; rows with no key get weight 0. ``query`` (…, M, d_q)
    is passed for alignments that use it (predictive local alignment, eq. 28).

    Capabilities, read by kernels and tests:

    - ``normalized``: each row with at least one key sums to 1.
    - ``stochastic``: samples in training mode and returns ``log_prob`` for REINFORCE.
    - ``streamable``: can be evaluated block by block over keys (chunked kernels): it
      implements the streaming protocol (:mod:`attnkit.alignments.streaming`) and this instance
      has no reason not to stream (e.g. a learned α).
    - ``position_based``: depends on key positions (not invariant to permuting keys).
    - ``query_position_based``: takes row m of the scores to be the query at position m (a
      distance |m − n|, p_t = t), which a decoding step with a KV cache, whose queries sit
      after the cached keys, does not satisfy.

    Built at given sizes by ``for_heads(head_dim, num_heads, **overrides)``
    (:class:`attnkit.sizing.Sized`): an alignment without parameters takes none; one that reads
    the query (a predicted position, temperature or window) declares ``size_arguments`` (its
    query size is ``head_dim``). ``example()`` and ``examples()`` give the small instances the
    contract tests run.
    """

    part_kind: ClassVar[str] = "alignment"

    label: ClassVar[tx.AlignmentKind]
    normalized: bool = True
    stochastic: ClassVar[bool] = False
    position_based: ClassVar[bool] = False
    query_position_based: ClassVar[bool] = False

    def taxonomy_tags(self) -> list:
        return [self.label]

    @property
    def streamable(self) -> bool:
        return isinstance(self, Streaming) and not self.stream_reasons()

    def softmax_temperature(self) -> float | None:
        """The constant τ when this alignment is exactly softmax(e/τ) (eq. 25), else None.

        Read by kernels that implement softmax themselves (SDPA)."""
        return None

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        raise NotImplementedError
