"""LSTMN against a loop written from Cheng et al. (2016) eqs. 5-10, and its causality."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.memory import LSTMN


def _sig(v):
    return 1 / (1 + math.exp(-v))


def _reference(model, x, length):
    """One item, one step, one unit at a time."""
    d = model.d_h
    wh, wx, ws, bs = (
        model.W_h.weight,
        model.W_x.weight,
        model.W_summary.weight,
        model.W_summary.bias,
    )
    v = model.v.weight[0]
    wg, bg = model.gates.weight, model.gates.bias
    hs, cs, rows = [], [], []
    sh, sc = torch.zeros(d, dtype=x.dtype), torch.zeros(d, dtype=x.dtype)
    for t in range(length):
        row = [0.0] * x.shape[0]
        if t > 0:
            a = [float(v @ torch.tanh(wh @ hs[i] + wx @ x[t] + ws @ sh + bs)) for i in range(t)]
            z = sum(math.exp(ai - max(a)) for ai in a)
            s = [math.exp(ai - max(a)) / z for ai in a]  # eq. 6
            sh = sum(s[i] * hs[i] for i in range(t))  # eq. 7
            sc = sum(s[i] * cs[i] for i in range(t))
            row[:t] = s
        pre = wg @ torch.cat([sh, x[t]]) + bg  # eq. 8, gates in the order i, f, o, ĉ
        c = torch.tensor(
            [
                _sig(float(pre[d + k])) * float(sc[k])
                + _sig(float(pre[k])) * math.tanh(float(pre[3 * d + k]))
                for k in range(d)
            ],
            dtype=x.dtype,
        )  # eq. 9
        h = torch.tensor(
            [_sig(float(pre[2 * d + k])) * math.tanh(float(c[k])) for k in range(d)], dtype=x.dtype
        )  # eq. 10
        hs.append(h)
        cs.append(c)
        rows.append(row)
    return torch.stack(hs), torch.tensor(rows, dtype=x.dtype)


@torch.no_grad()
def test_matches_the_paper_loop():
    torch.manual_seed(0)
    model = LSTMN(3, 4, 5).double()
    x = torch.randn(2, 5, 3, dtype=torch.float64)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    out = model(x, mask=mask)
    for b, length in enumerate([5, 3]):
        h, w = _reference(model, x[b], length)
        torch.testing.assert_close(out.hidden[b, :length], h)
        torch.testing.assert_close(out.weights[b, :length], w)


def test_each_step_sees_only_the_past():
    torch.manual_seed(0)
    model = LSTMN(3, 4).double()
    x = torch.randn(1, 6, 3, dtype=torch.float64, requires_grad=True)
    out = model(x)
    for t in range(6):
        (grad,) = torch.autograd.grad(out.hidden[0, t].sum(), x, retain_graph=True)
        assert (grad[0, t + 1 :] == 0).all() and grad[0, : t + 1].abs().sum() > 0
    assert (out.weights[0].triu() == 0).all()  # row t attends only i < t
    torch.testing.assert_close(out.weights[0, 1:].sum(-1), torch.ones(5, dtype=torch.float64))


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"x has 2 features.*d_x = 3"):
        LSTMN(3, 4)(torch.randn(1, 5, 2))
