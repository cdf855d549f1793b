"""The rational tanh: within a few units in the last place of float32 over the whole float range
(against torch.tanh in float64), special values as torch.tanh, float64 untouched, the stored
coefficients are what the fit gives, and its derivative is tanh's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnkit.kernels import fast_tanh


def _ulps(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|y − tanh(x)| in units in the last place of float32 at the float64 reference."""
    ref = torch.tanh(x.double())
    mag = ref.float().abs()
    ulp = (torch.nextafter(mag, torch.tensor(2.0)) - mag).double()
    return (y.double() - ref).abs() / ulp


def _grid() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # every float32 magnitude (random bit patterns), the interval where tanh bends, tiny values
    bits = torch.randint(0, 2**32, (1 << 19,), dtype=torch.int64, generator=g)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.cat(
        [
            x[torch.isfinite(x)],
            torch.linspace(-12.0, 12.0, 1 << 19),
            torch.linspace(-1e-3, 1e-3, 1 << 16),
            torch.tensor([fast_tanh.CLAMP, -fast_tanh.CLAMP, 8.9, 9.0, 9.019, 3.4e38, -3.4e38]),
            torch.tensor([1e-45, -1e-45, 1.2e-38, 1e-30]),  # subnormal and tiny
        ]
    )
    return x


def test_error_is_a_few_ulp_over_the_float_range():
    x = _grid()
    err = _ulps(fast_tanh.tanh(x), x)
    assert err.max() <= 6.5
    assert err.mean() <= 0.5


def test_special_values_follow_torch_tanh():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 100.0])
    y, ref = fast_tanh.tanh(x), torch.tanh(x)
    assert torch.isnan(y[0]) and torch.isnan(ref[0])
    torch.testing.assert_close(y[1:], ref[1:], atol=0, rtol=0)
    assert torch.signbit(y[4])  # tanh(−0) = −0


def test_float64_keeps_torch_tanh_and_bfloat16_is_close():
    x = torch.randn(1000, dtype=torch.float64) * 4
    assert torch.equal(fast_tanh.tanh(x), torch.tanh(x))
    xb = x.to(torch.bfloat16)
    yb = fast_tanh.tanh(xb)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, torch.tanh(xb.float()).to(torch.bfloat16), atol=0, rtol=0)


def test_the_stored_coefficients_are_the_fit():
    numerator, denominator, err = fast_tanh.fit()
    np.testing.assert_allclose(numerator, fast_tanh.NUMERATOR, rtol=1e-6)
    np.testing.assert_allclose(denominator, fast_tanh.DENOMINATOR, rtol=1e-6)
    assert err < 5e-9
    # the stored rational, in float64, against tanh on a grid finer than the fit's
    x = np.linspace(1e-6, fast_tanh.CLAMP, 200_001)
    u = x * x
    p = np.polynomial.polynomial.polyval(u, fast_tanh.NUMERATOR)
    q = np.polynomial.polynomial.polyval(u, fast_tanh.DENOMINATOR)
    assert np.abs(x * p / q / np.tanh(x) - 1).max() < 5e-9
    # a lower degree cannot reach float32 accuracy: the degrees are not larger than needed
    assert fast_tanh.fit(4, 3)[2] > 1e-7


def test_the_derivative_is_that_of_tanh():
    x = (torch.randn(64, dtype=torch.float64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(fast_tanh.tanh_autograd, (x,))
    xf = x.detach().float().requires_grad_()
    (g,) = torch.autograd.grad(fast_tanh.tanh_autograd(xf).sum(), xf)
    torch.testing.assert_close(g, 1 - torch.tanh(xf.detach()) ** 2, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shape_and_dtype_are_kept(dtype):
    x = torch.randn(3, 4, 5, dtype=dtype)
    y = fast_tanh.tanh(x)
    assert y.shape == x.shape and y.dtype == dtype
