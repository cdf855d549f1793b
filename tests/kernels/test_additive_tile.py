"""The fused additive tile: its scores and gradients against the dense broadcast formula
(gradcheck in float64, float32 to ~1e-5), the chunked kernel through it against the dense kernel,
which scores take it, and the eager fallback when compilation fails.

The chunked kernel takes the tile only with compiled tiles on; here ``torch.compile`` is replaced
by the identity (the same functions run eagerly, no compilation cost), except in the one slow
test that compiles them for real."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import attnkit as ak
from attnkit.kernels import additive_tile, chunked, compilation, compiled


@pytest.fixture
def dispatching(monkeypatch):
    """Compiled tiles on, with torch.compile as the identity."""
    monkeypatch.setattr(compiled, "_CACHE", {})
    monkeypatch.setattr(additive_tile, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    compiled.set_enabled(True)
    yield
    compiled.set_enabled(None)


def _reference(a, b, w):
    """wᵀ tanh(a_i + b_j) by a loop over the pairs (Brauwers eq. 6)."""
    m, n = a.shape[-2], b.shape[-2]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2], w.shape[:-3])
    out = torch.empty(*lead, m, n, dtype=torch.float64)
    for i in range(m):
        for j in range(n):
            h = torch.tanh(a[..., i, :].double() + b[..., j, :].double())
            out[..., i, j] = (h * w.double()[..., 0, 0, :]).sum(-1)
    return out


@pytest.mark.parametrize("heads", [None, 3])
def test_scores_are_the_formula(heads):
    g = torch.Generator().manual_seed(0)
    lead = (2,) if heads is None else (2, heads)
    a, b = torch.randn(*lead, 5, 7, generator=g), torch.randn(*lead, 6, 7, generator=g)
    w = torch.randn(*(() if heads is None else (heads,)), 1, 1, 7, generator=g)
    ref = _reference(a, b, w)
    s, t = additive_tile.scores_and_activations(a, b, w)
    torch.testing.assert_close(additive_tile.scores(a, b, w).double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t, torch.tanh(a.unsqueeze(-2) + b.unsqueeze(-3)))


@pytest.mark.parametrize("heads", [None, 3])
def test_gradients_pass_gradcheck_in_float64(heads):
    g = torch.Generator().manual_seed(1)
    lead = (2,) if heads is None else (2, heads)
    kw = {"dtype": torch.float64, "generator": g}
    a = torch.randn(*lead, 4, 5, **kw).requires_grad_()
    b = torch.randn(1, *lead[1:], 3, 5, **kw).requires_grad_()  # broadcast over the batch
    w = torch.randn(*(() if heads is None else (heads,)), 1, 1, 5, **kw).requires_grad_()
    assert torch.autograd.gradcheck(additive_tile._Tile.apply, (a, b, w))


def test_float32_gradients_match_the_dense_formula():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(2, 4, 9, 16, generator=g) * 2
    b = torch.randn(2, 4, 11, 16, generator=g) * 2
    w = torch.randn(4, 1, 1, 16, generator=g)
    r = torch.randn(2, 4, 9, 11, generator=g)
    ours = [x.clone().requires_grad_() for x in (a, b, w)]
    ref = [x.double().requires_grad_() for x in (a, b, w)]
    g1 = torch.autograd.grad((additive_tile._Tile.apply(*ours) * r).sum(), ours)
    s = (torch.tanh(ref[0].unsqueeze(-2) + ref[1].unsqueeze(-3)) * ref[2]).sum(-1)
    g2 = torch.autograd.grad((s * r.double()).sum(), ref)
    for x, y in zip(g1, g2, strict=True):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x.double(), y, atol=1e-5 * y.abs().max().item(), rtol=1e-5)


def test_which_scores_take_the_tile():
    assert additive_tile.applies(ak.scores.Additive(4, 4, 5))
    assert additive_tile.applies(ak.scores.Concat(4, 4, 5, num_heads=2))
    assert not additive_tile.applies(ak.scores.Deep(4, 4, 5, depth=2))
    assert not additive_tile.applies(ak.scores.Additive(4, 4, 5, d_out=3))
    assert not additive_tile.applies(ak.scores.Additive(4, 4, 5, activation="relu"))
    assert not additive_tile.applies(ak.scores.General(4, 4))


def _compare(score, dtype=torch.float32, mask=False, query_free=False, tol=2e-5):
    g = torch.Generator().manual_seed(3)
    heads = score.num_heads
    lead = (2,) if heads is None else (2, heads)
    q = None if query_free else torch.randn(*lead, 13, 6, generator=g)
    k, v = torch.randn(*lead, 21, 6, generator=g), torch.randn(*lead, 21, 3, generator=g)
    m = ak.masks.from_lengths(torch.tensor([21, 15]), 21) if mask else None
    if heads is not None and m is not None:
        m = m.unsqueeze(1)
    ours = [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v)]
    ref = [None if x is None else x.double().requires_grad_() for x in (q, k, v)]
    s64 = copy.deepcopy(score).double()
    score = score.to(dtype)
    out = chunked.attend(*ours, score, ak.alignments.Softmax(), mask=m, chunk_size=8).context
    want = ak.attention(*ref, score=s64, mask=m, kernel="dense").context
    scale = want.abs().max().item()
    torch.testing.assert_close(out.double(), want, atol=tol * scale, rtol=tol)
    r = torch.randn(want.shape, generator=g, dtype=torch.float64)
    wrt1 = [x for x in ours if x is not None] + list(score.parameters())
    wrt2 = [x for x in ref if x is not None] + list(s64.parameters())
    g1 = torch.autograd.grad((out * r.to(dtype)).sum(), wrt1, allow_unused=True)
    g2 = torch.autograd.grad((want * r).sum(), wrt2, allow_unused=True)
    for x, y in zip(g1, g2, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x.double(), y, atol=tol * y.abs().max().item(), rtol=tol)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ak.scores.Additive(6, 6, 5),
        lambda: ak.scores.Concat(6, 6, 5),
        lambda: ak.scores.Additive(6, 6, 5, num_heads=2),
    ],
)
def test_chunked_through_the_tile_is_the_dense_kernel(dispatching, make):
    torch.manual_seed(0)
    score = make()
    with torch.no_grad():  # the dispatch really goes through the tile
        assert compiled.pairwise(score).__qualname__.startswith("tile.")
    _compare(score)
    _compare(score, mask=True)


def test_chunked_through_the_tile_in_float64_and_bfloat16(dispatching):
    torch.manual_seed(0)
    _compare(ak.scores.Additive(6, 6, 5), dtype=torch.float64, mask=True, tol=1e-10)
    _compare(ak.scores.Additive(6, 6, 5), dtype=torch.bfloat16, tol=5e-2)


def test_query_free_and_other_tanh_scores_stay_exact(dispatching):
    torch.manual_seed(0)
    _compare(ak.scores.Additive(None, 6, 5), query_free=True)
    _compare(ak.scores.Deep(6, 6, 5, depth=2))  # compiled with the rational tanh
    _compare(ak.scores.Additive(6, 6, 5, d_out=3))


def test_a_failed_compilation_warns_once_and_stays_right(monkeypatch):
    def broken(fn, **kw):
        def run(*args, **kwargs):
            raise RuntimeError("no compiler here")

        return run

    monkeypatch.setattr(compiled, "_CACHE", {})
    monkeypatch.setattr(compilation, "_FAILED", set())
    monkeypatch.setattr(compilation, "_WARNED", False)
    monkeypatch.setattr(additive_tile, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", broken)
    compiled.set_enabled(True)
    try:
        torch.manual_seed(0)
        with pytest.warns(RuntimeWarning, match="compiling the additive tile failed"):
            _compare(ak.scores.Additive(6, 6, 5))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _compare(ak.scores.Concat(6, 6, 5))  # no second warning
    finally:
        compiled.set_enabled(None)


@pytest.mark.slow
def test_compiled_tile_matches_the_dense_kernel():
    compiled.set_enabled(True)
    try:
        torch.manual_seed(0)
        _compare(ak.scores.Additive(6, 6, 5, num_heads=2), mask=True)
    finally:
        compiled.set_enabled(None)
