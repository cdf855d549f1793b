"""Constrained distributions: softmax and sparsemax with per-key upper bounds (Galassi IV-C, V-C).

Both solve a projection onto the capped simplex {a : Σ_l a_l = 1, 0 ≤ a_l ≤ u_l}:

- constrained softmax (Martins & Kreutzer 2017): argmin KL(a ‖ softmax(e)); the solution is
  a_l = min(u_l, exp(e_l − τ)) with τ such that the weights sum to 1;
- constrained sparsemax (Malaviya et al. 2018): argmin ‖a − e‖²; the solution is
  a_l = clip(e_l − τ, 0, u_l).

Typical bounds are fertility budgets minus the attention a key has already received (coverage:
u = fertility − Σ_{t' < t} a_{t'}), so that no source word is attended more than its budget
over a whole decoding. The bounds come with each call (``upper=``) or, as one number for every
key, with the module. Bounds above 1 are loose (no weight exceeds 1); a row whose bounds sum to
less than 1 has no solution and is refused.

τ is located by bisection on the row sum (monotone in τ), then the weights are computed in
closed form on the saturated / free sets found there, so gradients (with respect to the scores
and the bounds) are those of the exact solution.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit import inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, masked_softmax
from attnkit.alignments.streaming import Streaming, Tiles

__all__ = ["ConstrainedSoftmax", "ConstrainedSparsemax"]

# Bisection halvings of the bracket of τ: enough to reach float64 resolution from any bracket
# the shifted scores give.
_STEPS = 100
# Streaming: each sweep over the key blocks evaluates the row sum at _POINTS values of τ and
# shrinks the bracket (_POINTS + 1)-fold; _SWEEPS sweeps reach float64 resolution.
_POINTS = 15
_SWEEPS = 24


def _check_upper(upper: object, name: str = "upper") -> float | None:
    if upper is None:
        return None
    if isinstance(upper, bool) or not isinstance(upper, (int, float)):
        raise TypeError(f"{name} must be a number or None, got {type(upper).__name__}")
    if not upper > 0 or math.isnan(upper):
        raise ValueError(f"{name} must be > 0 (math.inf for no bound), got {upper!r}")
    return float(upper)


def _infeasible(budget: Tensor, short: Tensor) -> ValueError:
    return ValueError(
        f"the upper bounds of the keys a row may attend sum to "
        f"{float(budget.detach()[short].min()):.6g} < 1 in {int(short.sum())} row(s): "
        f"no distribution respects them"
    )


class _Constrained(Streaming, Alignment):
    """Shared validation, shifting and feasibility; subclasses solve a shifted, bounded row.

    Streaming (chunked kernels, with the module's bound for every key): the statistic is the
    row maximum m, the threshold τ_s that decides which keys are saturated and the τ_f of the
    free keys, found by a multi-point bisection whose row sums are accumulated over key blocks,
    then one sweep for the closed form on the sets, as the dense path does.
    """

    def __init__(self, upper: float | None = None) -> None:
        super().__init__()
        self.upper = _check_upper(upper)

    def extra_repr(self) -> str:
        return f"upper={self.upper}"

    def _bounds(self, upper: object, scores: Tensor) -> Tensor | None:
        """Per-key bounds (…, M, N) in the working dtype, capped at 1; None: no bound at all."""
        if upper is None:
            if self.upper is None:
                return None
            upper = self.upper
        if isinstance(upper, (int, float)) and not isinstance(upper, bool):
            upper = _check_upper(upper)
            return torch.full(
                scores.shape, min(float(upper), 1.0), dtype=scores.dtype, device=scores.device
            )
        if not isinstance(upper, Tensor) or not upper.dtype.is_floating_point:
            raise TypeError(
                f"upper must be a number or a floating tensor broadcastable to the scores "
                f"{tuple(scores.shape)}, got {upper!r}"
            )
        if upper.device != scores.device:
            raise ValueError(f"upper is on {upper.device} but the scores are on {scores.device}")
        if not inputs.broadcasts_to(upper.shape, tuple(scores.shape)):
            raise ValueError(
                f"upper of shape {tuple(upper.shape)} does not broadcast to the scores "
                f"{tuple(scores.shape)}"
            )
        if bool(torch.isnan(upper).any()) or bool((upper < 0).any()):
            raise ValueError("upper must be >= 0 and not NaN (math.inf for no bound)")
        return upper.to(scores.dtype).clamp(max=1.0).expand(scores.shape)

    def _solve(self, z: Tensor, u: Tensor, allowed: Tensor) -> Tensor:
        raise NotImplementedError

    def _unbounded(self, scores: Tensor, mask: Tensor | None) -> Tensor | None:
        """The weights when no key has a bound (None: solve with bounds of 1)."""
        return None

    def forward(
        self,
        scores: Tensor,
        mask: Tensor | None = None,
        *,
        query: Tensor | None = None,
        upper: Tensor | float | None = None,
    ) -> AlignOutput:
        """Weights (…, M, N) from scores (…, M, N).

        Args:
            scores: (…, M, N).
            mask: boolean, broadcastable to the scores, True = may attend.
            query: unused.
            upper: the bounds u, ≥ 0, a number or a tensor broadcastable to (…, M, N)
                (``math.inf``: no bound); default the module's ``upper``.
        """
        scores = inputs.alignment_inputs(self, scores, mask)
        # Half precision has too few digits for the search of τ: work in float32.
        work = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
        u = self._bounds(upper, work)
        if u is None:
            plain = self._unbounded(work, mask)
            if plain is not None:
                return AlignOutput(plain.to(scores.dtype))
            u = torch.ones(work.shape, dtype=work.dtype, device=work.device)
        allowed = torch.ones_like(work, dtype=torch.bool) if mask is None else mask.expand_as(work)
        any_key = allowed.any(dim=-1, keepdim=True)
        zero = torch.zeros((), dtype=work.dtype, device=work.device)
        budget = torch.where(allowed, u, zero).sum(dim=-1, keepdim=True)
        slack = math.sqrt(torch.finfo(work.dtype).eps)
        short = any_key & (budget.detach() < 1 - slack)
        if bool(short.any()):
            raise _infeasible(budget, short)
        # Both maps ignore a constant added to a row: subtract the (detached) row maximum so
        # every quantity stays O(1) at any logit magnitude.
        top = torch.where(allowed, work, torch.full((), float("-inf"), dtype=work.dtype))
        top = top.amax(dim=-1, keepdim=True).detach()
        top = torch.where(torch.isfinite(top), top, zero)
        z = torch.where(allowed, work - top, zero)
        # A NaN among a row's allowed scores makes the row NaN, as softmax does.
        broken = torch.isnan(z).any(dim=-1, keepdim=True)
        z = torch.where(broken, zero, z)
        weights = self._solve(z, u, allowed & any_key)
        weights = torch.where(broken, torch.full((), float("nan"), dtype=work.dtype), weights)
        weights = torch.where(allowed, weights, zero)
        return AlignOutput(weights.to(scores.dtype))

    # ---- streaming protocol: stat = (m, τ_s, τ_f) ---------------------------------------------

    def _scalar_bound(self) -> float:
        return 1.0 if self.upper is None else min(self.upper, 1.0)

    def _bracket(self, low: Tensor, count: Tensor, u: float) -> tuple[Tensor, Tensor]:
        """lo, hi of τ for rows whose smallest shifted score is ``low``."""
        raise NotImplementedError

    def _mass(self, z: Tensor, tau: Tensor, u: float) -> Tensor:
        """Each key's weight at the threshold τ (before the closed form); 0 where z = −inf."""
        raise NotImplementedError

    def _sets(self, z: Tensor, tau_s: Tensor, u: float) -> tuple[Tensor, Tensor]:
        """(saturated, free) keys at the threshold τ_s."""
        raise NotImplementedError

    def _free_part(self, z: Tensor, free: Tensor) -> Tensor:
        """What the free keys contribute to the closed form of τ_f (a row sum)."""
        raise NotImplementedError

    def _tau_free(self, part: Tensor, n_free: Tensor, mass: Tensor) -> Tensor:
        raise NotImplementedError

    def _free_weight(self, z: Tensor, tau_f: Tensor, u: float) -> Tensor:
        """The weight of a key that is not saturated; 0 where z = −inf."""
        raise NotImplementedError

    def stream_statistic(self, tiles: Tiles) -> Tensor:
        u = self._scalar_bound()
        top = low = count = None
        for e in tiles():
            finite = torch.isfinite(e)
            inf = torch.full((), float("inf"), dtype=e.dtype)
            blk = (
                e.amax(dim=-1, keepdim=True),
                torch.where(finite, e, inf).amin(dim=-1, keepdim=True),
                finite.sum(dim=-1, keepdim=True, dtype=e.dtype),
            )
            if top is None:
                top, low, count = blk
            else:
                top, low = torch.maximum(top, blk[0]), torch.minimum(low, blk[1])
                count = count + blk[2]
        assert top is not None and low is not None and count is not None
        zero = torch.zeros((), dtype=top.dtype)
        any_key = count > 0
        broken = torch.isnan(top)  # a NaN among the row's scores: the row is NaN, as in softmax
        top = torch.where(torch.isfinite(top), top, zero)
        budget = count * u
        short = any_key & (budget < 1 - math.sqrt(torch.finfo(top.dtype).eps))
        if bool(short.any()):
            raise _infeasible(budget, short)
        lo, hi = self._bracket(torch.where(any_key, low - top, zero), count, u)
        lo, hi = torch.where(any_key, lo, zero), torch.where(any_key, hi, zero)
        frac = torch.arange(1, _POINTS + 1, dtype=top.dtype) / (_POINTS + 1)
        for _ in range(_SWEEPS):
            cand = lo + (hi - lo) * frac  # (…, M_b, P), increasing
            total = None
            for e in tiles():
                part = self._mass((e - top).unsqueeze(-2), cand.unsqueeze(-1), u).sum(-1)
                total = part if total is None else total + part
            assert total is not None
            idx = (total > 1).sum(dim=-1, keepdim=True)  # the heavy candidates come first
            ext = torch.cat([lo, cand, hi], dim=-1)
            lo, hi = ext.gather(-1, idx), ext.gather(-1, idx + 1)
        n_sat = n_free = part_sum = None
        for e in tiles():
            z = e - top
            sat, free = self._sets(z, hi, u)
            blk = (
                sat.sum(-1, keepdim=True, dtype=z.dtype),
                free.sum(-1, keepdim=True, dtype=z.dtype),
                self._free_part(z, free),
            )
            if n_sat is None:
                n_sat, n_free, part_sum = blk
            else:
                n_sat, n_free, part_sum = n_sat + blk[0], n_free + blk[1], part_sum + blk[2]
        assert n_sat is not None and n_free is not None and part_sum is not None
        tau_f = self._tau_free(part_sum, n_free, 1 - n_sat * u)
        # No free key: every τ of the flat stretch around the bisection's end is a solution.
        tau_f = torch.where(any_key & (n_free > 0), tau_f, hi)
        top = torch.where(broken, torch.full((), float("nan"), dtype=top.dtype), top)
        return torch.cat([top, hi, tau_f], dim=-1)

    def stream_weights(self, e: Tensor, stat: Tensor | None) -> Tensor:
        assert stat is not None
        u = self._scalar_bound()
        z = e - stat[..., :1]
        sat, _ = self._sets(z, stat[..., 1:2], u)
        # The free weight is continuous in the score and reaches u at the saturation edge, so
        # a key whose score rounds differently here than in the statistic's sweeps (block-sparse
        # tiles are computed apart) moves its weight by a rounding error only.
        w = torch.where(
            sat, torch.full((), u, dtype=z.dtype), self._free_weight(z, stat[..., 2:], u)
        )
        return torch.where(torch.isnan(stat[..., :1]), torch.full((), float("nan")), w)

    def stream_slope(self, p: Tensor, stat: Tensor | None) -> tuple[Tensor, Tensor | None]:
        # Saturated keys hold u exactly and do not move; the free keys share what is left, as
        # softmax (s = p) or sparsemax (s = 1) do on their own.
        free = (p > 0) & (p != self._scalar_bound())
        s = self._free_slope(p, free)
        return s, s

    def _free_slope(self, p: Tensor, free: Tensor) -> Tensor:
        raise NotImplementedError


def _bisect(total, lo: Tensor, hi: Tensor) -> Tensor:
    """The upper end of a bracket [lo, hi] of the root of total(τ) = 1 (total decreasing),
    keeping total(hi) ≤ 1."""
    for _ in range(_STEPS):
        mid = (lo + hi) / 2
        heavy = total(mid) > 1
        lo, hi = torch.where(heavy, mid, lo), torch.where(heavy, hi, mid)
    return hi


@REGISTRY.register("constrained_softmax")
class ConstrainedSoftmax(_Constrained):
    """a = argmin_{a ∈ Δ, a ≤ u} KL(a ‖ softmax(e)) (Martins & Kreutzer 2017; Galassi IV-C).

    a_l = u_l on the saturated keys S, and on the others a_l = (1 − Σ_S u) · softmax(e)_l
    restricted to them. Equals softmax when no bound is active.

    Args:
        upper: a bound for every key, > 0 (None: unbounded unless ``forward`` gets ``upper``).
    """

    label = tx.AlignmentKind.SOFT

    def _unbounded(self, scores: Tensor, mask: Tensor | None) -> Tensor | None:
        return masked_softmax(scores, mask)

    def _solve(self, z: Tensor, u: Tensor, allowed: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=z.dtype, device=z.device)
        with torch.no_grad():
            # Key l is saturated (a_l = u_l) iff τ ≤ r_l = e_l − log u_l.
            r = torch.where(allowed, z - torch.log(u), torch.full((), float("inf"), dtype=z.dtype))
            count = allowed.sum(dim=-1, keepdim=True).clamp_min(1).to(z.dtype)
            hi = torch.log(count)  # every z ≤ 0: Σ exp(z − τ) ≤ 1 there
            lo = torch.minimum(r.amin(dim=-1, keepdim=True), hi)  # all saturated: Σ u ≥ 1
            lo = torch.where(torch.isfinite(lo), lo, hi)

            def total(tau: Tensor) -> Tensor:
                part = torch.where(tau <= r, u, torch.exp(z - tau))
                return torch.where(allowed, part, zero).sum(dim=-1, keepdim=True)

            tau = _bisect(total, lo, hi)
            saturated = allowed & (tau <= r)
        free = allowed & ~saturated
        mass = (1 - torch.where(saturated, u, zero).sum(dim=-1, keepdim=True)).clamp_min(0)
        return torch.where(saturated, u, mass * masked_softmax(z, free))

    def _bracket(self, low: Tensor, count: Tensor, u: float) -> tuple[Tensor, Tensor]:
        hi = torch.log(count.clamp_min(1))
        return torch.minimum(low - math.log(u), hi), hi

    def _mass(self, z: Tensor, tau: Tensor, u: float) -> Tensor:
        return torch.where(tau <= z - math.log(u), u, torch.exp(z - tau))

    def _sets(self, z: Tensor, tau_s: Tensor, u: float) -> tuple[Tensor, Tensor]:
        finite = torch.isfinite(z)
        sat = finite & (tau_s <= z - math.log(u))
        return sat, finite & ~sat

    def _free_part(self, z: Tensor, free: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=z.dtype)
        return torch.where(free, torch.exp(torch.where(free, z, zero)), zero).sum(-1, keepdim=True)

    def _tau_free(self, part: Tensor, n_free: Tensor, mass: Tensor) -> Tensor:
        # a_l = mass · exp(z_l) / Σ_F exp(z) = exp(z_l − τ_f); mass ≤ 0: the free keys get 0.
        inf = torch.full((), float("inf"), dtype=part.dtype)
        safe = torch.where(part > 0, part, torch.ones((), dtype=part.dtype))
        return torch.where(mass > 0, torch.log(safe) - torch.log(mass.clamp_min(1e-300)), inf)

    def _free_weight(self, z: Tensor, tau_f: Tensor, u: float) -> Tensor:
        return torch.clamp(torch.exp(z - tau_f), max=u)

    def _free_slope(self, p: Tensor, free: Tensor) -> Tensor:
        return torch.where(free, p, torch.zeros((), dtype=p.dtype))


@REGISTRY.register("constrained_sparsemax")
class ConstrainedSparsemax(_Constrained):
    """a = argmin_{a ∈ Δ, a ≤ u} ‖a − e‖² (Malaviya et al. 2018; Galassi IV-C).

    a_l = clip(e_l − τ, 0, u_l): keys below τ get exactly 0, saturated keys get u_l, and the
    free keys F share what is left, τ = (Σ_F e − 1 + Σ_S u) / |F|. Equals sparsemax when no
    bound is active.

    Args:
        upper: a bound for every key, > 0 (None: unbounded unless ``forward`` gets ``upper``).
    """

    label = tx.AlignmentKind.SPARSE

    def _solve(self, z: Tensor, u: Tensor, allowed: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=z.dtype, device=z.device)
        with torch.no_grad():
            # τ = 0 = max e: total 0; τ = min (e − u): every key saturated, total Σ u ≥ 1.
            hi = torch.zeros_like(z[..., :1])
            edge = torch.where(allowed, z - u, torch.full((), float("inf"), dtype=z.dtype))
            lo = torch.minimum(edge.amin(dim=-1, keepdim=True), hi - 1)

            def total(tau: Tensor) -> Tensor:
                part = torch.minimum(torch.clamp(z - tau, min=0), u)
                return torch.where(allowed, part, zero).sum(dim=-1, keepdim=True)

            tau = _bisect(total, lo, hi)
            saturated = allowed & (z - u >= tau)
            free = allowed & ~saturated & (z > tau)
        count = free.sum(dim=-1, keepdim=True).to(z.dtype)
        left = 1 - torch.where(saturated, u, zero).sum(dim=-1, keepdim=True)
        tau = (torch.where(free, z, zero).sum(dim=-1, keepdim=True) - left) / count.clamp_min(1)
        return torch.where(saturated, u, torch.where(free, z - tau, zero))

    def _bracket(self, low: Tensor, count: Tensor, u: float) -> tuple[Tensor, Tensor]:
        hi = torch.zeros_like(low)
        return torch.minimum(low - u, hi - 1), hi

    def _mass(self, z: Tensor, tau: Tensor, u: float) -> Tensor:
        return torch.clamp(z - tau, min=0, max=u)

    def _sets(self, z: Tensor, tau_s: Tensor, u: float) -> tuple[Tensor, Tensor]:
        sat = torch.isfinite(z) & (z - u >= tau_s)
        return sat, ~sat & (z > tau_s)

    def _free_part(self, z: Tensor, free: Tensor) -> Tensor:
        return torch.where(free, z, torch.zeros((), dtype=z.dtype)).sum(-1, keepdim=True)

    def _tau_free(self, part: Tensor, n_free: Tensor, mass: Tensor) -> Tensor:
        return (part - mass) / n_free.clamp_min(1)

    def _free_weight(self, z: Tensor, tau_f: Tensor, u: float) -> Tensor:
        return torch.clamp(z - tau_f, min=0, max=u)

    def _free_slope(self, p: Tensor, free: Tensor) -> Tensor:
        return free.to(p.dtype)
