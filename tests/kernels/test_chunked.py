"""Chunked evaluation equals the dense formula for every score × streamable alignment, forward
and gradients (inputs, bias, and every parameter), with ragged blocks and empty blocks."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from registered_parts import ALIGNMENTS, SCORES, Dims

import attnkit as ak
from attnkit.core import prepare_call
from attnkit.kernels import Call, chunked, dense

DIMS = Dims(max_len=32)
STREAMABLE = [a for a in ALIGNMENTS if chunked.supports(ALIGNMENTS[a](DIMS))]


def test_streamable_alignments_are_the_ones_that_declare_it():
    for name, make in ALIGNMENTS.items():
        align = make(DIMS)
        if chunked.supports(align):
            assert align.streamable, name
    assert set(STREAMABLE) >= {
        "softmax",
        "softmax[learned-temperature]",
        "sparsemax",
        "entmax15",
        "entmax",
        "sigmoid",
    }


def _case(score: str, align: str, dtype: torch.dtype, seed: int = 0):
    torch.manual_seed(seed)
    s = SCORES[score](DIMS).to(dtype)
    a = ALIGNMENTS[align](DIMS).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(2, 7, DIMS.d_q, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 11, DIMS.d_k, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 11, DIMS.d_v, generator=g, dtype=dtype, requires_grad=True)
    bias = torch.randn(7, 11, generator=g, dtype=dtype, requires_grad=True)
    mask = torch.rand(2, 7, 11, generator=g) > 0.25
    mask[0, :, 3:9] = False  # empties whole key blocks
    mask[1, 4] = False  # a row with no key
    if s.mixes_keys:  # it takes the mask itself, densely (the chunked kernel refuses it)
        mask = None
    return s, a, q, k, v, bias, mask


def _grads(out, wrt, r):
    grads = torch.autograd.grad((out * r).sum(), wrt, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt, strict=True)]


@pytest.mark.parametrize("chunk", [1, 3, 4, 11, 16])
@pytest.mark.parametrize(("score", "align"), list(itertools.product(SCORES, STREAMABLE)))
def test_chunked_equals_dense_float64(score, align, chunk):
    s, a, q, k, v, bias, mask = _case(score, align, torch.float64)
    ref = dense.attend(q, k, v, s, a, mask=mask, bias=bias, need_weights=True)
    out = chunked.attend(q, k, v, s, a, mask=mask, bias=bias, need_weights=True, chunk_size=chunk)
    torch.testing.assert_close(out.context, ref.context, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out.weights, ref.weights.detach(), atol=1e-10, rtol=1e-10)
    wrt = [q, k, v, bias, *s.parameters(), *a.parameters()]
    r = torch.randn_like(ref.context)
    for g_out, g_ref in zip(_grads(out.context, wrt, r), _grads(ref.context, wrt, r), strict=True):
        # Parameters of the alignment (a learned temperature) are float32 buffers of the module.
        tol = 1e-10 if g_ref.dtype == torch.float64 else 1e-5
        torch.testing.assert_close(g_out, g_ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(("score", "align"), list(itertools.product(SCORES, STREAMABLE)))
def test_chunked_equals_dense_float32(score, align):
    s, a, q, k, v, bias, mask = _case(score, align, torch.float32)
    ref = dense.attend(q, k, v, s, a, mask=mask, bias=bias)
    out = chunked.attend(q, k, v, s, a, mask=mask, bias=bias, chunk_size=4)
    torch.testing.assert_close(out.context, ref.context, atol=1e-5, rtol=1e-5)
    wrt = [q, k, v, *s.parameters()]
    r = torch.randn_like(ref.context)
    for g_out, g_ref in zip(_grads(out.context, wrt, r), _grads(ref.context, wrt, r), strict=True):
        torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5)


def test_heads_and_broadcast_batch_dims():
    torch.manual_seed(0)
    s = ak.scores.Additive(4, 4, 5, num_heads=3).double()
    q = torch.randn(2, 3, 6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 9, 4, dtype=torch.float64, requires_grad=True)  # broadcast over B
    v = torch.randn(1, 3, 9, 2, dtype=torch.float64, requires_grad=True)
    a = ak.alignments.Entmax15()
    ref = dense.attend(q, k, v, s, a)
    out = chunked.attend(q, k, v, s, a, chunk_size=2)
    torch.testing.assert_close(out.context, ref.context)
    r = torch.randn_like(ref.context)
    for g1, g2 in zip(
        _grads(out.context, [q, k, v], r), _grads(ref.context, [q, k, v], r), strict=True
    ):
        torch.testing.assert_close(g1, g2)


def test_unsupported_alignment_is_refused():
    q = torch.randn(1, 3, 4)
    with pytest.raises(
        ValueError, match="the Hard alignment does not implement the streaming protocol"
    ):
        ak.attention(q, q, align="hard", chunk_size=2)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        ak.attention(q, q, score="dot", align="sparsemax", chunk_size=0)


def test_attention_dispatches_large_problems_to_chunks():
    torch.manual_seed(0)
    s = ak.scores.Additive(4, 4, 8)
    q, k = torch.randn(1, 6, 4), torch.randn(1, 10, 4)
    with mock.patch.object(chunked, "attend", wraps=chunked.attend) as spy:
        ak.attention(q, k, score=s)
        assert spy.call_count == 0  # small: dense
        with mock.patch.object(chunked, "DENSE_LIMIT", 100):
            ak.attention(q, k, score=s)
            assert spy.call_count == 1
            ak.attention(q, k, score=s, align="hard")  # not streamable: dense
            assert spy.call_count == 1
        ak.attention(q, k, score=s, chunk_size=3)  # forced
        assert spy.call_count == 2


def _input_grads(out, *xs):
    return torch.autograd.grad(out.context.square().sum(), xs)


def test_values_with_more_batch_dims_than_queries_and_keys():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    got = ak.attention(q, k, v, chunk_size=2, kernel="chunked")
    ref = ak.attention(q, k, v, kernel="dense")
    assert got.context.shape == (3, 2, 5, 4)
    torch.testing.assert_close(got.context, ref.context)
    for a, b in zip(_input_grads(got, q, k, v), _input_grads(ref, q, k, v), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("align", ["softmax", "sparsemax"])
def test_rank_zero_and_rank_one_bias_and_mask(align):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 6))
    bias = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    got = ak.attention(q, k, v, align=align, bias=bias, chunk_size=2, kernel="chunked")
    ref = ak.attention(q, k, v, align=align, kernel="dense")  # a constant bias changes nothing
    torch.testing.assert_close(got.context, ref.context)
    row_bias = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True, False])
    got = ak.attention(q, k, v, align=align, bias=row_bias, mask=mask, chunk_size=2)
    ref = ak.attention(q, k, v, align=align, bias=row_bias, mask=mask, kernel="dense")
    torch.testing.assert_close(got.context, ref.context)


@pytest.mark.parametrize("kernel", ["dense", "chunked"])
def test_a_key_mask_of_rank_one_keeps_nan_in_masked_keys_out(kernel):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, n, 4, generator=g, dtype=torch.float64) for n in (5, 6, 6))
    k[:, -1], v[:, -1] = float("nan"), float("nan")
    mask = torch.tensor([True] * 5 + [False])
    got = ak.attention(q, k, v, mask=mask, kernel=kernel, need_weights=True)
    ref = ak.attention(q, k[:, :-1], v[:, :-1], kernel="dense", need_weights=True)
    torch.testing.assert_close(got.context, ref.context)
    torch.testing.assert_close(got.weights[..., :-1], ref.weights)


# ---- block-sparse dot-product softmax through the fused kernel (forward, no gradient) --------


def _reference(q, k, v, allowed, bias=None, shift=None):
    """softmax(q·kᵀ/√d + bias + shift) v over the allowed keys, written out; 0 for a row with
    no allowed key."""
    e = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    for extra in (bias, shift):
        if extra is not None:
            e = e + extra
    e = e.masked_fill(~allowed, float("-inf"))
    top = e.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=e.dtype))
    w = torch.exp(e - top)
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, (w @ v) / torch.where(den > 0, den, 1.0), 0.0)


def _alibi(heads):
    slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(heads)], dtype=torch.float64)

    def score_mod(e, b, h, q_idx, kv_idx):
        return e + slopes[h].to(e.dtype) * (kv_idx - q_idx).to(e.dtype)

    return score_mod, slopes


def _fused_spy():
    return mock.patch.object(chunked.fused, "sparse_fused", side_effect=chunked.fused.sparse_fused)


SPARSE = {
    "causal": ak.patterns.causal(),
    "window": ak.patterns.sliding_window(5),
    "window of a block": ak.patterns.sliding_window(8),
    "wide window": ak.patterns.sliding_window(24),
    "causal window": ak.patterns.sliding_window(9, causal=True),
    "document": ak.patterns.packed(torch.tensor([0, 7, 8, 30, 45])),
    "bigbird": ak.patterns.bigbird(3, 45, global_positions=(2,), random_blocks=1, block=8),
    "rows with no key": lambda b, h, i, j: (j <= i) & (i % 9 != 4) & (i < 40),
}


@pytest.mark.parametrize("blocks", [(8, 8), (5, 7), (16, 16)])
@pytest.mark.parametrize("name", list(SPARSE))
def test_fused_block_sparse_equals_the_masked_reference(name, blocks):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 45, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q[0, 1, 10] += 1e4  # one query and one key ±1e4 away from the rest
    k[1, 2, 20] -= 1e4
    bm = ak.patterns.block_mask(SPARSE[name], 45, block_q=blocks[0], block_k=blocks[1])
    allowed = ak.patterns.dense(SPARSE[name], 45, 45)
    bias = torch.randn(45, 45, generator=g, dtype=torch.float64)
    padding = torch.rand(2, 1, 45, 45, generator=g) > 0.2
    mod, slopes = _alibi(3)
    pos = torch.arange(45, dtype=torch.float64)
    shift = slopes.view(3, 1, 1) * (pos[None, :] - pos[:, None])
    cases = [
        ({}, _reference(q, k, v, allowed)),
        ({"bias": bias}, _reference(q, k, v, allowed, bias)),
        ({"mask": padding, "bias": bias}, _reference(q, k, v, allowed & padding, bias)),
        ({"score_mod": mod}, _reference(q, k, v, allowed, shift=shift)),
        ({"mask": padding, "score_mod": mod}, _reference(q, k, v, allowed & padding, None, shift)),
    ]
    for kwargs, ref in cases:
        with _fused_spy() as spy:
            out = ak.attention(q, k, v, block_mask=bm, **kwargs).context
        assert spy.call_count == 1, kwargs
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
        # the tiled path (gradients on, the fused backward off) gives the same
        qg = q.clone().requires_grad_()
        with mock.patch.object(chunked.fused, "FLASH_BACKWARD", None):
            tiled = ak.attention(qg, k, v, block_mask=bm, **kwargs).context
        torch.testing.assert_close(tiled.detach(), ref, atol=1e-10, rtol=1e-10)
    if name == "causal" and blocks == (8, 8):
        # its diagonal tiles were evaluated causally
        pieces = [p for _, _, ps in chunked.schedule.SCHEDULES[id(bm)][1] for p in ps]
        assert any(p.causal for p in pieces)
        assert not any(p.flip for p in pieces)
    if name == "window of a block" and blocks == (8, 8):
        # a narrow band: one masked call per group of rows, no merge
        assert all(
            len(ps) == 1 and ps[0].allowed is not None
            for _, _, ps in chunked.schedule.SCHEDULES[id(bm)][1]
        )


def test_fused_block_sparse_float32_and_a_repeated_block_mask():
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(3))
    pattern = ak.patterns.sliding_window(40, causal=True)
    bm = ak.patterns.block_mask(pattern, 300, block_q=32, block_k=32)
    ref = _reference(*(x.double() for x in (q, k, v)), ak.patterns.dense(pattern, 300, 300))
    with _fused_spy() as spy:
        first = ak.attention(q, k, v, block_mask=bm).context
        again = ak.attention(q, k, v, block_mask=bm).context  # the cached schedule
    assert spy.call_count == 2
    torch.testing.assert_close(first.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, first)


def test_fused_path_is_skipped_when_it_would_not_be_exact():
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    bm = ak.patterns.block_mask(ak.patterns.causal(), 40, block_q=8, block_k=8)
    allowed = ak.patterns.dense(ak.patterns.causal(), 40, 40)
    v_nan = v.clone()
    v_nan[:, -1] = float("nan")  # only the last query may read it
    with _fused_spy() as spy:
        out = ak.attention(q, k, v_nan, block_mask=bm).context
        capped = ak.attention(
            q, k, v, block_mask=bm, score_mod=lambda e, b, h, i, j: 5 * torch.tanh(e / 5)
        ).context
        ak.attention(q, k, v, align="sparsemax", block_mask=bm)
        ak.attention(q.requires_grad_(), k, v, block_mask=bm)
    assert spy.call_count == 0
    torch.testing.assert_close(out[:, :-1], _reference(q, k, v, allowed)[:, :-1])
    assert torch.isnan(out[:, -1]).all()
    e = q @ k.transpose(-1, -2) / 8**0.5
    w = torch.softmax((5 * torch.tanh(e / 5)).masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(capped, w @ v)


@pytest.mark.parametrize("through", ["block_mask", "dense mask"])
def test_a_nan_key_masked_for_some_rows_reaches_only_the_rows_that_attend_it(through):
    """A key masked for some query rows is NaN: the rows that may attend it are NaN, the others
    are exact (the fused pieces add the mask to the scores, and NaN + −inf would be NaN)."""
    g = torch.Generator().manual_seed(14)
    n = 1024  # a dense mask of this size is evaluated block-sparsely (from_dense_auto)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pattern = ak.patterns.sliding_window(10, causal=True)
    allowed = ak.patterns.dense(pattern, n, n)
    k_nan = k.clone()
    k_nan[..., 50, :] = float("nan")
    if through == "block_mask":
        bm = ak.patterns.block_mask(pattern, n, block_q=32, block_k=32)
        out = ak.attention(q, k_nan, v, block_mask=bm).context
    else:
        out = ak.attention(q, k_nan, v, mask=allowed).context
    reads = allowed[:, 50]  # the rows that may attend key 50
    assert torch.isnan(out[..., reads, :]).all()
    ref = _reference(q, k, v, allowed)
    torch.testing.assert_close(out[..., ~reads, :], ref[..., ~reads, :])


def _block_call(q, k, v, bm):
    score, align = ak.scores.ScaledDot(), ak.alignments.Softmax()
    return Call(q, k, v, score, align, torch.Size((*q.shape[:-1], k.shape[-2])), block_mask=bm)


def test_fused_path_is_only_for_cpu_tensors():
    """The fused pieces are PyTorch's CPU kernel: inputs elsewhere take the tiled path."""
    bm = ak.patterns.block_mask(ak.patterns.causal(), 40, block_q=8, block_k=8)
    fused = ak.kernels.get("chunked").path("fused")
    on_cpu = [torch.zeros(1, 40, 8) for _ in range(3)]
    assert fused.reasons_not_supported(_block_call(*on_cpu, bm)) == []
    elsewhere = [torch.zeros(1, 40, 8, device="meta") for _ in range(3)]
    reasons = fused.reasons_not_supported(_block_call(*elsewhere, bm))
    assert reasons == ["the chunked kernel's fused path runs on cpu, not on meta"]


@pytest.mark.parametrize("through", ["dense mask", "block_mask", "Attention"])
def test_values_of_another_size_than_the_keys_take_the_tiled_path(through):
    """The fused kernel wants one head size for q, k and v: d_v != d_k is evaluated by the tiled
    path, and explain says so."""
    g = torch.Generator().manual_seed(15)
    n = 1152  # a dense window mask of this size is evaluated block-sparsely (from_dense_auto)
    q, k = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64)
    pattern = ak.patterns.sliding_window(64)
    allowed = ak.patterns.dense(pattern, n, n)
    kwargs = {"mask": allowed}
    if through == "block_mask":
        kwargs = {"block_mask": ak.patterns.block_mask(pattern, n, block_q=64, block_k=64)}
    with _fused_spy() as spy:
        if through == "Attention":
            out = ak.Attention()(q, k, v, **kwargs).context
        else:
            out = ak.attention(q, k, v, **kwargs).context
    assert spy.call_count == 0
    torch.testing.assert_close(out, _reference(q, k, v, allowed))
    told = ak.kernels.explain(q, k, v, **kwargs)
    assert (told.chosen, told.path) == ("chunked", "tiled")
    skipped = dict(told.verdict("chunked").skipped_paths)
    assert skipped["fused"] == (
        "the chunked kernel's fused path needs as many value features as query and key "
        "features (d_v = 4, d = 8)",
    )
    forced = ak.kernels.get("chunked").path("fused")
    with pytest.raises(
        ValueError, match=r"kernel 'chunked', path 'fused' cannot evaluate.*d_v = 4"
    ):
        forced.run(prepare_call(q, k, v, **kwargs))


@pytest.mark.cuda
def test_block_sparse_on_cuda_equals_the_masked_reference():
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(2, 100, 16, generator=g) for _ in range(3))
    window = ak.patterns.sliding_window(20)
    bm = ak.kernels.BlockMask.from_mask_mod(window, 100, 100, block_q=32, block_k=32, device="cuda")
    allowed = ak.patterns.dense(window, 100, 100)
    out = ak.attention(q.cuda(), k.cuda(), v.cuda(), block_mask=bm).context
    torch.testing.assert_close(out.cpu(), _reference(q, k, v, allowed), atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("align", ["softmax", "sparsemax"])
def test_chunked_gradients_on_cuda_equal_the_dense_kernel(align):
    """The tiled path's backward made its gradient buffers on the CPU (a crash on CUDA)."""
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(2, 70, 8, generator=g, dtype=torch.float64) for _ in range(3))
    grads = {}
    for kernel in ("chunked", "dense"):
        inputs = [x.cuda().requires_grad_() for x in (q, k, v)]
        out = ak.attention(
            *inputs, align=align, kernel=kernel, chunk_size=16 if kernel == "chunked" else None
        ).context
        grads[kernel] = torch.autograd.grad(out.square().sum(), inputs)
    for a, b in zip(grads["chunked"], grads["dense"], strict=True):
        assert a.device.type == "cuda"
        torch.testing.assert_close(a, b)


def test_only_score_mods_of_the_form_e_plus_f_are_read_as_additive():
    slopes = torch.tensor([0.5, 0.25])

    def data_dependent(e, b, h, i, j):
        return e + 1 if bool(e.max() > 0) else e

    additive = {
        "alibi": lambda e, b, h, i, j: e + slopes[h] * (j - i).to(e.dtype),
        "constant": lambda e, b, h, i, j: e + 2.0,
        "bias first": lambda e, b, h, i, j: (i - j).abs().to(e.dtype) + e,
        "subtract": lambda e, b, h, i, j: e - (i - j).to(e.dtype),
        "sum then difference": lambda e, b, h, i, j: (e + 1.0) - slopes[h] * i.to(e.dtype),
    }
    other = {
        "cap": lambda e, b, h, i, j: 5 * torch.tanh(e / 5),
        "scaled": lambda e, b, h, i, j: 2 * e + (i - j).to(e.dtype),
        "e + e": lambda e, b, h, i, j: e + e * (i - j).to(e.dtype),
        "minus e": lambda e, b, h, i, j: (i - j).to(e.dtype) - e,
        "data dependent": data_dependent,
    }
    for name, mod in additive.items():
        assert chunked.forms.is_additive(mod), name
    for name, mod in other.items():
        assert chunked.forms.is_additive(mod) is None, name


def test_fused_block_sparse_with_a_temperature_bias_and_score_mod():
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(2, 3, 37, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pattern = ak.patterns.sliding_window(8, causal=True)
    bm = ak.patterns.block_mask(pattern, 37, block_q=8, block_k=8)
    allowed = ak.patterns.dense(pattern, 37, 37)
    bias = torch.randn(37, 37, generator=g, dtype=torch.float64)
    mod, slopes = _alibi(3)
    pos = torch.arange(37, dtype=torch.float64)
    shift = slopes.view(3, 1, 1) * (pos[None, :] - pos[:, None])
    align = ak.alignments.Softmax(temperature=2.5)
    for kwargs, extra in [({}, None), ({"bias": bias}, bias), ({"score_mod": mod}, shift)]:
        with _fused_spy() as spy:
            out = ak.attention(q, k, v, align=align, block_mask=bm, **kwargs).context
        assert spy.call_count == 1
        e = q @ k.transpose(-1, -2) / 8**0.5 + (0 if extra is None else extra)
        w = torch.softmax((e / 2.5).masked_fill(~allowed, float("-inf")), -1)
        torch.testing.assert_close(out, w @ v, atol=1e-10, rtol=1e-10)
    both = ak.attention(q, k, v, align=align, block_mask=bm, bias=bias, score_mod=mod).context
    e = q @ k.transpose(-1, -2) / 8**0.5 + bias + shift
    w = torch.softmax((e / 2.5).masked_fill(~allowed, float("-inf")), -1)
    torch.testing.assert_close(both, w @ v, atol=1e-10, rtol=1e-10)


# ---- block-sparse training through the fused kernel's backward --------------------------------


def _grad_spy():
    return mock.patch.object(
        chunked.fused, "sparse_fused_grad", side_effect=chunked.fused.sparse_fused_grad
    )


def _outputs_and_grads(fn, inputs, grad):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("blocks", [(8, 8), (5, 7)])
@pytest.mark.parametrize("name", list(SPARSE))
def test_fused_backward_equals_the_gradients_of_the_masked_reference(name, blocks):
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 3, 45, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q[0, 1, 10] += 1e4  # rows and keys ±1e4 away from the rest
    k[1, 2, 20] -= 1e4
    grad = torch.randn(2, 3, 45, 8, generator=g, dtype=torch.float64)
    bm = ak.patterns.block_mask(SPARSE[name], 45, block_q=blocks[0], block_k=blocks[1])
    allowed = ak.patterns.dense(SPARSE[name], 45, 45)
    bias = torch.randn(45, 45, generator=g, dtype=torch.float64)
    padding = torch.rand(2, 1, 45, 45, generator=g) > 0.2
    mod, slopes = _alibi(3)
    pos = torch.arange(45, dtype=torch.float64)
    shift = slopes.view(3, 1, 1) * (pos[None, :] - pos[:, None])
    cases = [
        ({}, lambda q, k, v: _reference(q, k, v, allowed)),
        ({"bias": bias}, lambda q, k, v: _reference(q, k, v, allowed, bias)),
        ({"mask": padding}, lambda q, k, v: _reference(q, k, v, allowed & padding)),
        ({"score_mod": mod}, lambda q, k, v: _reference(q, k, v, allowed, shift=shift)),
        (
            {"mask": padding, "score_mod": mod},
            lambda q, k, v: _reference(q, k, v, allowed & padding, shift=shift),
        ),
    ]
    for kwargs, reference in cases:
        with _grad_spy() as spy:
            got = _outputs_and_grads(
                lambda q, k, v, kw=kwargs: ak.attention(q, k, v, block_mask=bm, **kw).context,
                (q, k, v),
                grad,
            )
        assert spy.call_count == 1, kwargs
        want = _outputs_and_grads(reference, (q, k, v), grad)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_backward_in_low_precision(dtype):
    # float32 takes the fused backward; bfloat16 the tiled one (the fused kernel's CPU path is
    # float32 / float64 here); both against the float64 reference.
    g = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(1, 2, 150, 16, generator=g, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(1, 2, 150, 16, generator=g, dtype=torch.float64)
    pattern = ak.patterns.sliding_window(20, causal=True)
    bm = ak.patterns.block_mask(pattern, 150, block_q=32, block_k=32)
    allowed = ak.patterns.dense(pattern, 150, 150)
    with _grad_spy() as spy:
        got = _outputs_and_grads(
            lambda q, k, v: ak.attention(q, k, v, block_mask=bm).context,
            [x.to(dtype) for x in (q, k, v)],
            grad.to(dtype),
        )
    assert spy.call_count == (1 if dtype == torch.float32 else 0)
    want = _outputs_and_grads(lambda q, k, v: _reference(q, k, v, allowed), (q, k, v), grad)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), b, atol=tol, rtol=tol)


def test_fused_backward_is_not_taken_for_gradients_it_does_not_give():
    g = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(1, 40, 8, generator=g, dtype=torch.float64) for _ in range(3))
    bm = ak.patterns.block_mask(ak.patterns.causal(), 40, block_q=8, block_k=8)
    allowed = ak.patterns.dense(ak.patterns.causal(), 40, 40)
    bias = torch.randn(40, 40, generator=g, dtype=torch.float64, requires_grad=True)
    with _grad_spy() as spy:
        out = ak.attention(q.requires_grad_(), k, v, block_mask=bm, bias=bias).context
    assert spy.call_count == 0  # a bias gradient: the tiled path
    out.sum().backward()
    ref_bias = bias.detach().clone().requires_grad_()
    _reference(q.detach(), k, v, allowed, ref_bias).sum().backward()
    torch.testing.assert_close(bias.grad, ref_bias.grad)


def test_narrow_bands_are_evaluated_in_rows_with_their_keys_cut():
    g = torch.Generator().manual_seed(24)
    n, w = 300, 20
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    pattern = ak.patterns.sliding_window(w)
    bm = ak.patterns.block_mask(pattern, n, block_q=32, block_k=32)
    with _fused_spy() as spy:
        out = ak.attention(q, k, v, block_mask=bm).context
    assert spy.call_count == 1
    torch.testing.assert_close(out, _reference(q, k, v, ak.patterns.dense(pattern, n, n)))
    rows = []
    for r0, r1, pieces in chunked.schedule.SCHEDULES[id(bm)][1]:
        assert len(pieces) == 1 and r1 - r0 <= chunked.schedule.BAND_ROWS
        # the keys the rows may attend, and no other
        assert (pieces[0].keys.k0, pieces[0].keys.k1) == (max(0, r0 - w), min(n, r1 + w))
        rows.append((r0, r1))
    assert rows[0][0] == 0 and rows[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))


def test_wide_bands_evaluate_their_triangular_tiles_causally():
    g = torch.Generator().manual_seed(25)
    n = 200
    q, k, v = (torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    grad = torch.randn(1, 1, n, 8, generator=g, dtype=torch.float64)
    pattern = ak.patterns.sliding_window(48)  # 5 full tiles and 2 triangular ones per row
    bm = ak.patterns.block_mask(pattern, n, block_q=16, block_k=16)
    allowed = ak.patterns.dense(pattern, n, n)
    mod, slopes = _alibi(1)
    pos = torch.arange(n, dtype=torch.float64)
    shift = slopes.view(1, 1, 1) * (pos[None, :] - pos[:, None])
    for kwargs, extra in [({}, None), ({"score_mod": mod}, shift)]:
        # (more keys than a narrow band's: not one masked range)
        with mock.patch.object(chunked.schedule, "NARROW_KEYS", 16 * 6):
            got = _outputs_and_grads(
                lambda q, k, v, kw=kwargs: (
                    ak.attention(q, k, v, block_mask=bm, kernel="chunked", **kw).context
                ),
                (q, k, v),
                grad,
            )
        want = _outputs_and_grads(
            lambda q, k, v, s=extra: _reference(q, k, v, allowed, shift=s), (q, k, v), grad
        )
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    pieces = [p for _, _, ps in chunked.schedule.SCHEDULES[id(bm)][1] for p in ps]
    assert any(p.flip for p in pieces) and any(p.causal and not p.flip for p in pieces)


def test_relative_score_mods_are_read_from_their_offsets():
    slopes = torch.tensor([0.5, 0.25])
    relative = {
        "alibi": lambda e, b, h, i, j: e + slopes[h] * (j - i).to(e.dtype),
        "constant": lambda e, b, h, i, j: e + 2.0,
        "distance": lambda e, b, h, i, j: (i - j).abs().to(e.dtype) + e,
    }
    other = {
        "query position": lambda e, b, h, i, j: e + i.to(e.dtype),
        "gated offset": lambda e, b, h, i, j: e + ((j - i) * (i > 1)).to(e.dtype),
        "cap": lambda e, b, h, i, j: 5 * torch.tanh(e / 5),
    }
    for name, mod in relative.items():
        assert chunked.forms.is_relative(mod), name
    for name, mod in other.items():
        assert not chunked.forms.is_relative(mod), name
    # f is evaluated once per call (at every offset), not once per tile, and gives the same
    g = torch.Generator().manual_seed(26)
    q, k, v = (torch.randn(1, 2, 77, 8, generator=g, dtype=torch.float64) for _ in range(3))
    bm = ak.patterns.block_mask(ak.patterns.causal(), 77, block_q=16, block_k=16)
    allowed = ak.patterns.dense(ak.patterns.causal(), 77, 77)
    pos = torch.arange(77, dtype=torch.float64)
    for name, extra in [
        ("alibi", slopes.double().view(2, 1, 1) * (pos[None, :] - pos[:, None])),
        ("distance", (pos[:, None] - pos[None, :]).abs()),
        ("query position", pos[:, None].expand(77, 77)),
    ]:
        with mock.patch.object(
            chunked.fused, "apply_score_mod", side_effect=chunked.fused.apply_score_mod
        ) as spy:
            out = ak.attention(q, k, v, block_mask=bm, score_mod=relative.get(name) or other[name])
        assert (spy.call_count == 1) == (name in relative), name
        torch.testing.assert_close(out.context, _reference(q, k, v, allowed, shift=extra))


def test_a_dense_mask_turned_into_a_block_mask_keeps_its_schedule_without_keeping_the_mask():
    import gc
    import weakref

    g = torch.Generator().manual_seed(27)
    n = 1024  # 8 blocks of 128 a side: converted
    q, k, v = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = ak.masks.window(n, n, 100)
    before = len(chunked.schedule.DENSE_SCHEDULES)
    first = ak.attention(q, k, v, mask=mask).context
    kept = len(chunked.schedule.DENSE_SCHEDULES)
    assert kept == before + 1
    again = ak.attention(q, k, v, mask=mask).context
    assert len(chunked.schedule.DENSE_SCHEDULES) == kept  # read from the kept schedule
    torch.testing.assert_close(again, first)
    torch.testing.assert_close(first, _reference(q, k, v, mask))
    mask[5, :] = False  # changed in place: read again
    changed = ak.attention(q, k, v, mask=mask).context
    torch.testing.assert_close(changed, _reference(q, k, v, mask))
    gone = weakref.ref(mask)
    del mask
    gc.collect()
    assert gone() is None


def _open_a_tile(m):
    return (0, slice(m - 1, m)), True  # an empty tile gets one allowed pair


def _close_a_tile(m):
    return (slice(128, 256), slice(0, 128)), False  # a visited tile: now empty


def _fill_a_tile(m):
    return (slice(0, 128), slice(0, 128)), True  # a partial tile: now full


def _inside_a_tile(m):
    return (500, slice(500, 501)), False  # one pair of a partial tile


@pytest.mark.parametrize("change", [_open_a_tile, _close_a_tile, _fill_a_tile, _inside_a_tile])
@pytest.mark.parametrize("write", ["numpy", "data"])
@pytest.mark.parametrize("d_v", [8, 4])  # the fused path, the tiled path
def test_a_mask_changed_where_its_version_does_not_see_is_converted_again(change, write, d_v):
    """A dense mask converted to a block mask on a first call, then changed through ``.numpy()``
    or ``.data`` (no version bump): the next call equals the same call on a fresh copy of the
    mask and the dense reference."""
    g = torch.Generator().manual_seed(28)
    n = 1152
    q, k = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 2, n, d_v, generator=g, dtype=torch.float64)
    mask = ak.patterns.dense(ak.patterns.sliding_window(64), n, n).clone()
    path = "fused" if d_v == 8 else "tiled"
    assert ak.kernels.explain(q, k, v, mask=mask).path == path
    ak.attention(q, k, v, mask=mask)  # the first call converts and keeps the conversion
    where, value = change(n)
    target = mask.numpy() if write == "numpy" else mask.data
    version = mask._version
    target[where] = value
    assert mask._version == version  # unseen by the version counter
    out = ak.attention(q, k, v, mask=mask).context
    fresh = ak.attention(q, k, v, mask=mask.clone()).context
    torch.testing.assert_close(out, fresh, atol=0, rtol=0)
    torch.testing.assert_close(out, _reference(q, k, v, mask))
