"""Numerics shared by every registered alignment, on every evaluation path.

- Offsets: α-entmax, softmax and their constrained forms ignore a constant added to a row, so a
  row shifted by ±1e4, ±1e9 or ±1e30 must give the weights of the unshifted row, computed here
  from the row's differences (after the rounding the shift itself causes) by references written
  from the equations: exact rational arithmetic for sparsemax and constrained sparsemax (Martins
  & Astudillo 2016, eq. 3; Malaviya et al. 2018), the sorting algorithm for 1.5-entmax (Peters
  et al. 2019, Alg. 2), bisection on τ for α-entmax, the saturated-set characterisation for
  constrained softmax (Martins & Kreutzer 2017, Prop. 1), and the module itself in float64 on
  the unshifted row for the remaining shift-invariant alignments.
- Non-finite scores: −inf is a key the row cannot attend; NaN or +inf among a row's allowed
  scores, or no finite one, makes the row NaN, as torch.softmax does.
- Meta tensors: shapes propagate through every alignment.
"""

from __future__ import annotations

import copy
import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit import alignments as A
from attnkit.kernels import BlockMask

D_Q = 2
OFFSETS = [0.0, 1e4, -1e4, 1e9, -1e9, 1e30, -1e30]
DTYPES = [torch.float32, torch.float64]
BOUND = 0.35  # three allowed keys suffice: 3 · 0.35 ≥ 1


def _query(n_rows: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n_rows, D_Q, generator=g, dtype=torch.float64).to(dtype)


# Every registered alignment, built so that it is deterministic (eval mode for stochastic ones).
FACTORIES = {
    "constrained_softmax": lambda: A.build("constrained_softmax"),
    "constrained_sparsemax": lambda: A.build("constrained_sparsemax"),
    "entmax": lambda: A.Entmax(alpha=1.3),
    "entmax15": lambda: A.build("entmax15"),
    "graph_local": lambda: A.GraphLocal(sigma=1.5),
    "hard": lambda: A.Hard().eval(),
    "local": lambda: A.Local(window=2),
    "predicted_window": lambda: A.PredictedWindow(D_Q),
    "query_temperature": lambda: A.QueryTemperature(D_Q),
    "reinforced": lambda: A.Reinforced().eval(),
    "sigmoid": lambda: A.build("sigmoid"),
    "softmax": lambda: A.build("softmax"),
    "sparsemax": lambda: A.build("sparsemax"),
    "structured": lambda: A.Structured(),
    "uniform": lambda: A.build("uniform"),
}
# Weights that depend on the scores' level, not only their differences: σ(e) (sigmoid), a
# threshold at 0 on the logits (reinforced) and chain potentials of a CRF (structured).
NOT_SHIFT_INVARIANT = {"sigmoid", "reinforced", "structured"}
SHIFT_INVARIANT = sorted(set(FACTORIES) - NOT_SHIFT_INVARIANT)
BOUNDED = {
    "constrained_softmax@0.35": lambda: A.ConstrainedSoftmax(upper=BOUND),
    "constrained_sparsemax@0.35": lambda: A.ConstrainedSparsemax(upper=BOUND),
}
CASES = {**{name: FACTORIES[name] for name in SHIFT_INVARIANT}, **BOUNDED}


def test_every_registered_alignment_is_covered():
    assert set(FACTORIES) == set(A.available())


# ---- references, one row at a time, from the equations ------------------------------------


def _sparsemax_exact(y: list[float]) -> list[float]:
    """Martins & Astudillo eq. 3 with k(z) = max{k : 1 + k z_(k) > Σ_{j ≤ k} z_(j)}, exactly."""
    z = [Fraction(v) for v in y]
    srt = sorted(z, reverse=True)
    k, run, cum = 0, Fraction(0), Fraction(0)
    for i, v in enumerate(srt, start=1):
        cum += v
        if 1 + i * v > cum:
            k, run = i, cum
    tau = (run - 1) / k
    return [float(max(v - tau, Fraction(0))) for v in z]


def _csparsemax_exact(y: list[float], u: float) -> list[float]:
    """a_l = clip(y_l − τ, 0, u) with Σ a = 1 (Malaviya et al.), exactly: the row sum is
    piecewise linear in τ between the breakpoints y_l and y_l − u; on the piece where it
    crosses 1 the saturated and free sets are fixed and τ solves a linear equation."""
    z = [Fraction(v) for v in y]
    bound = Fraction(u)

    def total(t: Fraction) -> Fraction:
        return sum((min(max(v - t, Fraction(0)), bound) for v in z), Fraction(0))

    points = sorted({v for v in z} | {v - bound for v in z} | {min(z) - bound - 1})
    for lo, hi in itertools.pairwise(points):
        if total(lo) >= 1 >= total(hi):
            mid = (lo + hi) / 2
            sat = [v - bound >= mid for v in z]
            free = [not s and v > mid for v, s in zip(z, sat, strict=True)]
            n_free = sum(free)
            if n_free == 0:
                return [float(bound) if s else 0.0 for s in sat]
            left = 1 - bound * sum(sat)
            tau = (sum((v for v, f in zip(z, free, strict=True) if f), Fraction(0)) - left) / n_free
            return [float(min(max(v - tau, Fraction(0)), bound)) for v in z]
    raise AssertionError("no piece crosses 1")


def _softmax(y: list[float]) -> list[float]:
    top = max(y)
    ex = [math.exp(v - top) for v in y]
    return [v / sum(ex) for v in ex]


def _csoftmax(y: list[float], u: float) -> list[float]:
    """Martins & Kreutzer Prop. 1: a_l = u on the saturated set S (the keys with the largest
    y_l − log u), (1 − |S| u) softmax(y) on the rest; S is the one whose threshold is consistent.
    The threshold is kept relative to the largest free score, so far keys keep their digits."""
    order = sorted(range(len(y)), key=lambda i: -y[i])
    for k in range(len(y)):
        sat, free = order[:k], order[k:]
        mass = 1 - k * u
        if mass <= 0:
            break
        top = y[free[0]]
        rel = math.log(sum(math.exp(y[i] - top) for i in free)) - math.log(mass)
        # a_l = exp(y_l − top − rel) on the free keys; u on the saturated ones.
        if all(y[i] - top - rel >= math.log(u) for i in sat) and -rel <= math.log(u):
            w = [0.0] * len(y)
            for i in sat:
                w[i] = u
            for i in free:
                w[i] = math.exp(y[i] - top - rel)
            return w
    raise AssertionError("no consistent saturated set")


def _entmax15_sort(y: list[float]) -> list[float]:
    """Peters et al. Alg. 2 on z = y/2: the largest k with τ_k ≤ z_(k), p = [z − τ]_+²."""
    top = max(y)
    z = [(v - top) / 2 for v in y]
    srt = sorted(z, reverse=True)
    tau = None
    for k in range(1, len(z) + 1):
        mean = sum(srt[:k]) / k
        ss = sum(v * v for v in srt[:k]) / k
        delta = (1 - k * (ss - mean * mean)) / k
        t = mean - math.sqrt(max(delta, 0.0))
        if t <= srt[k - 1]:
            tau = t
    assert tau is not None
    return [max(v - tau, 0.0) ** 2 for v in z]


def _entmax_bisect(y: list[float], alpha: float) -> list[float]:
    """p_l = [(α−1)(y_l − max) − τ]_+^{1/(α−1)}, Σ p = 1, τ ∈ [−1, 0] by bisection."""
    top = max(y)
    z = [(alpha - 1) * (v - top) for v in y]

    def total(t: float) -> float:
        return sum(max(v - t, 0.0) ** (1 / (alpha - 1)) for v in z)

    lo, hi = -1.0, 0.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if total(mid) >= 1 else (lo, mid)
    return [max(v - lo, 0.0) ** (1 / (alpha - 1)) for v in z]


ROW_REFERENCES = {
    "softmax": _softmax,
    "constrained_softmax": _softmax,
    "sparsemax": _sparsemax_exact,
    "constrained_sparsemax": _sparsemax_exact,
    "entmax15": _entmax15_sort,
    "entmax": lambda y: _entmax_bisect(y, 1.3),
    "constrained_softmax@0.35": lambda y: _csoftmax(y, BOUND),
    "constrained_sparsemax@0.35": lambda y: _csparsemax_exact(y, BOUND),
}


def _reference(name: str, module, y: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Weights (M, N) in float64 of the unshifted rows ``y`` (M, N) with ``allowed`` keys."""
    fn = ROW_REFERENCES.get(name)
    if fn is None:  # the module itself, in float64, on the unshifted rows
        ref = copy.deepcopy(module).double()
        kw = {"query": _query(y.shape[0], torch.float64)} if _takes_query(name) else {}
        return ref(y, allowed, **kw).weights.detach()
    out = torch.zeros_like(y)
    for r in range(y.shape[0]):
        idx = [i for i in range(y.shape[1]) if allowed[r, i]]
        if idx:
            w = fn([float(y[r, i]) for i in idx])
            out[r, idx] = torch.tensor(w, dtype=torch.float64)
    return out


def _takes_query(name: str) -> bool:
    return name in ("predicted_window", "query_temperature")


def _tol(dtype: torch.dtype) -> dict:
    return {"atol": 2e-5, "rtol": 0} if dtype == torch.float32 else {"atol": 1e-9, "rtol": 0}


def _shifted_rows(values, offsets, dtype):
    """x: the rows stored with their offsets (rounded to dtype); y: x − offset in float64 (the
    differences the stored row still holds), exactly."""
    base = torch.tensor(values, dtype=torch.float64)
    off = torch.tensor(offsets, dtype=torch.float64).to(dtype).double().unsqueeze(-1)
    x = (base + off).to(dtype)
    return x, x.double() - off


# Scores on a grid of quarters (exact in both dtypes), and now and then −1e9, a common stand-in
# for a masked key.
grid = st.one_of(st.sampled_from([v / 4 for v in range(-24, 25)]), st.just(-1e9))


@st.composite
def rows(draw, max_rows=3):
    m = draw(st.integers(1, max_rows))
    n = draw(st.integers(3, 7))
    values = draw(st.lists(st.lists(grid, min_size=n, max_size=n), min_size=m, max_size=m))
    offsets = draw(st.lists(st.sampled_from(OFFSETS), min_size=m, max_size=m))
    mask = draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=m, max_size=m))
    return values, offsets, torch.tensor(mask)


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(data=rows(), dtype=st.sampled_from(DTYPES))
def test_offset_leaves_weights_unchanged(name, data, dtype):
    values, offsets, mask = data
    if name in BOUNDED:
        mask[:, :3] = True  # three keys at bound 0.35 hold a distribution
    module = CASES[name]().to(dtype)
    x, y = _shifted_rows(values, offsets, dtype)
    kw = {"query": _query(x.shape[0], dtype)} if _takes_query(name) else {}
    got = module(x, mask, **kw).weights.detach().double()
    want = _reference(name, module, y, mask)
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_of_minus_1e9_is_the_row_of_zeros(name, dtype):
    # Every score −1e9 (a common stand-in for a mask), and one key at 0 beside −1e9 ones.
    module = CASES[name]().to(dtype)
    x = torch.tensor([[-1e9] * 4, [0.0, -1e9, -1e9, -1e9]], dtype=dtype)
    kw = {"query": _query(2, dtype)} if _takes_query(name) else {}
    got = module(x, **kw).weights.detach().double()
    ones = torch.ones(2, 4, dtype=torch.bool)
    want = _reference(name, module, x.double() - torch.tensor([[-1e9], [0.0]]), ones)
    torch.testing.assert_close(got, want, **_tol(dtype))


def test_the_reported_row():
    # csparsemax with its default bound of 1 is sparsemax: [0, −1e9, −1e9] -> [1, 0, 0].
    out = ak.attention(
        torch.zeros(1, 1, 2),
        torch.zeros(1, 3, 2),
        torch.eye(3)[None],
        align="constrained_sparsemax",
        bias=torch.tensor([[0.0, -1e9, -1e9]]),
        need_weights=True,
    )
    torch.testing.assert_close(out.weights, torch.tensor([[[1.0, 0.0, 0.0]]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bounded_keys_far_below_the_maximum_keep_their_share(dtype):
    # Bound 0.4: the top key saturates and the two keys 1e9 below share the remaining 0.6.
    x = torch.tensor([[0.0, -1e9, -1e9]], dtype=dtype)
    want = torch.tensor([[0.4, 0.3, 0.3]], dtype=torch.float64)
    for align in (A.ConstrainedSparsemax(upper=0.4), A.ConstrainedSoftmax(upper=0.4)):
        torch.testing.assert_close(align(x).weights.double(), want, **_tol(dtype))


def test_bounded_keys_far_below_the_maximum_keep_their_share_when_streamed():
    # float64 only: the streamed threshold is a number relative to the row maximum, and float32
    # spaces its numbers 64 apart at 1e9, so it cannot tell τ = −1e9 − 0.3 from −1e9 there.
    x = torch.tensor([[0.0, -1e9, -1e9]], dtype=torch.float64)
    want = torch.tensor([[0.4, 0.3, 0.3]], dtype=torch.float64)
    for align in (A.ConstrainedSparsemax(upper=0.4), A.ConstrainedSoftmax(upper=0.4)):
        out = ak.attention(
            torch.zeros(1, 1, 2, dtype=torch.float64),
            torch.zeros(1, 3, 2, dtype=torch.float64),
            torch.eye(3, dtype=torch.float64)[None],
            align=align,
            bias=x,
            need_weights=True,
            kernel="chunked",
        )
        torch.testing.assert_close(out.weights[0], want, atol=1e-9, rtol=0)


# ---- every kernel path ---------------------------------------------------------------------

STREAMING = {
    "softmax": lambda: A.build("softmax"),
    "sparsemax": lambda: A.build("sparsemax"),
    "entmax15": lambda: A.build("entmax15"),
    "entmax": lambda: A.Entmax(alpha=1.3),
    "constrained_softmax": lambda: A.build("constrained_softmax"),
    "constrained_sparsemax": lambda: A.build("constrained_sparsemax"),
    **BOUNDED,
}


def test_streaming_cases_are_the_streamable_alignments():
    streamable = {name for name, make in FACTORIES.items() if make().streamable}
    assert streamable - NOT_SHIFT_INVARIANT == {n for n in STREAMING if "@" not in n}


@pytest.mark.parametrize("name", sorted(STREAMING))
@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(data=rows(max_rows=4), dtype=st.sampled_from(DTYPES))
def test_offsets_on_every_kernel(name, data, dtype):
    values, offsets, mask = data
    mask[:, 0] = True  # rows with no key are the kernels' business (weights 0), not this test's
    if name in BOUNDED:
        mask[:, :3] = True  # three keys at bound 0.35 hold a distribution
        if dtype == torch.float32:
            # A streamed threshold is relative to the row maximum, and float32 cannot place it
            # a fraction beside −1e9 (its numbers are 64 apart there): a bounded row whose keys
            # at −1e9 must take a share is resolved by the dense path only.
            values = [[max(v, -6.0) for v in row] for row in values]
    m, n = mask.shape
    x, y = _shifted_rows(values, offsets, dtype)
    want = _reference(name, STREAMING[name](), y, mask)
    q = torch.zeros(1, m, 2, dtype=dtype)
    k = torch.zeros(1, n, 2, dtype=dtype)
    v = torch.eye(n, dtype=dtype)[None]
    paths = {
        "dense": {"kernel": "dense", "mask": mask[None]},
        "chunked": {"kernel": "chunked", "chunk_size": 2, "mask": mask[None]},
        "block_mask": {"block_mask": BlockMask.from_dense(mask[None], block_q=2, block_k=2)},
    }
    for path, kw in paths.items():
        out = ak.attention(q, k, v, align=STREAMING[name](), bias=x[None], need_weights=True, **kw)
        for got in (out.weights[0], out.context[0]):
            torch.testing.assert_close(got.double(), want, **_tol(dtype), msg=path)


# ---- non-finite scores and meta tensors ----------------------------------------------------

NONFINITE = sorted(set(CASES) - {"uniform"})  # uniform ignores the scores


@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_scores(name):
    module = CASES[name]().double()
    inf, nan = float("inf"), float("nan")
    x = torch.tensor(
        [
            [0.5, -inf, 0.0, 1.0],  # −inf: a key the row cannot attend
            [0.5, inf, 0.0, 1.0],  # +inf: undefined
            [0.5, nan, 0.0, 1.0],  # NaN: undefined
            [-inf, -inf, -inf, -inf],  # no finite score: undefined
        ],
        dtype=torch.float64,
    )
    mask = torch.tensor([True, True, True, True])
    kw = {"query": _query(4, torch.float64)} if _takes_query(name) else {}
    got = module(x, mask, **kw).weights.detach()
    assert torch.isnan(got[1:]).all()
    allowed = torch.tensor([[True, False, True, True]])  # three keys: bound 0.35 is feasible
    if module.position_based:
        # A −inf key still holds its position (the window's centre counts it): its weight is 0
        # and the others form a distribution.
        assert got[0, 1] == 0 and torch.isfinite(got[0]).all()
        if module.normalized:
            torch.testing.assert_close(got[0].sum(), torch.tensor(1.0, dtype=torch.float64))
    else:
        want = _reference(name, module, x[:1].nan_to_num(neginf=0.0), allowed)
        torch.testing.assert_close(got[:1], want, atol=1e-9, rtol=0)
    # Non-finite scores at masked keys change nothing.
    masked = module(x[1:3], torch.tensor([True, False, True, True]), **_q(name, 2)).weights
    want = _reference(name, module, x[1:3].nan_to_num(posinf=0.0, nan=0.0), allowed.expand(2, 4))
    torch.testing.assert_close(masked.detach(), want, atol=1e-9, rtol=0)


def _q(name: str, m: int) -> dict:
    return {"query": _query(m, torch.float64)} if _takes_query(name) else {}


@pytest.mark.parametrize("name", sorted(STREAMING))
def test_nonfinite_scores_on_every_kernel(name):
    inf, nan = float("inf"), float("nan")
    bias = torch.tensor([[[0.5, inf, 0.0, 1.0], [0.5, nan, 0.0, 1.0], [0.5, -inf, 0.0, 1.0]]])
    bias = bias.double()
    want = _reference(
        name, None, bias[0, 2:].nan_to_num(neginf=0.0), torch.tensor([[True, False, True, True]])
    )
    q, k, v = torch.zeros(1, 3, 2).double(), torch.zeros(1, 4, 2).double(), torch.eye(4)[None]
    for kw in ({"kernel": "dense"}, {"kernel": "chunked", "chunk_size": 2}):
        out = ak.attention(
            q, k, v.double(), align=STREAMING[name](), bias=bias, need_weights=True, **kw
        )
        for got in (out.weights[0], out.context[0]):
            assert torch.isnan(got[:2]).all(), kw
            torch.testing.assert_close(got[2:], want, atol=1e-9, rtol=0)


@pytest.mark.parametrize("align", ["sparsemax", "entmax15", "constrained_sparsemax", "softmax"])
def test_infinite_query_gives_nan_rows_not_an_index_error(align):
    q = torch.tensor([[[float("inf"), 0.0], [1.0, 0.0]]])
    k = torch.tensor([[[1.0, 0.0], [-1.0, 0.0], [0.5, 1.0]]])
    out = ak.attention(q, k, torch.eye(3)[None], align=align, need_weights=True)
    assert torch.isnan(out.weights[0, 0]).all()
    assert torch.isfinite(out.weights[0, 1]).all()


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_meta_tensors_propagate_shapes(name):
    module = FACTORIES[name]().to("meta")
    scores = torch.empty(2, 3, 5, device="meta")
    mask = torch.ones(2, 3, 5, dtype=torch.bool, device="meta")
    kw = {"query": torch.empty(2, 3, D_Q, device="meta")} if _takes_query(name) else {}
    out = module(scores, mask, **kw)
    assert out.weights.shape == (2, 3, 5) and out.weights.device.type == "meta"
