"""The typed score_mod constructors compute their formulas (checked entry by entry with loops),
declare their forms, and refuse bad arguments by name."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import score_mods as sm

H, M, N = 3, 4, 6


def _call(mod, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    e = torch.randn(2, H, M, N, generator=g, dtype=dtype)
    b = torch.arange(2).view(2, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(M).view(M, 1)
    kv = torch.arange(N).view(1, N)
    return e, mod(e, b, h, q, kv)


def _each(e):
    for b in range(e.shape[0]):
        for h in range(H):
            for i in range(M):
                for j in range(N):
                    yield b, h, i, j


def test_alibi_is_minus_the_slope_times_the_signed_or_absolute_distance():
    slopes = [0.5, 0.25, 0.125]
    for symmetric in (False, True):
        e, out = _call(sm.alibi(slopes, symmetric=symmetric))
        for b, h, i, j in _each(e):
            d = abs(i - j) if symmetric else i - j
            assert math.isclose(out[b, h, i, j], e[b, h, i, j] - slopes[h] * d, abs_tol=1e-12)


def test_alibi_of_a_number_of_heads_takes_the_papers_slopes():
    for heads in (3, 4, 8):
        got = sm.alibi(heads).slopes.tolist()
        assert got == pytest.approx(ak.positions.alibi_slopes(heads))


def test_relative_bias_table_and_additive_add_their_bias():
    table = torch.randn(H, 5, dtype=torch.float64)
    cases = {
        "relative": (sm.relative(lambda h, d: h * 10.0 + d), lambda b, h, i, j: h * 10 + i - j),
        "table": (sm.bias_table(table), lambda b, h, i, j: table[h, 2 + max(-2, min(2, i - j))]),
        "additive": (sm.additive(lambda b, h, q, kv: b + h * q - kv),
                     lambda b, h, i, j: b + h * i - j),
    }  # fmt: skip
    for name, (mod, bias) in cases.items():
        e, out = _call(mod)
        for b, h, i, j in _each(e):
            assert math.isclose(out[b, h, i, j], e[b, h, i, j] + bias(b, h, i, j)), name


def test_softcap_compose_and_shift():
    e, out = _call(sm.softcap(2.0))
    torch.testing.assert_close(out, 2.0 * torch.tanh(e / 2.0))
    both = sm.compose(sm.alibi([1.0, 2.0, 3.0]), sm.softcap(2.0))
    e, out = _call(both)
    for b, h, i, j in _each(e):
        want = 2.0 * math.tanh((float(e[b, h, i, j]) - (h + 1) * (i - j)) / 2.0)
        assert math.isclose(out[b, h, i, j], want, abs_tol=1e-12)
    e, out = _call(sm.shifted(sm.alibi([1.0, 2.0, 3.0]), 10))
    for b, h, i, j in _each(e):
        assert math.isclose(out[b, h, i, j], e[b, h, i, j] - (h + 1) * (i + 10 - j))


def test_forms_are_declared():
    rel = sm.Form(additive=True, relative=True)
    assert sm.alibi(2).form() == rel
    assert sm.relative(lambda h, d: d).form() == rel
    assert sm.bias_table(torch.zeros(2, 3)).form() == rel
    assert sm.additive(lambda b, h, q, kv: q).form() == sm.Form(additive=True, relative=False)
    assert sm.softcap(1.0).form() == sm.OTHER
    assert sm.compose(sm.alibi(2), sm.bias_table(torch.zeros(2, 3))).form() == rel
    assert sm.compose(sm.alibi(2), sm.additive(lambda b, h, q, kv: q)).form().relative is False
    assert sm.compose(sm.alibi(2), sm.softcap(3.0)).form() == sm.OTHER
    assert sm.compose(sm.alibi(2), lambda e, b, h, q, kv: e).form() is None
    assert sm.shifted(sm.softcap(1.0), 3).form() == sm.OTHER
    with pytest.raises(ValueError, match="relative form is additive"):
        sm.Form(additive=False, relative=True)


def test_parameters_are_trained():
    slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25, 0.125], dtype=torch.float64))
    mod = sm.compose(sm.alibi(slopes), sm.softcap(5.0))
    assert list(mod.parameters()) == [slopes]
    _, out = _call(mod)
    out.sum().backward()
    assert slopes.grad is not None and bool((slopes.grad != 0).all())


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: sm.alibi(0), ValueError, "number of heads >= 1, got 0"),
        (lambda: sm.alibi(True), TypeError, "slopes must be a number of heads"),
        (lambda: sm.alibi("ab"), TypeError, "slopes must be a number of heads, a sequence"),
        (lambda: sm.alibi(torch.zeros(2, 2)), ValueError, r"1-d floating tensor .*\(2, 2\)"),
        (lambda: sm.alibi(2, symmetric=1), TypeError, "symmetric must be a bool"),
        (lambda: sm.bias_table(torch.zeros(2, 4)), ValueError, r"\(H, 2R \+ 1\).*\(2, 4\)"),
        (lambda: sm.bias_table([1.0]), TypeError, "table must be a tensor"),
        (lambda: sm.softcap(0), ValueError, "cap must be a positive finite number, got 0"),
        (lambda: sm.softcap(float("inf")), ValueError, "cap must be a positive finite"),
        (lambda: sm.compose(), ValueError, "at least one score_mod"),
        (lambda: sm.compose(sm.alibi(2), 3), TypeError, "compose's argument 1 must be callable"),
        (lambda: sm.relative(None), TypeError, "fn must be callable"),
        (lambda: sm.shifted(sm.alibi(2), 1.5), TypeError, "offset must be an int"),
    ],
)
def test_bad_arguments_are_refused_by_name(build, error, message):
    with pytest.raises(error, match=message):
        build()
