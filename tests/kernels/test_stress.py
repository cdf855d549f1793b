"""Every kernel path under stress, for every registered score × alignment (hypothesis).

Each example draws a dtype (float64, float32, bfloat16), batch and length sizes (M = 0 and B = 0
included, key batch broadcast or not), row offsets (±1e4, ±1e30 in float64), a row whose every
score is pushed to −1e9, a mask (none, padding lengths, random per row, with a fully masked row),
and NaN / inf planted in masked keys and values. Then on every kernel that accepts the call
(dense; chunked at a drawn block size; SDPA):

- the paths agree with the dense path in the same dtype, and the dense path agrees with a
  float64 evaluation of the same inputs wherever the dtype can represent the scores;
- weights of normalised alignments lie on the simplex; fully masked rows give weights 0 and
  context 0; nothing planted in a masked position reaches an output or a gradient;
- alignments that ignore a constant added to a row do so on every path;
- gradients agree between the dense and the chunked path.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from registered_parts import ALIGNMENTS, SCORES, Dims, registered

import attnkit as ak
from attnkit.kernels import Call, get

DIMS = Dims(max_len=16)
PAIRS = list(itertools.product(SCORES, ALIGNMENTS))
DTYPES = [torch.float64, torch.float32, torch.bfloat16]
# Mathematically unchanged by a constant added to a row; sigmoid is not, hard/reinforced pick
# an argmax or a sample, which rounding at a large offset may turn into another tie-break.
SHIFT_INVARIANT = {
    "softmax",
    "sparsemax",
    "entmax15",
    "entmax",
    "local",
    "uniform",
    "constrained_softmax",
    "constrained_sparsemax",
    "query_temperature",
    "predicted_window",
    "graph_local",
}
SHIFT_VARIANT = {"sigmoid", "hard", "reinforced", "structured"}
# Tolerances: a path against dense in the same dtype; dense against float64.
SAME = {torch.float64: 1e-8, torch.float32: 2e-4, torch.bfloat16: 2e-2}
REF = {torch.float64: 1e-8, torch.float32: 5e-3, torch.bfloat16: 8e-2}


def test_every_alignment_is_classified_for_shift_invariance():
    assert {registered(a) for a in ALIGNMENTS} == SHIFT_INVARIANT | SHIFT_VARIANT
    assert set(ak.alignments.available()) == SHIFT_INVARIANT | SHIFT_VARIANT


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    big = [1e4, -1e4] + ([1e30, -1e30] if dtype == torch.float64 else [])
    return {
        "dtype": dtype,
        "b": draw(st.sampled_from([0, 1, 2])),
        "m": draw(st.sampled_from([0, 1, 3, 4])),
        "n": draw(st.sampled_from([1, 4, 7])),
        "broadcast": draw(st.booleans()),
        "offset": draw(st.sampled_from([0.0, *big])),
        "sink_row": draw(st.booleans()),  # a row whose every score is −1e9
        "mask": draw(st.sampled_from(["none", "lengths", "rows"])),
        "plant": draw(st.sampled_from(["none", "nan_keys", "inf_values", "nan_values"])),
        "chunk": draw(st.sampled_from([1, 2, 3, 5, 16])),
        "seed": draw(st.integers(0, 2**16)),
    }


def _inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    b, m, n = case["b"], case["m"], case["n"]
    bk = min(b, 1) if case["broadcast"] else b
    q = torch.randn(b, m, DIMS.d_q, generator=g, dtype=torch.float64)
    k = torch.randn(bk, n, DIMS.d_k, generator=g, dtype=torch.float64)
    v = torch.randn(bk, n, DIMS.d_v, generator=g, dtype=torch.float64)
    bias = 0.5 * torch.randn(b, m, n, generator=g, dtype=torch.float64)
    shifted = torch.zeros(b, m, 1, dtype=torch.bool)
    if m:
        shifted[:, ::2] = True  # every other row carries the offset
    mask = None
    if case["mask"] == "lengths" and b:
        lengths = torch.randint(1, n + 1, (b,), generator=g)
        lengths[0] = max(1, n - 2)
        mask = ak.masks.from_lengths(lengths, n)  # (B, 1, N): a key is masked for every row
    elif case["mask"] == "rows":
        mask = torch.rand(b, m, n, generator=g) > 0.3
        if m:
            mask[:, -1] = False  # a fully masked row
        if m > 1:
            mask[:, 0, 0] = True
    return q, k, v, bias, shifted, mask


def _plant(case, k, v, mask):
    """NaN / inf into positions no query may attend (only where such positions exist)."""
    if mask is None or case["plant"] == "none":
        return k, v
    dead = ~mask.any(dim=-2)  # (B, N): masked for every row
    if dead.shape[0] != k.shape[0]:
        return k, v  # the key batch is broadcast: a position is shared by several items
    k, v = k.clone(), v.clone()
    if case["plant"] == "nan_keys":
        k[dead] = float("nan")
    else:
        v[dead] = float("nan") if case["plant"] == "nan_values" else float("inf")
    if case["plant"] != "nan_keys" and case["mask"] == "rows":
        # a value that some rows may attend and others may not: only those rows may see it
        partial = mask.any(dim=-2) & ~mask.all(dim=-2)
        v[partial & (torch.rand(partial.shape, generator=torch.Generator()) < 0.3)] = 7.0
    return k, v


def _paths(call: Call, chunk: int) -> list[tuple[str, dict]]:
    out = [("dense", {"kernel": "dense"})]
    if not get("chunked").reasons_not_supported(call):
        out.append(("chunked", {"chunk_size": chunk}))
    if not get("sdpa").reasons_not_supported(call):
        out.append(("sdpa", {"kernel": "sdpa"}))
    return out


def _run(att, q, k, v, bias, mask, kw, need_weights=True):
    return ak.attention(
        q,
        k,
        v,
        score=att.score,
        align=att.align,
        mask=mask,
        bias=bias,
        need_weights=need_weights and kw.get("kernel") != "sdpa",
        **kw,
    )


def _close(a, b, tol, what):
    assert a.shape == b.shape, what
    a, b = a.detach().double(), b.detach().double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, 0.0, (a - b).abs())
    assert not torch.isnan(diff).any(), f"{what}: NaN on one side only"
    if diff.numel() == 0:
        return
    worst, scale = float(diff.max()), 1 + float(torch.nan_to_num(b).abs().max())
    assert worst <= tol * scale, f"{what}: max difference {worst:.3g} > {tol} × {scale:.3g}"


def _build(score, align, dtype):
    torch.manual_seed(0)
    s, a = SCORES[score](DIMS), ALIGNMENTS[align](DIMS)
    att = ak.Attention(s, a).eval()
    return att.to(dtype)


@pytest.mark.parametrize(("score", "align"), PAIRS)
@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases())
def test_paths_agree_under_stress(score, align, case):
    dtype = case["dtype"]
    att = _build(score, align, dtype)
    if att.align.stochastic and att.training:
        pytest.fail("stress tests run in eval mode")
    q64, k64, v64, bias64, shifted, mask = _inputs(case)
    k64, v64 = _plant(case, k64, v64, mask)
    offset = torch.where(shifted, case["offset"], 0.0)
    sink = torch.zeros_like(bias64)
    if case["sink_row"] and case["m"]:
        sink[:, 0] = -1e9
    full_bias = bias64 + offset + sink
    q, k, v, bias = (x.to(dtype) for x in (q64, k64, v64, full_bias))
    shape = torch.Size((case["b"], case["m"], case["n"]))
    call = Call(q, k, v, att.score, att.align, shape, mask=mask, bias=bias)
    name = registered(align)
    allowed = torch.ones(case["b"], case["m"], 1, dtype=torch.bool)
    if mask is not None:
        allowed = mask.any(-1, keepdim=True).expand(case["b"], case["m"], 1)

    ref = _run(att, q, k, v, bias, mask, {"kernel": "dense"})
    # The float64 reference of the very same (rounded) inputs.
    att64 = _build(score, align, torch.float64)
    ref64 = _run(
        att64, q.double(), k.double(), v.double(), bias.double(), mask, {"kernel": "dense"}
    )
    degenerate_rows = (case["sink_row"] and dtype != torch.float64) or (
        case["offset"] != 0 and abs(case["offset"]) > 1e4
    )
    if not degenerate_rows and not att.align.stochastic:
        tol = REF[dtype] * (10 if case["offset"] and dtype != torch.float64 else 1)
        _close(ref.context, ref64.context, tol, f"dense {dtype} vs float64 context")
    for label, kw in _paths(call, case["chunk"]):
        out = _run(att, q, k, v, bias, mask, kw)
        assert out.context.shape == ref.context.shape, label
        assert out.context.dtype == dtype, label
        if mask is not None:  # anything planted sits in masked positions
            assert torch.isfinite(out.context).all(), f"{label}: a masked NaN/inf leaked"
        _close(out.context, ref.context, SAME[dtype], f"{label} context vs dense")
        if out.weights is not None:
            w = out.weights.double()
            _close(out.weights, ref.weights, SAME[dtype], f"{label} weights vs dense")
            assert (w >= 0).all(), label
            multi = att.score.multi_dimensional
            if att.align.normalized and not multi:
                sums = w.sum(-1, keepdim=True)
                target = allowed.to(sums.dtype).expand_as(sums)
                if att.align.position_based:  # a window may hold no allowed key: weights 0
                    target = torch.where(sums.abs() < 0.5, 0.0, target)
                _close(sums, target, 4 * SAME[dtype], f"{label}: rows on the simplex")
            if mask is not None and not multi:
                assert (w[~mask.expand_as(w)] == 0).all(), f"{label}: weight on a masked key"
        # fully masked rows: context 0
        if mask is not None:
            empty = ~allowed.expand(*out.context.shape[:-1], 1)
            assert (out.context.masked_select(empty) == 0).all(), f"{label}: empty row not 0"
        # a constant added to a row changes nothing
        # (a bfloat16 bias cannot hold 1e4 + a small score: nothing to compare there)
        invariant = name in SHIFT_INVARIANT and dtype != torch.bfloat16
        if invariant and case["offset"] and abs(case["offset"]) <= 1e4:
            base = _run(att, q, k, v, (bias64 + sink).to(dtype), mask, kw)
            tol = {torch.float64: 1e-7, torch.float32: 2e-2}[dtype]
            _close(out.context, base.context, tol, f"{label}: shift invariance")


GRAD_PAIRS = [
    (s, a)
    for s, a in PAIRS
    if not ALIGNMENTS[a](DIMS).stochastic
    and not getattr(ALIGNMENTS[a](DIMS), "straight_through", 0)
]


@pytest.mark.parametrize(("score", "align"), GRAD_PAIRS)
@settings(max_examples=3, deadline=None, derandomize=True, database=None)
@given(
    offset=st.sampled_from([0.0, 1e4, -1e4, 1e8]),
    sink_row=st.booleans(),
    mask_kind=st.sampled_from(["none", "lengths", "rows"]),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    chunk=st.sampled_from([1, 3, 16]),
)
def test_gradients_agree_under_stress(score, align, offset, sink_row, mask_kind, dtype, chunk):
    att = _build(score, align, dtype)
    case = {
        "dtype": dtype,
        "b": 2,
        "m": 3,
        "n": 7,
        "broadcast": False,
        "mask": mask_kind,
        "seed": 5,
    }
    q, k, v, bias, shifted, mask = _inputs(case)
    bias = bias + torch.where(shifted, offset, 0.0)
    if sink_row:
        bias[:, 1] -= 1e9
    q, k, v, bias = (x.to(dtype).requires_grad_() for x in (q, k, v, bias))
    call = Call(q, k, v, att.score, att.align, torch.Size((2, 3, 7)), mask=mask)
    if get("chunked").reasons_not_supported(call):
        return
    r = torch.randn(2, 3, DIMS.d_v, generator=torch.Generator().manual_seed(3), dtype=dtype)
    wrt = [q, k, v, bias, *att.parameters()]

    def grads(kw):
        out = _run(att, q, k, v, bias, mask, kw, need_weights=False).context
        g = torch.autograd.grad((out * r).sum(), wrt, allow_unused=True)
        return [torch.zeros_like(w) if x is None else x for x, w in zip(g, wrt, strict=True)]

    tol = {torch.float64: 1e-7, torch.float32: 2e-3}[dtype]
    # A parameter that scales every score (a learned temperature) sums terms as large as the
    # scores: its gradient is conditioned like max|e|·eps on any path.
    conditioning = float(bias.detach().abs().max()) * torch.finfo(dtype).eps
    for g1, g2, name in zip(
        grads({"chunk_size": chunk}), grads({"kernel": "dense"}), "qkvb" + "p" * 99, strict=False
    ):
        assert torch.isfinite(g1).all(), name
        _close(g1, g2, max(tol, 100 * conditioning) if name == "p" else tol, f"d/d{name}")


@pytest.mark.parametrize("align", sorted(ALIGNMENTS))
def test_a_nan_key_reaches_only_the_rows_that_may_attend_it(align):
    att = _build("dot", align, torch.float64)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, DIMS.d_q, generator=g, dtype=torch.float64)
    k = torch.randn(1, 5, DIMS.d_k, generator=g, dtype=torch.float64)
    v = torch.randn(1, 5, DIMS.d_v, generator=g, dtype=torch.float64)
    k[0, 1] = float("nan")
    mask = torch.ones(1, 3, 5, dtype=torch.bool)
    mask[0, 0, 1] = mask[0, 2, 1] = False  # rows 0 and 2 may not attend key 1; row 1 may
    call = Call(q, k, v, att.score, att.align, torch.Size((1, 3, 5)), mask=mask)
    for label, kw in _paths(call, 2):
        out = _run(att, q, k, v, None, mask, kw).context
        assert torch.isfinite(out[0, [0, 2]]).all(), f"{label}: NaN reached a row that masks it"
        # uniform ignores the scores; a local window may leave key 1 out
        if registered(align) != "uniform" and not att.align.position_based:
            assert torch.isnan(out[0, 1]).all(), f"{label}: the row that attends NaN is not NaN"
