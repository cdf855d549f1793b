"""Kernelized attention by chunks of rows (the non-causal path of Performer and RFA) gives the
unchunked computation's context and gradients, float64, for chunk sizes that do and do not
divide N, with key masks and broadcast batch dims; the reference forms the whole feature maps
and sums them at once (Katharopoulos eq. 5)."""

from __future__ import annotations

import pytest
import torch

from attnkit import masks
from attnkit.efficient import LinearAttention, Performer, RandomFeatureAttention
from attnkit.efficient import kernelized as kz

D = torch.float64


def _inputs(seed=0, lead_q=(2, 3), lead_kv=(2, 3), m_rows=11, n=13, d=5, dv=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead_q, m_rows, d, generator=g, dtype=D, requires_grad=True)
    k = torch.randn(*lead_kv, n, d, generator=g, dtype=D, requires_grad=True)
    v = torch.randn(*lead_kv, n, dv, generator=g, dtype=D, requires_grad=True)
    w = torch.randn(d, 7, generator=g, dtype=D, requires_grad=True)
    return q, k, v, w


def _phi(x, w):
    """A positive feature map with a parameter, row by row."""
    return torch.exp(torch.tanh(x @ w))


def _grads(out, tensors, seed=5):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad((out * weight).sum(), tensors)


def _check(q, k, v, w, keep, chunk):
    ref = kz.feature_attention(_phi(q, w), _phi(k, w), v, keep)
    out = kz.chunked_feature_attention(_phi, _phi, q, k, v, keep, params=(w,), chunk_size=chunk)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads(out, (q, k, v, w)), _grads(ref, (q, k, v, w)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 100])  # 4 and 5 do not divide N = 13
def test_chunked_equals_the_whole_maps_forward_and_gradients(chunk):
    _check(*_inputs(), keep=None, chunk=chunk)


@pytest.mark.parametrize("chunk", [3, 13])
def test_chunked_honours_key_masks_like_the_whole_maps(chunk):
    q, k, v, w = _inputs(1)
    lengths = torch.tensor([13, 6])
    keep = kz.key_mask(masks.from_lengths(lengths, 13)[:, None], (2, 3, 11, 13), "test")
    _check(q, k, v, w, keep, chunk)
    with torch.no_grad():  # whatever padded keys hold never enters
        k[1, :, 6:] = torch.nan
        v[1, :, 6:] = torch.inf
    out = kz.chunked_feature_attention(_phi, _phi, q, k, v, keep, params=(w,), chunk_size=chunk)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, kz.feature_attention(_phi(q, w), _phi(k, w), v, keep))
    # a mask that keeps no key: context 0, finite gradients
    none = torch.zeros(1, 1, 1, dtype=torch.bool)
    zero = kz.chunked_feature_attention(_phi, _phi, q, k, v, none, params=(w,), chunk_size=chunk)
    assert (zero == 0).all()


def test_chunked_broadcasts_batch_dims_and_reduces_their_gradients():
    _check(*_inputs(2, lead_q=(2, 3), lead_kv=(1, 3)), keep=None, chunk=4)
    _check(*_inputs(3, lead_q=(1, 1), lead_kv=(2, 3)), keep=None, chunk=6)


def test_chunked_gradcheck_and_partial_gradients():
    q, k, v, w = _inputs(4, lead_q=(2,), lead_kv=(2,), m_rows=5, n=7, d=3, dv=2)

    def f(q, k, v, w):
        return kz.chunked_feature_attention(_phi, _phi, q, k, v, params=(w,), chunk_size=3)

    assert torch.autograd.gradcheck(f, (q, k, v, w))
    # only v asks for gradients: the rest are not computed, v's equal the reference's
    q2, k2, w2 = (x.detach() for x in (q, k, w))
    out = f(q2, k2, v, w2)
    (got,) = _grads(out, (v,))
    (want,) = _grads(kz.feature_attention(_phi(q2, w2), _phi(k2, w2), v), (v,))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(f(q, k, v, w), out.detach(), rtol=1e-12, atol=1e-12)
    # second derivatives (create_graph, e.g. a gradient penalty) are those of the whole maps
    assert torch.autograd.gradgradcheck(f, (q, k, v, w))


def _module_check(part, q, k, v, mask, keep, full, params):
    out = part(q, k, v, mask=mask).context
    ref = kz.feature_attention(*full(), v, keep)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    tensors = (q, k, v, *params)
    for got, want in zip(_grads(out, tensors), _grads(ref, tensors), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the weights path forms the whole maps: same context
    both = part(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(both.context, out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["softmax", "relu"])
@pytest.mark.parametrize("elements", [32 * 24, 1 << 18])  # 16-row chunks of N = 37, or one
def test_performer_by_chunks_equals_its_whole_feature_maps(monkeypatch, kernel, elements):
    monkeypatch.setattr(kz, "CHUNK_ELEMENTS", elements)
    monkeypatch.setattr(kz, "WHOLE_BYTES", 0)  # by chunks even at this size
    q, k, v, _ = _inputs(6, lead_q=(2,), lead_kv=(2,), m_rows=37, n=37, d=8, dv=3)
    with torch.no_grad():
        k[1] += 3.0  # a sequence whose largest exponent lies far from the first chunk's
    part = Performer(8, 24, kernel=kernel, dtype=D)
    mask = masks.from_lengths(torch.tensor([37, 20]), 37)
    keep = kz.key_mask(mask, (2, 37, 37), "test")

    def full():
        return part.features(q, is_query=True), part.features(k, is_query=False, keep=keep)

    def unmasked():
        return part.features(q, is_query=True), part.features(k, is_query=False)

    _module_check(part, q, k, v, mask, keep, full, ())
    _module_check(part, q, k, v, None, None, unmasked, ())


def test_performer_key_stabiliser_by_chunks_is_the_maximum_over_all_real_keys(monkeypatch):
    _, k, _, _ = _inputs(7, lead_q=(2,), lead_kv=(2,), m_rows=40, n=40, d=8)
    part = Performer(8, 24, dtype=D)
    keep = kz.key_mask(masks.from_lengths(torch.tensor([40, 25]), 40), (2, 40, 40), "t")
    x = k * 8**-0.25
    logits = x @ part.omega.T - (x * x).sum(-1, keepdim=True) / 2
    want = torch.where(keep, logits, -torch.inf).amax((-1, -2), keepdim=True)
    for chunk in (16, 7, 40):
        torch.testing.assert_close(part._key_shift(k, keep, chunk), want, rtol=0, atol=0)


@pytest.mark.parametrize("elements", [64 * 16, 1 << 18])  # 16-row chunks of N = 29, or one
def test_rfa_by_chunks_equals_its_whole_feature_maps_and_learns_sigma(monkeypatch, elements):
    monkeypatch.setattr(kz, "CHUNK_ELEMENTS", elements)
    monkeypatch.setattr(kz, "WHOLE_BYTES", 0)  # by chunks even at this size
    q, k, v, _ = _inputs(8, lead_q=(2,), lead_kv=(2,), m_rows=29, n=29, d=6, dv=3)
    part = RandomFeatureAttention(6, 32, sigma=1.3, dtype=D)
    with torch.no_grad():
        part.log_sigma.add_(torch.linspace(-0.2, 0.2, 6, dtype=D))
    mask = masks.from_lengths(torch.tensor([29, 11]), 29)
    keep = kz.key_mask(mask, (2, 29, 29), "test")

    def full():
        return part.features(q), part.features(k)

    _module_check(part, q, k, v, mask, keep, full, (part.log_sigma,))


@pytest.mark.parametrize("feature_map", ["elu+1", "relu"])
def test_linear_attention_equals_its_whole_feature_maps(monkeypatch, feature_map):
    # elementwise maps are the inputs' size: formed whole whatever WHOLE_BYTES says
    monkeypatch.setattr(kz, "WHOLE_BYTES", 0)
    q, k, v, _ = _inputs(10, lead_q=(2,), lead_kv=(2,), m_rows=33, n=33, d=6, dv=3)
    part = LinearAttention(feature_map)
    mask = masks.from_lengths(torch.tensor([33, 14]), 33)
    keep = kz.key_mask(mask, (2, 33, 33), "test")

    def full():
        return part.phi(q), part.phi(k)

    _module_check(part, q, k, v, mask, keep, full, ())


def test_small_maps_are_formed_whole_and_large_ones_by_chunks(monkeypatch):
    calls = []
    real = kz.chunked_feature_attention
    monkeypatch.setattr(
        kz, "chunked_feature_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    q, k, v, _ = _inputs(9, lead_q=(2,), lead_kv=(2,), m_rows=20, n=20, d=6, dv=3)
    part = RandomFeatureAttention(6, 32, dtype=D)
    whole = part(q, k, v).context
    assert not calls  # 2 x 20 x 64 float64 entries: far under WHOLE_BYTES
    monkeypatch.setattr(kz, "WHOLE_BYTES", 2 * 20 * 64 * 8 - 1)
    torch.testing.assert_close(part(q, k, v).context, whole, rtol=1e-12, atol=1e-12)
    assert calls == [1]


@pytest.mark.parametrize("chunk", [1, 3, 4, 13])
@pytest.mark.parametrize("bad", [torch.nan, torch.inf])
def test_causal_rows_are_untouched_by_a_non_finite_later_key_or_value(chunk, bad):
    """Query i of the causal form reads keys j ≤ i only (Katharopoulos eqs. 8-9), so a NaN or
    inf at position t (in the same block or a later one) leaves rows i < t as they were; the
    reference is the loop over prefixes."""
    g = torch.Generator().manual_seed(3)
    fq, fk = (torch.rand(2, 13, 4, generator=g, dtype=D) + 0.1 for _ in range(2))
    v = torch.randn(2, 13, 3, generator=g, dtype=D)
    rows = []
    for i in range(13):
        w = torch.einsum("bm,bjm->bj", fq[:, i], fk[:, : i + 1])
        rows.append(torch.einsum("bj,bjd->bd", w, v[:, : i + 1]) / w.sum(-1, keepdim=True))
    ref = torch.stack(rows, 1)
    t = 6
    fk_bad, v_bad = fk.clone(), v.clone()
    fk_bad[:, t], v_bad[:, t + 1] = bad, bad
    out = kz.causal_feature_attention(fq, fk_bad, v_bad, chunk_size=chunk)
    torch.testing.assert_close(out[:, :t], ref[:, :t])
    torch.testing.assert_close(kz.causal_feature_attention(fq, fk, v, chunk_size=chunk), ref)


def test_zero_denominators_give_zero_context_and_finite_gradients():
    """ReLU features that vanish for a query (φ(q) = 0): context 0 and gradients 0 for that
    row, the other rows as the plain ratio (Katharopoulos eq. 5)."""
    g = torch.Generator().manual_seed(4)
    fq = torch.rand(2, 5, 3, generator=g, dtype=D)
    fq[:, 1] = 0
    fq.requires_grad_()
    fk = torch.rand(2, 6, 3, generator=g, dtype=D, requires_grad=True)
    v = torch.randn(2, 6, 4, generator=g, dtype=D, requires_grad=True)
    out = kz.feature_attention(fq, fk, v)
    s = fq @ fk.transpose(-1, -2)
    ref = s / s.sum(-1, keepdim=True) @ v
    assert (out[:, 1] == 0).all()
    keep = torch.tensor([True, False, True, True, True])
    torch.testing.assert_close(out[:, keep], ref[:, keep])
    out.sum().backward()
    assert torch.isfinite(fq.grad).all() and torch.isfinite(fk.grad).all()
