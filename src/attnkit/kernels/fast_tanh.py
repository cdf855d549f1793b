"""A rational tanh for float32 tiles: a handful of multiply-adds and one division.

tanh(x) = x·P(x²)/Q(x²) on |x| < 9.02 with P of degree 5 and Q of degree 4 (in u = x²): a rational
minimax fit of tanh(x)/x, relative error ≈ 3·10⁻⁹ on [0, 9.02], far below float32's 6·10⁻⁸, so that
what remains is the rounding of its evaluation (at most 6 units in the last place, 0.2 on
average). From |x| = 9.02 on, tanh(x) rounds to ±1 in float32, and ±1 is returned (±∞ too);
NaN propagates, like ``torch.tanh``.

The point is speed inside compiled tiles: inductor turns the polynomial arithmetic into
vectorised loops, several times the rate of the library tanh, which is the whole cost of the
additive score's tile (Brauwers eq. 6: M·N·d_w tanh evaluations). It serves float32 and
bfloat16 only; float64 keeps ``torch.tanh``.

The coefficients come from :func:`fit` (a Lawson-weighted linearised least-squares iteration
towards the minimax relative error), rounded to float64 and written here; the tests refit and
check that the stored ones are what the fit gives and that the error bound holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CLAMP", "DENOMINATOR", "NUMERATOR", "fit", "tanh", "tanh_autograd"]

#: From |x| = CLAMP on, tanh(x) is ±1 in float32 (1 − tanh(9.02) < half a unit below 1).
CLAMP = 9.02

#: P(u) = Σ_k NUMERATOR[k]·u^k and Q(u) = Σ_k DENOMINATOR[k]·u^k, u = x², tanh(x) ≈ x·P/Q.
NUMERATOR = (
    0.9999999992802293,
    0.1367999466443129,
    0.003868442636064211,
    2.801090687600739e-05,
    3.0598806937513635e-08,
    -1.2219472548004021e-11,
)
DENOMINATOR = (
    1.0,
    0.47013326825369994,
    0.027246218861469138,
    0.00039388713117113953,
    1.2876772310000452e-06,
)


def _horner(u: Tensor, coefficients: tuple[float, ...]) -> Tensor:
    acc = u * coefficients[-1] + coefficients[-2]
    for c in coefficients[-3::-1]:
        acc = acc * u + c
    return acc


def tanh(x: Tensor) -> Tensor:
    """tanh(x) for float32 (or bfloat16, evaluated in float32) to a few units in the last place.

    Args:
        x: a floating tensor; float64 is passed to ``torch.tanh`` unchanged.

    Returns:
        A tensor of ``x``'s shape and dtype.
    """
    if x.dtype == torch.float64:
        return torch.tanh(x)
    xf = x.float() if x.dtype != torch.float32 else x
    u = xf * xf
    y = xf * _horner(u, NUMERATOR) / _horner(u, DENOMINATOR)
    # ±1 beyond the clamp (an infinite or huge x overflows the rational); NaN stays NaN
    y = torch.where(xf.abs() >= CLAMP, torch.copysign(torch.ones_like(xf), xf), y)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def fit(
    numerator: int = 5, denominator: int = 4, hi: float = CLAMP, iterations: int = 60
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Fit tanh(x)/x ≈ P(x²)/Q(x²) on [0, hi] for the least maximal relative error.

    Loeb's linearisation (minimise |P − f·Q| / (f·Q_previous)) with Lawson's reweighting
    (weights multiplied by the current error, which drives the weighted least-squares solution
    towards the minimax one), on a dense grid, in float64 with numpy.

    Args:
        numerator: degree of P in u = x².
        denominator: degree of Q in u (Q(0) = 1).
        hi: right end of the interval in x.
        iterations: reweighting steps.

    Returns:
        (P's coefficients, Q's coefficients, both in powers of u from u⁰; the maximal relative
        error on the grid).
    """
    import numpy as np

    m = 4000
    x = hi * (1 - np.cos(np.linspace(0.0, np.pi, m))) / 2
    x = np.unique(np.concatenate([x, np.linspace(1e-4, hi, m)]))
    x = x[x > 0]
    u = x * x
    # tanh(x)/x, accurate to float64 for small x too (series below 1e-3)
    f = np.where(x < 1e-3, 1 - u / 3 + 2 * u * u / 15, np.tanh(x) / x)
    t = u / hi**2  # scaled variable: a well-conditioned Vandermonde system
    vp = np.vander(t, numerator + 1, increasing=True)
    vq = np.vander(t, denominator + 1, increasing=True)[:, 1:]
    a = np.concatenate([vp, -(f[:, None] * vq)], axis=1)
    weights = np.ones_like(u)
    q_prev = np.ones_like(u)
    err = np.ones_like(u)
    p = q = np.zeros(0)
    for _ in range(iterations):
        scale = weights / (q_prev * f)
        c, *_ = np.linalg.lstsq(a * scale[:, None], f * scale, rcond=None)
        p = c[: numerator + 1]
        q = np.concatenate([[1.0], c[numerator + 1 :]])
        big_p = np.polynomial.polynomial.polyval(t, p)
        big_q = np.polynomial.polynomial.polyval(t, q)
        err = big_p / big_q / f - 1
        q_prev = big_q
        weights = np.maximum(weights * np.abs(err), 1e-300)
        weights /= weights.sum()
    powers = float(hi) ** (2 * np.arange(max(numerator, denominator) + 1))
    p_u = tuple(float(v) for v in p / powers[: numerator + 1])
    q_u = tuple(float(v) for v in q / powers[: denominator + 1])
    return p_u, q_u, float(np.abs(err).max())


class _Tanh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        y = tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        (y,) = ctx.saved_tensors
        return g * (1 - y * y)  # d tanh / dx = 1 − tanh²


def tanh_autograd(x: Tensor) -> Tensor:
    """:func:`tanh` with the derivative of tanh itself, 1 − tanh(x)² (rather than the
    derivative of the rational), for tiles that autograd differentiates."""
    return _Tanh.apply(x)
