"""Structured attention (Kim et al. 2017; Galassi IV-C): linear-chain CRF marginals as weights.

Each key l carries a binary variable z_l (selected or not). The scores are the unary potentials,
θ_l(1) = e_l and θ_l(0) = 0, and a 2 × 2 pairwise potential W[z_l, z_{l+1}] couples neighbours:

    p(z) ∝ exp(Σ_l θ_l(z_l) + Σ_l W[z_l, z_{l+1}]),

and the weight of key l is the marginal a_l = p(z_l = 1) (Kim et al.'s segmentation attention),
computed exactly by the forward-backward algorithm in log space. With W = 0 the variables are
independent and a_l = σ(e_l) (the sigmoid alignment). Galassi calls the weights "(normalized)
marginals": ``normalize=True`` divides them by their sum.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, masked_softmax
from attnkit.sizing import example_sizes

__all__ = ["Structured", "chain_marginals"]


def _step(carry: Tensor, w: Tensor) -> Tensor:
    """(…, 2): log Σ_{z'} exp(carry[z'] + W[z', z]) for each z."""
    return torch.logsumexp(carry.unsqueeze(-1) + w, dim=-2)


def _step_back(carry: Tensor, w: Tensor) -> Tensor:
    """(…, 2): log Σ_{z'} exp(W[z, z'] + carry[z']) for each z."""
    return torch.logsumexp(w + carry.unsqueeze(-2), dim=-1)


def _forward_backward(
    unary: Tensor, pairwise: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(alpha_l(1) + beta_l(1) (…, N), log Z (…, 1), allowed (…, N)) of the chain."""
    n = unary.shape[-1]
    allowed = (
        torch.ones(unary.shape, dtype=torch.bool, device=unary.device)
        if mask is None
        else mask.expand(unary.shape)
    )
    zero = torch.zeros((), dtype=unary.dtype, device=unary.device)
    # A masked score may be NaN or ±inf: it must not reach the recursions.
    e = torch.where(allowed, unary, zero)
    theta = torch.stack([torch.zeros_like(e), e], dim=-1)  # (…, N, 2)
    w = pairwise.to(unary.dtype)
    keep = allowed.unsqueeze(-1)  # (…, N, 1)

    # alpha_l(z): log-sum over the chain up to l of every potential, with z_l = z.
    alphas = []
    carry = torch.zeros_like(theta[..., 0, :])
    started = torch.zeros_like(keep[..., 0, :])
    for i in range(n):
        a = torch.where(started, _step(carry, w), zero) + theta[..., i, :]
        alphas.append(a)
        carry = torch.where(keep[..., i, :], a, carry)
        started = started | keep[..., i, :]
    log_z = torch.where(started, torch.logsumexp(carry, dim=-1, keepdim=True), zero)

    # beta_l(z): log-sum over the chain after l, given z_l = z (θ_l excluded).
    betas: list[Tensor] = [zero] * n
    carry = torch.zeros_like(theta[..., 0, :])
    started = torch.zeros_like(keep[..., 0, :])
    for i in reversed(range(n)):
        b = torch.where(started, _step_back(carry, w), zero)
        betas[i] = b
        carry = torch.where(keep[..., i, :], theta[..., i, :] + b, carry)
        started = started | keep[..., i, :]

    alpha1 = torch.stack([a[..., 1] for a in alphas], dim=-1)
    beta1 = torch.stack([b[..., 1] for b in betas], dim=-1)
    return alpha1 + beta1, log_z, allowed


def chain_marginals(unary: Tensor, pairwise: Tensor, mask: Tensor | None = None) -> Tensor:
    """p(z_l = 1) of a binary linear-chain CRF, by forward-backward in log space.

    Args:
        unary: (…, N) potentials θ_l(1) (θ_l(0) = 0).
        pairwise: (2, 2) potentials W[z_l, z_next] between consecutive keys.
        mask: boolean, broadcastable to ``unary``; a masked key is removed from the chain (its
            neighbours become consecutive) and gets marginal 0.

    Returns:
        (…, N) marginals in [0, 1]; rows with no key are 0.
    """
    joint, log_z, allowed = _forward_backward(unary, pairwise, mask)
    # At huge potentials the exponent carries rounding of their size: keep the result in [0, 1].
    marg = torch.exp(joint - log_z).clamp(0.0, 1.0)
    return torch.where(allowed, marg, torch.zeros((), dtype=marg.dtype, device=marg.device))


@REGISTRY.register("structured")
class Structured(Alignment):
    """a_l = p(z_l = 1 | e) of a binary linear-chain CRF with unary potentials e (Kim et al.).

    Args:
        pairwise: the 2 × 2 pairwise potential W[z_l, z_{l+1}] (rows: z_l = 0, 1), fixed when
            given; default: learned, starting at 0 (independent keys, a = σ(e)).
        learnable: learn W (default True when ``pairwise`` is None, False when it is given;
            a given W with ``learnable=True`` is the starting value).
        normalize: divide the marginals by their sum over the keys (Galassi's "normalized
            marginals"); the weights then sum to 1.
        device, dtype: of W.

    Masked keys are removed from the chain: their neighbours become consecutive, and they get
    weight 0. The weights depend on the order of the keys (``position_based``).
    """

    position_based: ClassVar[bool] = True
    label = tx.AlignmentKind.SIGMOID

    @classmethod
    def example(cls, **sizes: int | None) -> Alignment:
        """Two states with a learned 2 × 2 pairwise potential."""
        pairwise = torch.tensor([[0.3, -0.5], [-0.2, 0.6]])
        s = example_sizes(cls.example_sizes, **sizes).for_heads()
        return cls.for_heads(**s, pairwise=pairwise)

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Alignment]:
        """The example, and the normalized form."""
        s = example_sizes(cls.example_sizes, **sizes).for_heads()
        return {"": cls.example(**sizes), "normalized": cls.for_heads(**s, normalize=True)}

    def __init__(
        self,
        pairwise: Tensor | None = None,
        *,
        learnable: bool | None = None,
        normalize: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if learnable is not None and not isinstance(learnable, bool):
            raise TypeError(f"learnable must be a bool or None, got {learnable!r}")
        if not isinstance(normalize, bool):
            raise TypeError(f"normalize must be a bool, got {normalize!r}")
        if pairwise is None:
            if learnable is False:
                raise ValueError("learnable=False needs a given pairwise potential (2, 2)")
            w = torch.zeros(2, 2, device=device, dtype=dtype)
            learnable = True
        else:
            if not isinstance(pairwise, Tensor) or not pairwise.dtype.is_floating_point:
                raise TypeError(f"pairwise must be a floating tensor (2, 2), got {pairwise!r}")
            if tuple(pairwise.shape) != (2, 2):
                raise ValueError(
                    f"pairwise must have shape (2, 2) (z_l, z_next), got {tuple(pairwise.shape)}"
                )
            if not bool(torch.isfinite(pairwise).all()):
                raise ValueError("pairwise must be finite")
            w = pairwise.detach().clone().to(device=device, dtype=dtype or pairwise.dtype)
            learnable = bool(learnable)
        if learnable:
            self.pairwise = nn.Parameter(w)
        else:
            self.register_buffer("pairwise", w)
        self.normalize = normalize
        self.normalized = normalize
        if normalize:
            self.label = tx.AlignmentKind.SOFT

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        """Weights (…, M, N) from scores (…, M, N) (one chain per query row)."""
        scores = inputs.alignment_inputs(self, scores, mask)
        if not self.normalize:
            return AlignOutput(chain_marginals(scores, self.pairwise, mask))
        # p(z_l = 1) ∝ exp(alpha_l(1) + beta_l(1)): normalising is a softmax of these (log Z
        # cancels), which stays on the simplex even where every marginal underflows.
        joint, _, _ = _forward_backward(scores, self.pairwise, mask)
        return AlignOutput(masked_softmax(joint, mask))
