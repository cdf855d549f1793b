"""Hard (stochastic) alignment (Brauwers eq. 26; Xu et al.; Galassi eqs. 10-11)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments, inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import (
    REGISTRY,
    Alignment,
    AlignOutput,
    masked_log_softmax,
    masked_softmax,
)
from attnkit.sizing import example_sizes

__all__ = ["Hard"]


def _gumbel_like(x: Tensor) -> Tensor:
    u = torch.rand_like(x).clamp_(torch.finfo(x.dtype).tiny, 1.0)
    return -torch.log(-torch.log(u))


@REGISTRY.register("hard")
class Hard(Alignment):
    """Pick one key m ~ Multinoulli(softmax(e)) and put all weight on it, so c = v_m (eq. 26).

    In training mode the key is sampled (by the Gumbel-max trick, an exact sample); in eval mode
    the most probable key is taken unless ``sample_in_eval``. ``log_prob`` (…, M) is log a_m, the
    term of the REINFORCE (score-function) estimator.

    With ``straight_through=True`` the forward pass is the same one-hot choice, but gradients flow
    through the Gumbel-softmax relaxation with temperature ``tau`` (Jang et al.).

    A row whose attendable scores hold NaN (or +inf, where softmax is undefined) gets NaN weights
    and a NaN ``log_prob``: the choice is undefined, and a finite one-hot would hide the NaN.
    """

    stochastic: ClassVar[bool] = True
    label = tx.AlignmentKind.HARD

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Alignment]:
        """The sampled one-hot, and its straight-through form at τ = 0.5."""
        s = example_sizes(cls.example_sizes, **sizes).for_heads()
        straight = cls.for_heads(**s, straight_through=True, tau=0.5)
        return {"": cls.example(**sizes), "straight-through": straight}

    def __init__(
        self, *, straight_through: bool = False, tau: float = 1.0, sample_in_eval: bool = False
    ) -> None:
        super().__init__()
        self.straight_through = arguments.boolean(straight_through, "straight_through")
        self.tau = arguments.finite_float(tau, "tau", positive=True)
        self.sample_in_eval = arguments.boolean(sample_in_eval, "sample_in_eval")

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        scores = inputs.alignment_inputs(self, scores, mask)
        log_p = masked_log_softmax(scores, mask)
        sample = self.training or self.sample_in_eval
        perturbed = log_p + _gumbel_like(log_p) if sample else log_p
        index = perturbed.argmax(dim=-1, keepdim=True)
        weights = torch.zeros_like(log_p).scatter_(-1, index, 1.0)
        log_prob = log_p.gather(-1, index).squeeze(-1)
        if mask is not None:
            any_key = mask.any(dim=-1)
            weights = weights * any_key.unsqueeze(-1)
            log_prob = torch.where(any_key, log_prob, torch.zeros((), dtype=log_prob.dtype))
        if self.straight_through:
            relaxed = masked_softmax(perturbed / self.tau, mask)
            weights = weights + relaxed - relaxed.detach()
        undefined = log_p.isnan().any(dim=-1)  # masked keys are −inf in log_p, never NaN
        nan = torch.full((), float("nan"), dtype=weights.dtype)
        weights = torch.where(undefined.unsqueeze(-1), nan, weights)
        log_prob = torch.where(undefined, nan, log_prob)
        return AlignOutput(weights, log_prob)
