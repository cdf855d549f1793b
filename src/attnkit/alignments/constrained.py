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

The saturated set is found by fixing the keys that exceed their bound in the unbounded solution,
round after round (see ``_solve``); the weights are then the closed form on the saturated / free
sets, so gradients (with respect to the scores and the bounds) are those of the exact solution.
Everything works relative to a row maximum, so a constant added to a row changes nothing at any
magnitude. A −inf score is a key the row cannot attend; NaN or +inf among a row's allowed
scores, or no finite one, makes the row NaN, as softmax does.
"""

from __future__ import annotations

import math

import entmax
import torch
from torch import Tensor

from attnkit import inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, masked_softmax
from attnkit.alignments.sparse import Sparsemax
from attnkit.alignments.streaming import Streaming, Tiles
from attnkit.sizing import example_sizes

__all__ = ["ConstrainedSoftmax", "ConstrainedSparsemax"]

# Streaming: each sweep over the key blocks evaluates the row sum at _POINTS values of τ and
# shrinks the bracket (_POINTS + 1)-fold, until it reaches the dtype's resolution; _SWEEPS caps
# the sweeps (64 take a bracket of 1e60 to float64 resolution).
_POINTS = 15
_SWEEPS = 64


def _check_upper(upper: object, name: str = "upper") -> float | None:
    if upper is None:
        return None
    if isinstance(upper, bool) or not isinstance(upper, (int, float)):
        raise TypeError(f"{name} must be a number or None, got {type(upper).__name__}")
    if not upper > 0 or math.isnan(upper):
        raise ValueError(f"{name} must be > 0 (math.inf for no bound), got {upper!r}")
    return float(upper)


def _sparsemax_alignment(scores: Tensor, mask: Tensor | None) -> Tensor:
    return Sparsemax()(scores, mask).weights


def _concrete(t: Tensor) -> bool:
    """Whether ``t`` holds values (not a meta tensor, which carries shapes only): data-dependent
    checks and loops run only then."""
    return t.device.type != "meta"


def _infeasible(budget: Tensor, short: Tensor) -> ValueError:
    return ValueError(
        f"the upper bounds of the keys a row may attend sum to "
        f"{float(budget.detach()[short].min()):.6g} < 1 in {int(short.sum())} row(s): "
        f"no distribution respects them"
    )


class _Constrained(Streaming, Alignment):
    """Shared validation, shifting and feasibility; subclasses solve a shifted, bounded row.

    Streaming (chunked kernels, with the module's bound for every key): the statistic is the
    row maximum m, the threshold τ_s that decides which keys are saturated (a multi-point
    bisection whose row sums are accumulated over key blocks), then from one more sweep the
    largest free score c and the threshold τ_f of the free keys relative to c, the closed form
    on the sets, as the dense path does.
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
        if _concrete(upper) and (bool(torch.isnan(upper).any()) or bool((upper < 0).any())):
            raise ValueError("upper must be >= 0 and not NaN (math.inf for no bound)")
        return upper.to(scores.dtype).clamp(max=1.0).expand(scores.shape)

    def _relaxed(self, z: Tensor, free: Tensor, mass: Tensor) -> Tensor:
        """The solution on the keys ``free`` with total ``mass`` (…, M, 1) and no upper bound;
        0 elsewhere."""
        raise NotImplementedError

    def _solve(self, z: Tensor, u: Tensor, allowed: Tensor) -> Tensor:
        """Weights of the shifted scores ``z`` (rows of ``allowed`` keys, bounds ``u``).

        The saturated set S is found by fixing violators: solve without bounds on the keys not
        yet in S, with the mass left by S, and add every key above its bound. Dropping the
        bounds of the free keys can only raise their weights at a given τ, so the unbounded
        threshold is ≥ the true one and a key above its bound there is saturated in the exact
        solution too; with no violator left, the unbounded solution is feasible, hence exact.
        S grows at each round, so at most N rounds; each round works relative to the largest
        free score, so the sets do not depend on the scores' offset or on keys far below it.
        The weights are then the closed form on S, differentiable in the scores and bounds.
        """
        zero = torch.zeros((), dtype=z.dtype, device=z.device)
        saturated = torch.zeros_like(allowed)
        with torch.no_grad():
            prepared = self._prepare_rounds(z.detach(), allowed)
            for _ in range(z.shape[-1] + 1):
                free = allowed & ~saturated
                mass = 1 - torch.where(saturated, u, zero).sum(dim=-1, keepdim=True)
                relaxed = self._round(prepared, z.detach(), free, mass.clamp_min(0))
                over = free & (relaxed > u)
                saturated = saturated | over
                if not _concrete(over) or not bool(over.any()):
                    break
        free = allowed & ~saturated
        mass = (1 - torch.where(saturated, u, zero).sum(dim=-1, keepdim=True)).clamp_min(0)
        return torch.where(saturated, u, self._relaxed(z, free, mass))

    def _prepare_rounds(self, z: Tensor, allowed: Tensor) -> object:
        """What the rounds of ``_solve`` share (e.g. a sort of the scores)."""
        return None

    def _round(self, prepared: object, z: Tensor, free: Tensor, mass: Tensor) -> Tensor:
        """``_relaxed`` without gradient, inside the rounds of ``_solve``."""
        return self._relaxed(z, free, mass)

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
        zero = torch.zeros((), dtype=work.dtype, device=work.device)
        # A −inf score is a key the row cannot attend (both objectives are infinite otherwise);
        # NaN or +inf among a row's allowed scores, or no finite one, leaves the row undefined:
        # it is NaN, as softmax makes it.
        reachable = allowed & (work > float("-inf"))
        broken = (allowed & (torch.isnan(work) | (work == float("inf")))).any(-1, keepdim=True)
        broken = broken | (allowed.any(-1, keepdim=True) & ~reachable.any(-1, keepdim=True))
        allowed = reachable & ~broken
        any_key = allowed.any(dim=-1, keepdim=True)
        budget = torch.where(allowed, u, zero).sum(dim=-1, keepdim=True)
        slack = math.sqrt(torch.finfo(work.dtype).eps)
        short = any_key & (budget.detach() < 1 - slack)
        if _concrete(short) and bool(short.any()):
            raise _infeasible(budget, short)
        # Both maps ignore a constant added to a row: subtract the (detached) row maximum so
        # every quantity stays O(1) at any logit magnitude.
        top = torch.where(allowed, work, torch.full((), float("-inf"), dtype=work.dtype))
        top = top.amax(dim=-1, keepdim=True).detach()
        top = torch.where(torch.isfinite(top), top, zero)
        z = torch.where(allowed, work - top, zero)
        weights = self._solve(z, u, allowed)
        weights = torch.where(broken, torch.full((), float("nan"), dtype=work.dtype), weights)
        weights = torch.where(allowed | broken, weights, zero)
        return AlignOutput(weights.to(scores.dtype))

    # ---- streaming protocol: stat = (m, τ_s, c, τ_f − c) ------------------------------------

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
        # NaN or +inf among the row's scores: the row is NaN, as in softmax.
        broken = torch.isnan(top) | (top == float("inf"))
        top = torch.where(torch.isfinite(top), top, zero)
        budget = count * u
        short = any_key & (budget < 1 - math.sqrt(torch.finfo(top.dtype).eps))
        if bool(short.any()):
            raise _infeasible(budget, short)
        lo, hi = self._bracket(torch.where(any_key, low - top, zero), count, u)
        lo, hi = torch.where(any_key, lo, zero), torch.where(any_key, hi, zero)
        frac = torch.arange(1, _POINTS + 1, dtype=top.dtype) / (_POINTS + 1)
        tol = 4 * torch.finfo(top.dtype).eps
        for _ in range(_SWEEPS):
            cand = lo + (hi - lo) * frac  # (…, M_b, P), increasing
            total = None
            for e in tiles():
                part = self._mass((e - top).unsqueeze(-2), cand.unsqueeze(-1), u).sum(-1)
                total = part if total is None else total + part
            assert total is not None
            # The candidates whose sum reaches 1 come first. Where the sum stays at 1 over a
            # stretch (no free key), the bracket closes on the stretch's upper end, whose sets
            # hold the keys at the top of the row, not ones that rounding at −1e9 would add.
            idx = (total >= 1).sum(dim=-1, keepdim=True)
            ext = torch.cat([lo, cand, hi], dim=-1)
            lo, hi = ext.gather(-1, idx), ext.gather(-1, idx + 1)
            if bool(((hi - lo) <= tol * (1 + hi.abs())).all()):
                break
        # The free keys' part of the closed form is summed relative to the largest free score c
        # (rescaled as c grows), so free keys far below the row maximum keep their digits.
        n_sat = n_free = part_sum = c_free = None
        for e in tiles():
            sat, free = self._sets(e - top, hi, u)
            c = torch.where(free, e, torch.full((), float("-inf"), dtype=e.dtype))
            c = c.amax(dim=-1, keepdim=True)
            n_b = free.sum(-1, keepdim=True, dtype=e.dtype)
            part_b = self._free_part(torch.where(free, e - c, zero), free)
            if n_sat is None:
                n_sat, n_free, part_sum, c_free = (
                    sat.sum(-1, keepdim=True, dtype=e.dtype),
                    n_b,
                    part_b,
                    c,
                )
                continue
            c_new = torch.maximum(c_free, c)
            part_sum = self._shift_part(part_sum, n_free, c_free, c_new) + self._shift_part(
                part_b, n_b, c, c_new
            )
            n_sat, n_free, c_free = (
                n_sat + sat.sum(-1, keepdim=True, dtype=e.dtype),
                n_free + n_b,
                c_new,
            )
        assert n_sat is not None and n_free is not None and part_sum is not None
        assert c_free is not None
        tau_f = self._tau_free(part_sum, n_free, 1 - n_sat * u)
        # No free key: every τ of the flat stretch around the bisection's end is a solution.
        has_free = any_key & (n_free > 0)
        tau_f = torch.where(has_free, tau_f, hi)
        c_free = torch.where(has_free, c_free, top)
        top = torch.where(broken, torch.full((), float("nan"), dtype=top.dtype), top)
        return torch.cat([top, hi, c_free, tau_f], dim=-1)

    def _shift_part(self, part: Tensor, n: Tensor, c: Tensor, c_new: Tensor) -> Tensor:
        """A free part summed relative to ``c``, made relative to ``c_new`` ≥ c; 0 where n = 0."""
        raise NotImplementedError

    def stream_weights(self, e: Tensor, stat: Tensor | None) -> Tensor:
        assert stat is not None
        u = self._scalar_bound()
        z = e - stat[..., :1]
        sat, _ = self._sets(z, stat[..., 1:2], u)
        # The free weight is continuous in the score and reaches u at the saturation edge, so
        # a key whose score rounds differently here than in the statistic's sweeps (block-sparse
        # tiles are computed apart) moves its weight by a rounding error only.
        free = self._free_weight(e - stat[..., 2:3], stat[..., 3:], u)
        w = torch.where(sat, torch.full((), u, dtype=z.dtype), free)
        return torch.where(torch.isnan(stat[..., :1]), torch.full((), float("nan")), w)

    def stream_slope(self, p: Tensor, stat: Tensor | None) -> tuple[Tensor, Tensor | None]:
        # Saturated keys hold u exactly and do not move; the free keys share what is left, as
        # softmax (s = p) or sparsemax (s = 1) do on their own.
        free = (p > 0) & (p != self._scalar_bound())
        s = self._free_slope(p, free)
        return s, s

    def _free_slope(self, p: Tensor, free: Tensor) -> Tensor:
        raise NotImplementedError


@REGISTRY.register("constrained_softmax")
class ConstrainedSoftmax(_Constrained):
    """a = argmin_{a ∈ Δ, a ≤ u} KL(a ‖ softmax(e)) (Martins & Kreutzer 2017; Galassi IV-C).

    a_l = u_l on the saturated keys S, and on the others a_l = (1 − Σ_S u) · softmax(e)_l
    restricted to them. Equals softmax when no bound is active.

    Args:
        upper: a bound for every key, > 0 (None: unbounded unless ``forward`` gets ``upper``).
    """

    label = tx.AlignmentKind.SOFT

    @classmethod
    def example(cls, **sizes: int | None) -> Alignment:
        """A bound u = 1 on every key."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads(), upper=1.0)

    def _unbounded(self, scores: Tensor, mask: Tensor | None) -> Tensor | None:
        return masked_softmax(scores, mask)

    def _relaxed(self, z: Tensor, free: Tensor, mass: Tensor) -> Tensor:
        return mass * masked_softmax(z, free)

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

    def _shift_part(self, part: Tensor, n: Tensor, c: Tensor, c_new: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=part.dtype)
        return torch.where(n > 0, part * torch.exp(torch.where(n > 0, c - c_new, zero)), zero)

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

    def _unbounded(self, scores: Tensor, mask: Tensor | None) -> Tensor | None:
        # No weight of sparsemax exceeds 1, so bounds ≥ 1 never bind.
        return _sparsemax_alignment(scores, mask)

    def _relaxed(self, z: Tensor, free: Tensor, mass: Tensor) -> Tensor:
        # argmin ‖a − z‖² over {a ≥ 0, Σ a = m} is m · sparsemax(z / m), evaluated relative to
        # the largest free score; below it by more than m a key gets 0, so −2 stands for it.
        zero = torch.zeros((), dtype=z.dtype, device=z.device)
        top = torch.where(free, z, torch.full((), float("-inf"), dtype=z.dtype))
        top = top.amax(dim=-1, keepdim=True).detach()
        top = torch.where(torch.isfinite(top), top, zero)
        tiny = torch.finfo(z.dtype).tiny
        scaled = ((z - top) / mass.clamp_min(tiny)).clamp_min(-2.0)
        scaled = torch.where(free, scaled, torch.full((), -2.0, dtype=z.dtype))
        return torch.where(free, mass * entmax.sparsemax(scaled, dim=-1), zero)

    def _prepare_rounds(self, z: Tensor, allowed: Tensor) -> object:
        # One sort per row serves every round: the free keys keep their order.
        low = torch.full((), float("-inf"), dtype=z.dtype, device=z.device)
        return torch.where(allowed, z, low).sort(dim=-1, descending=True)

    def _round(self, prepared: object, z: Tensor, free: Tensor, mass: Tensor) -> Tensor:
        # Martins & Astudillo eq. 3 on the free keys with total m: the support is the k largest
        # with m + k·z_(k) > Σ_{j ≤ k} z_(j), τ = (Σ_{j ≤ k} z_(j) − m)/k; relative to the
        # largest free score, so the sums stay O(1) near the top.
        values, order = prepared  # type: ignore[misc]
        zero = torch.zeros((), dtype=z.dtype, device=z.device)
        in_order = free.gather(-1, order)
        top = torch.where(in_order, values, torch.full((), float("-inf"), dtype=z.dtype))
        top = top.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, zero)
        rel = torch.where(in_order, values - top, zero)
        sums = rel.cumsum(dim=-1)
        k = in_order.cumsum(dim=-1).to(z.dtype)
        support = in_order & (mass + k * rel > sums)
        size = support.sum(dim=-1, keepdim=True).to(z.dtype)
        total = torch.where(support, sums, torch.full((), float("inf"), dtype=z.dtype))
        tau = (total.amin(dim=-1, keepdim=True) - mass) / size.clamp_min(1)
        tau = torch.where(size > 0, tau, zero)
        return torch.where(free, torch.clamp(z - top - tau, min=0), zero)

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

    def _shift_part(self, part: Tensor, n: Tensor, c: Tensor, c_new: Tensor) -> Tensor:
        zero = torch.zeros((), dtype=part.dtype)
        return torch.where(n > 0, part + n * torch.where(n > 0, c - c_new, zero), zero)

    def _free_weight(self, z: Tensor, tau_f: Tensor, u: float) -> Tensor:
        return torch.clamp(z - tau_f, min=0, max=u)

    def _free_slope(self, p: Tensor, free: Tensor) -> Tensor:
        return free.to(p.dtype)
