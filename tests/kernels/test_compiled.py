"""Compiled tiles (torch.compile of a score's pairwise) give the eager results, forward and
gradients; a failed compilation warns once and falls back to eager; the switch works."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit.kernels import compilation, compiled


@pytest.fixture
def compiling():
    compiled.set_enabled(True)
    yield
    compiled.set_enabled(None)


def _case(score, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 20, 6, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 27, 6, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 27, score.d_out or 3, generator=g, dtype=dtype, requires_grad=True)
    mask = ak.masks.from_lengths(torch.tensor([27, 19]), 27)
    return q, k, v, mask


def _check(score, dtype=torch.float64, tol=1e-10):
    q, k, v, mask = _case(score, dtype)
    out = ak.attention(q, k, v, score=score, align="entmax15", mask=mask, chunk_size=8)
    ref = ak.attention(q, k, v, score=score, align="entmax15", mask=mask, kernel="dense")
    torch.testing.assert_close(out.context, ref.context, atol=tol, rtol=tol)
    wrt = [q, k, v, *score.parameters()]
    r = torch.randn_like(ref.context)
    g1 = torch.autograd.grad((out.context * r).sum(), wrt, allow_unused=True)
    g2 = torch.autograd.grad((ref.context * r).sum(), wrt, allow_unused=True)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None) == (b is None)  # a query-free score ignores q
        if a is not None:
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_each_tile_function_is_compiled_once_and_reused(compiling, monkeypatch):
    """Which functions get compiled, and that each is compiled once and then reused (torch.compile
    replaced by a counting identity: no compilation cost in the default run)."""
    from attnkit.kernels import additive_tile

    monkeypatch.setattr(compiled, "_CACHE", {})
    monkeypatch.setattr(additive_tile, "_COMPILED", {})
    seen = []

    def counting(fn, **kw):
        seen.append(fn.__name__)
        return fn

    monkeypatch.setattr(torch, "compile", counting)
    torch.manual_seed(0)
    _check(ak.scores.Additive(6, 6, 5).double())
    _check(ak.scores.Concat(6, 6, 5).double())  # the same fused tile functions
    # the fused tile: forward, forward keeping the activations, backward
    assert sorted(seen) == ["gradients", "scores", "scores_and_activations"]
    _check(ak.scores.Deep(6, 6, 5, depth=2).double())
    assert seen[-1] == "Deep_pairwise_fast_tanh"  # the class's own tile, rational tanh
    assert len(seen) == 4


@pytest.mark.slow
def test_compiled_additive_tile_is_exact(compiling, monkeypatch):
    monkeypatch.setattr(compiled, "_CACHE", {})
    torch.manual_seed(0)
    score = ak.scores.Additive(6, 6, 5).double()
    _check(score)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: ak.scores.Concat(6, 6, 5),
        lambda: ak.scores.Deep(6, 6, 5, depth=2),
        lambda: ak.scores.Additive(6, 6, 5, d_out=3),
        lambda: ak.scores.Additive(None, 6, 5),
    ],
)
def test_compiled_tiles_of_the_additive_family_are_exact(compiling, make):
    torch.manual_seed(0)
    _check(make().double())


def test_a_failed_compilation_warns_once_and_stays_right(compiling, monkeypatch):
    def broken(fn, **kw):
        def run(*args, **kwargs):
            raise RuntimeError("no compiler here")

        return run

    from attnkit.kernels import additive_tile

    monkeypatch.setattr(compiled, "_CACHE", {})
    monkeypatch.setattr(compilation, "_FAILED", set())
    monkeypatch.setattr(compilation, "_WARNED", False)
    monkeypatch.setattr(additive_tile, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    torch.manual_seed(0)
    score = ak.scores.Additive(6, 6, 5).double()
    with pytest.warns(RuntimeWarning, match="compiling the (Additive|additive) tile failed"):
        _check(score)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check(ak.scores.Additive(6, 6, 5).double())  # no second warning


def test_the_switch():
    with mock.patch.object(torch, "compile") as spy:
        compiled.set_enabled(False)
        try:
            _check(ak.scores.Additive(6, 6, 5).double())
        finally:
            compiled.set_enabled(None)
        assert spy.call_count == 0
    assert compiled.enabled() is False  # the suite's default (tests/conftest.py)
    with pytest.raises(TypeError, match="set_enabled takes True, False or None"):
        compiled.set_enabled("yes")


def test_scores_that_do_not_opt_in_are_never_compiled(compiling):
    with mock.patch.object(torch, "compile") as spy:
        _check(ak.scores.General(6, 6).double())
    assert spy.call_count == 0
