"""DRAW's Gaussian filterbank read against a loop of Gregor et al. 2015, eqs. 19-27."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.vision import DRAWRead


def _set_params(module: DRAWRead, gx, gy, log_s2, log_d, log_g) -> None:
    """Make the linear layer emit the given (g̃_X, g̃_Y, log σ², log δ̃, log γ) for any h."""
    with torch.no_grad():
        module.params.weight.zero_()
        module.params.bias.copy_(
            torch.tensor([gx, gy, log_s2, log_d, log_g], dtype=module.params.bias.dtype)
        )


def _loop_filters(raw: list[float], height: int, width: int, n: int):
    gx_t, gy_t, log_s2, log_d, log_g = raw
    g_x = (width + 1) / 2 * (gx_t + 1)  # eq. 22
    g_y = (height + 1) / 2 * (gy_t + 1)  # eq. 23
    delta = (max(width, height) - 1) / (n - 1) * math.exp(log_d)  # eq. 24
    s2 = math.exp(log_s2)

    def bank(g, size):
        rows = []
        for i in range(1, n + 1):
            mu = g + (i - n / 2 - 0.5) * delta  # eqs. 19-20
            e = [math.exp(-((a - mu) ** 2) / (2 * s2)) for a in range(1, size + 1)]
            rows.append([v / sum(e) for v in e])  # eqs. 25-26
        return rows

    return bank(g_x, width), bank(g_y, height), math.exp(log_g)


@torch.no_grad()
def test_filterbank_and_read_match_a_loop_of_the_equations():
    torch.manual_seed(0)
    module = DRAWRead(3, 5, 7, 4).double()
    h = torch.randn(2, 3, dtype=torch.float64)
    x = torch.randn(2, 2, 5, 7, dtype=torch.float64)
    out = module(x, h)
    raw = module.params(h)
    for b in range(2):
        fx, fy, gamma = _loop_filters([float(v) for v in raw[b]], 5, 7, 4)
        torch.testing.assert_close(out.filter_x[b], torch.tensor(fx, dtype=torch.float64))
        torch.testing.assert_close(out.filter_y[b], torch.tensor(fy, dtype=torch.float64))
        for c in range(2):
            for i in range(4):
                for j in range(4):  # read[j, i] = γ Σ_b Σ_a F_Y[j, b] x[b, a] F_X[i, a]
                    ref = gamma * sum(
                        fy[j][r] * float(x[b, c, r, a]) * fx[i][a]
                        for r in range(5)
                        for a in range(7)
                    )
                    torch.testing.assert_close(float(out.read[b, c, j, i]), ref)


@pytest.mark.parametrize("log_gamma", [0.0, math.log(2.5)])
def test_tiny_sigma_stride_one_centred_grid_reads_exact_pixels(log_gamma):
    n = 5
    module = DRAWRead(2, n, n, n).double()
    # g̃ = 0 centres the grid, log δ̃ = 0 gives δ = 1, σ² = e^-12 makes each filter one pixel.
    _set_params(module, 0.0, 0.0, -12.0, 0.0, log_gamma)
    x = torch.randn(3, 1, n, n, dtype=torch.float64)
    out = module(x, torch.randn(3, 2, dtype=torch.float64))
    torch.testing.assert_close(out.read, math.exp(log_gamma) * x, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.filter_x[0], torch.eye(n, dtype=torch.float64))


def test_gradcheck_float64_through_the_parameters():
    torch.manual_seed(1)
    module = DRAWRead(3, 4, 5, 3).double()
    x = torch.randn(2, 1, 4, 5, dtype=torch.float64, requires_grad=True)
    h = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    w = module.params.weight.detach().clone().requires_grad_()
    b = module.params.bias.detach().clone().requires_grad_()

    def read(x, h, w, b):
        params = {"params.weight": w, "params.bias": b}
        return torch.func.functional_call(module, params, (x, h)).read

    assert torch.autograd.gradcheck(read, (x, h, w, b))


def test_bad_inputs_are_refused():
    module = DRAWRead(3, 4, 5, 3)
    with pytest.raises(ValueError, match="4 x 5"):
        module(torch.randn(2, 1, 5, 4), torch.randn(2, 3))
    with pytest.raises(ValueError, match="hidden_size=3"):
        module(torch.randn(2, 1, 4, 5), torch.randn(2, 4))
    with pytest.raises(ValueError, match="glimpse"):
        DRAWRead(3, 4, 5, 1)
