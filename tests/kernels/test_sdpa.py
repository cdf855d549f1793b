"""The SDPA dispatch computes what the dense path computes, for every dot-product-form score."""

import pytest
import torch
import torch.nn.functional as F
from helpers import rand

from attnkit import alignments as al
from attnkit import scores as sc
from attnkit.kernels import dense, sdpa
from attnkit.scores.multiplicative import FixedScaleDot

DOT_FORM = {
    "dot": lambda: sc.Dot(),
    "scaled_dot": lambda: sc.ScaledDot(),
    "general": lambda: sc.General(4, 4),
    "biased_general": lambda: sc.BiasedGeneral(4, 4),
    "cosine": lambda: sc.Cosine(),
    "learned_query": lambda: sc.LearnedQuery(4, scaled=True),
    "hermitian": lambda: sc.Hermitian(4, 3),
    "directed_hermitian": lambda: sc.DirectedHermitian(4, 3),
    "decomposable": lambda: sc.Decomposable(4, 4, 3, activation="tanh"),
    "decomposable_shared": lambda: sc.SharedDecomposable(4, 3, activation="tanh"),
}


def test_every_dot_form_score_is_listed():
    listed = {n for n in sc.available() if sc.REGISTRY.get(n).dot_product_form}
    assert listed == set(DOT_FORM)


@pytest.mark.parametrize("name", list(DOT_FORM))
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sdpa_equals_dense(name, temperature):
    torch.manual_seed(0)
    score = DOT_FORM[name]().double()
    align = al.Softmax(temperature)
    q, k, v = rand(2, 3, 4, seed=1), rand(2, 6, 4, seed=2), rand(2, 6, 5, seed=3)
    mask = torch.ones(2, 3, 6, dtype=torch.bool)
    mask[0, :, 4:] = False
    mask[1, 2] = False  # a fully masked row
    bias = rand(3, 6, seed=4, grad=False)
    assert sdpa.can_dispatch(score, align, need_weights=False)
    fast = sdpa.attend(q, k, v, score, align, mask=mask, bias=bias).context
    slow = dense.attend(q, k, v, score, align, mask=mask, bias=bias).context
    torch.testing.assert_close(fast, slow)
    r = torch.randn_like(fast)
    wrt = [k, v, *score.parameters()] if score.query_free else [q, k, v, *score.parameters()]
    g1 = torch.autograd.grad((fast * r).sum(), wrt)
    g2 = torch.autograd.grad((slow * r).sum(), wrt)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_no_dispatch_when_it_would_differ():
    assert not sdpa.can_dispatch(sc.ScaledDot(), al.Softmax(), need_weights=True)
    assert not sdpa.can_dispatch(sc.ScaledDot(), al.Sparsemax(), need_weights=False)
    assert not sdpa.can_dispatch(sc.ScaledDot(), al.Softmax(learnable=True), need_weights=False)
    assert not sdpa.can_dispatch(sc.Additive(4, 4, 4), al.Softmax(), need_weights=False)


def _recording(monkeypatch):
    calls = []
    real = sdpa.F.scaled_dot_product_attention

    def record(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", record)
    return calls


@pytest.mark.parametrize("shape", [(7, 7), (1, 1, 7, 7)])
def test_the_causal_mask_goes_to_sdpas_causal_mode_and_equals_dense(monkeypatch, shape):
    """Exactly the causal mask (any broadcast shape of ones) runs SDPA with is_causal=True and
    no mask: equal to the dense path, values and gradients, in float64."""
    calls = _recording(monkeypatch)
    score, align = sc.ScaledDot(), al.Softmax()
    causal = torch.ones(7, 7, dtype=torch.bool).tril().reshape(shape)
    q, k, v = rand(2, 3, 7, 4, seed=1), rand(2, 3, 7, 4, seed=2), rand(2, 3, 7, 5, seed=3)
    got = sdpa.attend(q, k, v, score, align, mask=causal).context
    assert calls[-1]["is_causal"] is True and calls[-1].get("attn_mask") is None
    want = dense.attend(q, k, v, score, align, mask=causal).context
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    r = torch.randn(want.shape, dtype=want.dtype)
    grads = torch.autograd.grad((got * r).sum(), (q, k, v))
    for g, w in zip(grads, torch.autograd.grad((want * r).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_masks_that_are_not_exactly_causal_keep_the_mask(monkeypatch):
    """Causal with padding, a causal mask given per batch item (not broadcast), a shifted
    triangle (M ≠ N, decoding after a cache) and a causal mask with a bias keep SDPA's masked
    form."""
    calls = _recording(monkeypatch)
    score, align = sc.ScaledDot(), al.Softmax()
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    padded = causal & torch.tensor([True] * 5 + [False])
    per_item = causal.expand(2, 6, 6)
    shifted = torch.ones(3, 6, dtype=torch.bool).tril(3)
    q, k, v = rand(2, 6, 4, seed=1), rand(2, 6, 4, seed=2), rand(2, 6, 4, seed=3)
    for mask, queries in ((padded, q), (per_item, q), (shifted, q[:, 3:])):
        got = sdpa.attend(queries, k, v, score, align, mask=mask).context
        assert not calls[-1].get("is_causal", False)
        want = dense.attend(queries, k, v, score, align, mask=mask).context
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    bias = rand(6, 6, seed=4, grad=False)
    sdpa.attend(q, k, v, score, align, mask=causal, bias=bias)
    assert not calls[-1].get("is_causal", False)


def _masked_reference(q, k, v, scale, allowed, bias):
    """softmax(scale·qᵀk + bias) over the allowed keys, by a loop over rows."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                keys = [j for j in range(k.shape[2]) if allowed[b, 0, i, j]]
                e = torch.stack([scale * (q[b, h, i] @ k[b, h, j]) for j in keys])
                e = e + bias[b, 0, i, keys]
                out[b, h, i] = torch.softmax(e, 0) @ v[b, h, keys]
    return out


def test_direct_takes_an_additive_mask_in_place_of_mask_and_bias(monkeypatch):
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=g) for _ in range(3))
    allowed = torch.rand(2, 1, 5, 5, generator=g) > 0.4
    allowed[..., 0] = True  # every row has a key
    bias = torch.randn(2, 1, 5, 5, dtype=torch.float64, generator=g)
    additive = torch.where(allowed, bias, torch.finfo(torch.float64).min)
    score, align = FixedScaleDot(0.5), al.Softmax()
    seen = []
    real = sdpa.F.scaled_dot_product_attention
    monkeypatch.setattr(
        sdpa.F,
        "scaled_dot_product_attention",
        lambda *a, **kw: seen.append(kw["attn_mask"]) or real(*a, **kw),
    )
    out = sdpa.direct(q, k, v, score, align, mask=allowed, bias=bias, additive=additive)
    assert len(seen) == 1 and seen[0] is additive  # SDPA adds it as it is
    ref = _masked_reference(q, k, v, 0.5, allowed, bias)
    torch.testing.assert_close(out.context, ref, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("per_query", [False, True])
def test_direct_keeps_masked_keys_as_given_only_when_asked(per_query):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 4, 3, generator=g) for _ in range(3))
    allowed = torch.ones(1, 1, 4 if per_query else 1, 4, dtype=torch.bool)
    allowed[..., 3] = False  # key 3 is masked for every query
    if per_query:
        allowed[0, 0, 0, 1] = False  # and key 1 for the first query
    v[0, 0, 3, 0] = float("nan")  # a masked value that is not finite
    score, align = sc.ScaledDot(), al.Softmax()
    # as given: what SDPA with the mask gives (the model's own attention), NaN where it leaks
    kept = sdpa.direct(q, k, v, score, align, mask=allowed, keep_masked=True)
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    assert bool(kept.context.isnan().any())
    torch.testing.assert_close(kept.context, expect, equal_nan=True)
    # by default nothing masked reaches the output: cleared, or left to the general call
    cleared = sdpa.direct(q, k, v, score, align, mask=allowed)
    if per_query:
        assert cleared is None
    else:
        clean = v.clone()
        clean[0, 0, 3, 0] = 0.0
        ref = F.scaled_dot_product_attention(q, k, clean, attn_mask=allowed)
        torch.testing.assert_close(cleared.context, ref)


def test_direct_leaves_only_masks_evaluated_block_sparsely_to_the_general_call():
    g = torch.Generator().manual_seed(10)
    n = 1024
    q, k, v = (torch.randn(1, 1, n, 4, generator=g) for _ in range(3))
    i = torch.arange(n)
    band = ((i[:, None] - i[None, :]).abs() < 64)[None, None]  # few tiles hold a pair
    score, align = sc.ScaledDot(), al.Softmax()
    assert sdpa.direct(q, k, v, score, align, mask=band) is None
    causal = (i[:, None] >= i[None, :])[None, None]  # over half of the tiles: evaluated densely
    out = sdpa.direct(q, k, v, score, align, mask=causal)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.context, ref)


def _direct_cases():
    """(name, q, k, v, mask, bias, dtype tolerance) over the forms a layer's plan hands the
    direct entry: no mask, key padding, causal, a full mask with a row that has no key, a
    bias, ±1e4 row offsets, d_v ≠ d_k, sizes no tile divides, grouped heads, B = 0."""
    g = torch.Generator().manual_seed(11)

    def t(*shape, dtype=torch.float64):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    m, n = 37, 45
    key = torch.ones(3, 1, 1, n, dtype=torch.bool)
    key[1, ..., 20:] = False
    full = torch.rand(3, 1, m, n, generator=g) > 0.5
    full[0, 0, 5] = False  # a row without a key
    causal = torch.ones(m, n, dtype=torch.bool).tril(n - m)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        tol = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
        q, k, v = t(3, 2, m, 8, dtype=dtype), t(3, 2, n, 8, dtype=dtype), t(3, 2, n, 5, dtype=dtype)
        yield f"none {dtype}", q, k, v, None, None, tol
        yield f"key {dtype}", q, k, v, key, None, tol
        yield f"full {dtype}", q, k, v, full, None, tol
        yield f"causal {dtype}", q, k, v, causal, None, tol
        offset = q + 1e4 * t(3, 2, m, 1, dtype=dtype) if dtype == torch.float64 else q
        yield f"offsets {dtype}", offset, k, v, key, None, tol
    q64, k64, v64 = t(3, 2, m, 8), t(3, 2, n, 8), t(3, 2, n, 5)
    yield "bias", q64, k64, v64, full, t(3, 1, m, n), 1e-10
    yield "grouped", t(3, 4, m, 8), k64, v64, key, None, 1e-10
    yield "B = 0", t(0, 2, m, 8), t(0, 2, n, 8), t(0, 2, n, 5), None, None, 1e-10


@pytest.mark.parametrize("case", list(_direct_cases()), ids=lambda c: c[0])
def test_direct_equals_the_dense_kernel_on_every_form_it_takes(case):
    _, q, k, v, mask, bias, tol = case
    score, align = sc.ScaledDot(), al.Softmax()
    out = sdpa.direct(q, k, v, score, align, mask=mask, bias=bias)
    assert out is not None  # every form here is one SDPA evaluates exactly
    group = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    want = dense.attend(q, kr, vr, score, align, mask=mask, bias=bias).context
    assert out.context.shape == want.shape and out.context.dtype == q.dtype
    torch.testing.assert_close(out.context, want.to(q.dtype), atol=tol, rtol=tol)


def test_direct_steps_aside_where_selection_could_choose_otherwise():
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    full = torch.ones(6, 6, dtype=torch.bool).tril()
    score = sc.ScaledDot()
    assert sdpa.direct(q, k, v, score, al.Sparsemax()) is None  # not softmax
    half = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    bias = torch.zeros(6, 6, dtype=torch.bfloat16)
    assert sdpa.direct(*half, score, al.Softmax(), bias=bias) is None  # a half-precision bias
    v_bad = v.clone()
    v_bad[0, 0, 5, 0] = float("nan")  # under a per-query mask: the kernel would have to guard
    assert sdpa.direct(q, k, v_bad, score, al.Softmax(), mask=full) is None


@pytest.mark.parametrize("m", [3, 520])
def test_a_value_view_whose_rows_lie_apart_gives_the_contiguous_result_and_gradients(m):
    """v as the value part of one packed projection (rows 3·d_v apart): SDPA is handed packed
    rows from 512 queries on; output and gradients equal those of a contiguous copy."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, m, 8, dtype=torch.float64, generator=g)
    n = m + 10
    k = torch.randn(2, 2, n, 8, dtype=torch.float64, generator=g)
    packed = torch.randn(2, n, 2, 3 * 6, dtype=torch.float64, generator=g, requires_grad=True)
    v = packed[..., 12:].transpose(1, 2)  # (2, 2, n, 6), rows 36 floats apart
    assert v.stride(-2) != v.shape[-1]
    score, align = sc.ScaledDot(), al.Softmax()
    got = sdpa.attend(q, k, v, score, align, mask=masks_causal(m, n)).context
    (got * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    v_ref = v.detach().contiguous().requires_grad_()
    want = dense.attend(q, k, v_ref, score, align, mask=masks_causal(m, n)).context
    (want * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed.grad[..., 12:].transpose(1, 2), v_ref.grad)
    assert packed.grad[..., :12].abs().sum() == 0


def masks_causal(m: int, n: int) -> torch.Tensor:
    return torch.ones(m, n, dtype=torch.bool).tril(diagonal=n - m)


@pytest.mark.parametrize(("d", "d_v"), [(12, 8), (8, 12)])
@pytest.mark.parametrize("form", ["none", "padding", "causal", "mask_bias", "grouped"])
def test_values_of_another_size_reach_sdpa_with_one_head_size_and_equal_dense(
    monkeypatch, d, d_v, form
):
    """d_v ≠ d from 64 queries on: SDPA gets one head size (zero features added to the smaller
    side, so that its fused kernel runs), and output and gradients equal the dense kernel."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(5)
    h_kv = 1 if form == "grouped" else 2
    q = torch.randn(2, 2, 70, d, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(2, h_kv, 75, d, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(2, h_kv, 75, d_v, dtype=torch.float64, generator=g).requires_grad_()
    mask = bias = None
    if form == "padding":
        mask = (torch.arange(75) < torch.tensor([75, 40])[:, None])[:, None, None, :]
    elif form == "causal":
        mask = masks_causal(70, 75)
    elif form == "mask_bias":
        mask = torch.rand(2, 1, 70, 75, generator=g) > 0.3
        mask[0, 0, 3] = False  # a query without keys: 0
        bias = torch.randn(70, 75, dtype=torch.float64, generator=g) * 1e4
    score, align = sc.ScaledDot(), al.Softmax()
    got = sdpa.attend(q, k, v, score, align, mask=mask, bias=bias).context
    assert seen == [(max(d, d_v),) * 3]
    kk, vv = (x if form != "grouped" else x.expand(2, 2, 75, -1) for x in (k, v))
    want = dense.attend(q, kk, vv, score, align, mask=mask, bias=bias).context
    assert got.shape == (2, 2, 70, d_v)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    r = torch.randn(got.shape, dtype=torch.float64, generator=g)
    for a, b in zip(
        torch.autograd.grad((got * r).sum(), (q, k, v)),
        torch.autograd.grad((want * r).sum(), (q, k, v)),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("d", "d_v"), [(12, 8), (8, 12)])
def test_values_of_another_size_with_an_empty_batch(d, d_v):
    """B = 0 with d_v ≠ d and 70 queries: an empty context of the values' size, as dense."""
    q, k, v = torch.randn(0, 2, 70, d), torch.randn(0, 2, 75, d), torch.randn(0, 2, 75, d_v)
    score, align = sc.ScaledDot(), al.Softmax()
    got = sdpa.attend(q, k, v, score, align, mask=masks_causal(70, 75)).context
    assert got.shape == dense.attend(q, k, v, score, align).context.shape == (0, 2, 70, d_v)
