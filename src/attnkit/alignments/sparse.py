"""Sparse alignments with exact zeros: sparsemax and α-entmax (Galassi IV-C; Peters et al.).

The dense distributions come from the ``entmax`` package; this module adds masks, fully-masked
rows, a learnable α, shift-safe evaluation at any logit magnitude, and the streaming protocol
(the threshold τ found block by block) for chunked kernels.
"""

from __future__ import annotations

import math

import entmax
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput
from attnkit.alignments.streaming import Streaming, Tiles
from attnkit.sizing import example_sizes

__all__ = ["Entmax", "Entmax15", "Sparsemax"]

# Newton steps on the threshold are capped; each is a sweep over the keys.
_MAX_NEWTON = 100
# Scores per row kept in the first sweep to start Newton's method near the root.
_TOP = 64


def _shifted(scores: Tensor, mask: Tensor | None, gap: float) -> tuple[Tensor, Tensor | None]:
    """Scores minus their row maximum over allowed keys, masked keys at −gap.

    α-entmax ignores a constant added to a row, so subtracting the (detached) maximum changes
    nothing mathematically, but keeps every value within a few units of 0: the masked fill cannot
    round to the row maximum at large logits (1e8 in float32), and the algorithms never meet
    overflow. p_l > 0 needs (α−1)(max − e_l) < 1, so a gap > 1/(α−1) gives masked keys exactly 0.
    """
    if mask is None:
        top = scores.amax(dim=-1, keepdim=True).detach()
        return scores - torch.where(torch.isfinite(top), top, torch.zeros_like(top)), None
    any_key = mask.any(dim=-1, keepdim=True)
    top = scores.masked_fill(~mask, float("-inf")).amax(dim=-1, keepdim=True).detach()
    top = torch.where(any_key & torch.isfinite(top), top, torch.zeros((), dtype=scores.dtype))
    filled = torch.where(mask, scores - top, torch.full((), -gap, dtype=scores.dtype))
    return filled, mask & any_key


def _lower_bound(z: Tensor, power: float, steps: int = 40) -> Tensor:
    """A τ ≤ the root of Σ_l [z_l − τ]_+^power = 1 over the last axis, by bisection on
    [max − 1, max] (the sum is ≥ 1 at the left end); keeps the side whose sum is ≥ 1."""
    hi = z.amax(dim=-1, keepdim=True)
    hi = torch.where(torch.isfinite(hi), hi, torch.zeros((), dtype=z.dtype))
    lo = hi - 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        heavy = (torch.clamp(z - mid, min=0) ** power).sum(-1, keepdim=True) >= 1
        lo, hi = torch.where(heavy, mid, lo), torch.where(heavy, hi, mid)
    return lo


def _threshold(tiles: Tiles, alpha: float) -> Tensor:
    """(…, M_b, 2): the row maximum m and τ with Σ_l [(α−1)(e_l − m) − τ]_+^{1/(α−1)} = 1.

    Newton's method on the row sum, whose value and slope are accumulated over key blocks (one
    sweep per step). The sum is convex and decreasing in τ for 1 < α ≤ 2, so Newton from the
    left rises monotonically to the root; for sparsemax each step is Michelot's support update
    and ends exact, for 1.5-entmax the last step solves the quadratic on the final support
    exactly. The start is the threshold of the row's largest :data:`_TOP` scores alone, kept in
    the first sweep: a subset's sum is smaller at every τ, so its root lies left of the row's,
    and equals it when the support fits in the subset (then one or two Newton sweeps confirm
    it). Working relative to m keeps every quantity O(1), so the result ignores a constant
    added to the row at any magnitude.
    """
    a1 = alpha - 1.0
    power = 1.0 / a1
    best = peak = None
    for e in tiles():
        joined = e if best is None else torch.cat([best, e], dim=-1)
        best = joined.topk(min(_TOP, joined.shape[-1]), dim=-1).values
        blk = e.amax(dim=-1, keepdim=True)  # NaN if the tile holds one
        peak = blk if peak is None else torch.maximum(peak, blk)
    assert best is not None and peak is not None
    # NaN or +inf among the row's scores: the row is NaN, as in softmax and the dense path.
    undefined = torch.isnan(peak) | (peak == float("inf"))
    best = torch.where(undefined, torch.zeros((), dtype=best.dtype), best)
    top = best[..., :1]
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=top.dtype))
    start = _lower_bound(a1 * (best - top), power)

    def sweep(tau: Tensor) -> tuple[Tensor, ...]:
        sums = None
        for e in tiles():
            z = a1 * (e - top)
            gap = torch.clamp(z - tau, min=0)
            inside = gap > 0
            zero = torch.zeros((), dtype=z.dtype)
            parts = (
                (gap**power).sum(-1, keepdim=True),
                (gap ** (power - 1.0) * inside).sum(-1, keepdim=True),
                inside.sum(-1, keepdim=True, dtype=z.dtype),
                torch.where(inside, z, zero).sum(-1, keepdim=True),
                torch.where(inside, z * z, zero).sum(-1, keepdim=True),
            )
            sums = parts if sums is None else tuple(a + b for a, b in zip(sums, parts, strict=True))
        assert sums is not None
        return sums

    tau = start
    tol = 64 * torch.finfo(tau.dtype).eps
    for _ in range(_MAX_NEWTON):
        total, slope, count, s1, _ = sweep(tau)
        if alpha == 2.0:
            new = torch.where(count > 0, (s1 - 1.0) / count.clamp_min(1), tau)
        else:
            step = (total - 1.0) / (power * slope).clamp_min(torch.finfo(tau.dtype).tiny)
            new = torch.where(slope > 0, tau + step, tau)
        done = bool((((new - tau).abs() <= tol) | torch.isnan(new)).all())
        tau = torch.maximum(tau, new)  # monotone from the left; guards rounding
        if done:
            break
    if alpha == 1.5:
        # On the final support S: Σ_S (z − τ)² = 1, the smaller root of the quadratic.
        _, _, count, s1, s2 = sweep(tau)
        disc = (s1 * s1 - count * (s2 - 1.0)).clamp_min(0)
        exact = (s1 - torch.sqrt(disc)) / count.clamp_min(1)
        tau = torch.where(count > 0, exact, tau)
    nan = torch.full((), float("nan"), dtype=tau.dtype)
    return torch.where(undefined, nan, torch.cat([top, tau], dim=-1))


class _Sparse(Streaming, Alignment):
    label = tx.AlignmentKind.SPARSE

    def alpha_value(self) -> float:
        """α as a Python float."""
        raise NotImplementedError

    def _map(self, scores: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        # Half precision has too few digits for the threshold search: work in float32.
        work = scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores
        # A −inf score is a key the row cannot attend (its weight is 0 in the limit). NaN or
        # +inf among a row's allowed scores, or no finite one, leaves the distribution
        # undefined: the row is NaN, as softmax makes it, instead of reaching the sorting
        # algorithms, which fail on such rows with an index error.
        reachable = work > float("-inf")
        allowed = reachable if mask is None else mask & reachable
        bad = torch.isnan(work) | (work == float("inf"))
        broken = (bad if mask is None else mask & bad).any(dim=-1, keepdim=True)
        if mask is None:
            broken = broken | ~reachable.any(dim=-1, keepdim=True)
        else:
            broken = broken | (mask.any(dim=-1, keepdim=True) & ~allowed.any(dim=-1, keepdim=True))
        filled, keep = _shifted(work, allowed, 1.0 / (self.alpha_value() - 1.0) + 1.0)
        zero = torch.zeros((), dtype=filled.dtype)
        weights = self._map(torch.where(broken, zero, filled))
        assert keep is not None
        weights = torch.where(keep, weights, zero)
        weights = torch.where(broken, torch.full((), float("nan"), dtype=weights.dtype), weights)
        return AlignOutput(weights.to(scores.dtype))

    # ---- streaming protocol: stat = (row max, τ) ------------------------------------------

    def stream_reasons(self) -> list[str]:
        alpha = self.alpha_value()
        if not 1.0 < alpha <= 2.0:
            return [
                f"α-entmax streams for 1 < α ≤ 2 (Newton's method needs a convex sum); α = {alpha}"
            ]
        return []

    def stream_statistic(self, tiles: Tiles) -> Tensor:
        return _threshold(tiles, self.alpha_value())

    def stream_weights(self, e: Tensor, stat: Tensor | None) -> Tensor:
        assert stat is not None
        a1 = self.alpha_value() - 1.0
        gap = torch.clamp(a1 * (e - stat[..., :1]) - stat[..., 1:], min=0)
        if a1 == 1.0:
            return gap
        return gap * gap if a1 == 0.5 else gap ** (1.0 / a1)

    def stream_slope(self, p: Tensor, stat: Tensor | None) -> tuple[Tensor, Tensor | None]:
        # ∂p/∂e = diag(s) − s sᵀ/Σ s with s_l = p_l^{2−α} on the support (Peters et al.).
        alpha = self.alpha_value()
        inside = p > 0
        if alpha == 2.0:
            s = inside.to(p.dtype)
        else:
            s = torch.where(inside, p, torch.zeros((), dtype=p.dtype)) ** (2.0 - alpha)
        return s, s


@REGISTRY.register("sparsemax")
class Sparsemax(_Sparse):
    """sparsemax(e) = argmin_{a ∈ Δ} ‖a − e‖² (Martins & Astudillo; Galassi IV-C); α = 2."""

    def alpha_value(self) -> float:
        return 2.0

    def _map(self, scores: Tensor) -> Tensor:
        return entmax.sparsemax(scores, dim=-1)


@REGISTRY.register("entmax15")
class Entmax15(_Sparse):
    """1.5-entmax (Peters et al.), computed exactly by sorting."""

    def alpha_value(self) -> float:
        return 1.5

    def _map(self, scores: Tensor) -> Tensor:
        return entmax.entmax15(scores, dim=-1)


def _inverse_softplus(x: float) -> float:
    """ρ with softplus(ρ) = x > 0, without overflow for large x."""
    return x + math.log(-math.expm1(-x))


@REGISTRY.register("entmax")
class Entmax(_Sparse):
    """α-entmax for any α > 1 (α → 1 is softmax, α = 2 sparsemax), by bisection.

    Args:
        alpha: α > 1, finite.
        learnable: learn α (kept above 1 as α = 1 + softplus(ρ)), as in adaptively sparse
            Transformers (Soydaner); ρ is a parameter that follows ``.to()``/``.double()``. A
            fixed α is kept as a Python float, exact in every dtype.
        n_iter: bisection steps, ≥ 1.
        device, dtype: of the learned ρ.
    """

    @classmethod
    def example(cls, **sizes: int | None) -> Alignment:
        """α = 1.3 (found by bisection, unlike the exact 1.5 and 2)."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads(), alpha=1.3)

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Alignment]:
        """The example, and a learned α starting at 1.8."""
        s = example_sizes(cls.example_sizes, **sizes).for_heads()
        learned = cls.for_heads(**s, alpha=1.8, learnable=True)
        return {"": cls.example(**sizes), "learned-alpha": learned}

    def __init__(
        self,
        alpha: float = 1.5,
        *,
        learnable: bool = False,
        n_iter: int = 50,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"alpha must be a number, got {type(alpha).__name__}")
        if not (alpha > 1 and math.isfinite(alpha)):
            raise ValueError(f"alpha must be finite and > 1 (alpha = 1 is softmax), got {alpha!r}")
        if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 1:
            raise ValueError(f"n_iter must be an int >= 1, got {n_iter!r}")
        if not isinstance(learnable, bool):
            raise TypeError(f"learnable must be a bool, got {type(learnable).__name__}")
        self.fixed_alpha = None if learnable else float(alpha)
        if learnable:
            rho = torch.tensor(_inverse_softplus(alpha - 1.0), device=device, dtype=dtype)
            self.rho = nn.Parameter(rho)
        self.n_iter = n_iter

    @property
    def alpha(self) -> Tensor:
        if self.fixed_alpha is not None:
            return torch.tensor(self.fixed_alpha, dtype=torch.float64)
        return 1.0 + F.softplus(self.rho)

    def alpha_value(self) -> float:
        return self.fixed_alpha if self.fixed_alpha is not None else float(self.alpha.detach())

    def stream_reasons(self) -> list[str]:
        if self.fixed_alpha is None:
            return ["α is learned; the chunked kernel needs a fixed α"]
        return super().stream_reasons()

    def _map(self, scores: Tensor) -> Tensor:
        if self.fixed_alpha is not None:
            alpha = torch.full((*scores.shape[:-1], 1), self.fixed_alpha, dtype=scores.dtype)
        else:
            alpha = self.alpha.to(scores.dtype).expand(*scores.shape[:-1], 1)
        return entmax.entmax_bisect(scores, alpha.to(scores.device), dim=-1, n_iter=self.n_iter)
