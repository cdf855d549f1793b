"""Kernels as registered parts: listing, forced and automatic selection with reasons, a new
kernel and a new streaming alignment added from this file alone."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import kernels
from attnkit.alignments import Alignment, AlignOutput
from attnkit.alignments.streaming import Streaming
from attnkit.kernels import Call, Kernel, dense


def _call(**kw) -> Call:
    q, k = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    base = {
        "q": q,
        "k": k,
        "v": k,
        "score": ak.scores.ScaledDot(),
        "align": ak.alignments.Softmax(),
    }
    base.update(kw)
    shape = torch.Size((2, 3, 5))
    return Call(shape=shape, **base)


def test_available_lists_the_kernels_by_priority():
    names = kernels.available()
    assert names[:3] == ["sdpa", "chunked", "dense"]
    assert kernels.get("dense").priority < kernels.get("chunked").priority


def test_unknown_kernel_names_the_closest():
    with pytest.raises(ValueError, match="did you mean 'chunked'"):
        kernels.get("chunkd")
    with pytest.raises(TypeError, match="kernel"):
        kernels.get(3)  # type: ignore[arg-type]


def test_automatic_selection():
    assert kernels.select(_call()).name == "sdpa"
    assert kernels.select(_call(need_weights=True)).name == "dense"
    assert kernels.select(_call(align=ak.alignments.Sparsemax())).name == "dense"
    assert kernels.select(_call(chunk_size=2)).name == "chunked"


def test_forced_kernel_that_cannot_run_gives_its_reasons():
    q = torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match=r"kernel 'sdpa' cannot evaluate.*not in dot-product form"):
        ak.attention(q, q, score=ak.scores.Additive(4, 4, 3), kernel="sdpa")
    with pytest.raises(ValueError, match=r"does not return the weights"):
        ak.attention(q, q, kernel="sdpa", need_weights=True)
    with pytest.raises(ValueError, match=r"learned; the chunked kernel needs a fixed"):
        ak.attention(q, q, align=ak.alignments.Entmax(1.5, learnable=True), kernel="chunked")
    with pytest.raises(ValueError, match=r"chunked kernel does not apply dropout"):
        ak.attention(q, q, kernel="chunked", dropout=0.5)
    with pytest.raises(ValueError, match=r"unknown kernel 'flash'"):
        ak.attention(q, q, kernel="flash")


def test_every_kernel_agrees_with_dense_when_forced():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 6, 4), torch.randn(2, 6, 5)
    mask = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    ref = ak.attention(q, k, v, mask=mask, kernel="dense").context
    for name in ("sdpa", "chunked"):
        out = ak.attention(q, k, v, mask=mask, kernel=name).context
        torch.testing.assert_close(out, ref)


def test_registering_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        kernels.register(kernels.get("dense"))
    with pytest.raises(TypeError, match="Kernel instance"):
        kernels.register(dense.Dense)  # type: ignore[arg-type]


class _Counting(Kernel):
    """A kernel defined in a test: evaluates densely and counts its calls."""

    name = "test-counting"
    priority = 99
    calls = 0

    def reasons_not_supported(self, call: Call) -> list[str]:
        return [] if call.score.dot_product_form else ["only dot-product scores"]

    def prefers(self, call: Call) -> bool:
        return call.k.shape[-2] == 7  # only for N = 7, so the rest of the suite is unaffected

    def attend(self, call: Call):
        type(self).calls += 1
        return kernels.get("dense").attend(call)


def test_a_new_kernel_plugs_in_without_editing_attnkit():
    kernel = _Counting()
    kernels.register(kernel)
    try:
        q = torch.randn(1, 2, 4)
        ak.attention(q, torch.randn(1, 7, 4))  # automatic: highest priority that prefers it
        assert _Counting.calls == 1
        ak.attention(q, torch.randn(1, 5, 4))
        assert _Counting.calls == 1
        with pytest.raises(ValueError, match="only dot-product scores"):
            ak.attention(q, q, score=ak.scores.Additive(4, 4, 3), kernel="test-counting")
    finally:
        kernels.base._KERNELS.pop(kernel.name)


class NormalisedSigmoid(Streaming, Alignment):
    """A toy streaming alignment: a_l = σ(e_l) / Σ_j σ(e_j).

    Streaming: statistic log Σ σ(e); weights σ(e)/Z; backward: ∂a_l/∂e_j = σ'(e_l)/Z·δ_lj −
    a_l σ'(e_j)/Z, so ∂L/∂e = s ⊙ (∂L/∂a − Σ_l a_l ∂L/∂a_l) with s = σ'(e)/Z and r = a.
    """

    label = ak.taxonomy.AlignmentKind.GLOBAL

    def forward(self, scores, mask=None, *, query=None):
        w = torch.sigmoid(scores)
        if mask is not None:
            w = torch.where(mask, w, 0.0)
        total = w.sum(-1, keepdim=True)
        return AlignOutput(w / torch.where(total > 0, total, 1.0))

    def stream_statistic(self, tiles):
        return torch.log(sum(torch.sigmoid(e).sum(-1, keepdim=True) for e in tiles()))

    def stream_weights(self, e, stat):
        return torch.sigmoid(e) / stat.exp()

    def stream_slope(self, p, stat):
        # σ' = σ(1 − σ) = (pZ)(1 − pZ); s = σ'/Z
        z = stat.exp()
        return p * (1 - p * z), p


@pytest.mark.parametrize("chunk", [1, 2, 5, 16])
def test_a_streaming_alignment_defined_here_runs_chunked_exactly(chunk):
    torch.manual_seed(1)
    align = NormalisedSigmoid()
    score = ak.scores.Additive(4, 4, 6).double()
    q = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 5, 9) > 0.3
    mask[1, 2] = False
    # reference: the formula, written out densely
    e = score(q, k)
    sig = torch.where(mask, torch.sigmoid(e), 0.0)
    total = sig.sum(-1, keepdim=True)
    ref = (sig / torch.where(total > 0, total, 1.0)) @ v
    out = ak.attention(q, k, v, score=score, align=align, mask=mask, chunk_size=chunk)
    torch.testing.assert_close(out.context, ref)
    r = torch.randn_like(ref)
    wrt = [q, k, v, *score.parameters()]
    g_out = torch.autograd.grad((out.context * r).sum(), wrt)
    g_ref = torch.autograd.grad((ref * r).sum(), wrt)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b)
    assert math.isclose(float(out.context[1, 2].detach().abs().sum()), 0.0)
