"""The flex kernel (FlexAttention on request) equals the masked softmax written out, with its
temperature, score_mod and rows with no key; it is opt-in, refuses what it cannot evaluate,
and falls back to the chunked kernel when FlexAttention fails. FlexAttention runs eagerly here
(its compiled form takes tens of seconds to build; benchmarks/bench_flex.py runs it); even
eagerly its set-up takes seconds, so the equality test is marked slow."""

from __future__ import annotations

import warnings
from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit.kernels import flex

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch without FlexAttention")


@pytest.fixture(autouse=True)
def eager_flex():
    flex.set_compiled(False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        yield
    flex.set_compiled(True)


def _reference(q, k, v, allowed, shift=None, temperature=1.0):
    e = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if shift is not None:
        e = e + shift
    e = (e / temperature).masked_fill(~allowed, float("-inf"))
    top = e.amax(-1, keepdim=True)
    w = torch.exp(e - torch.where(torch.isfinite(top), top, 0.0))
    den = w.sum(-1, keepdim=True)
    return torch.where(den > 0, (w @ v) / torch.where(den > 0, den, 1.0), 0.0)


@pytest.mark.slow  # FlexAttention's eager set-up alone takes about ten seconds
def test_flex_equals_the_masked_reference():
    g = torch.Generator().manual_seed(0)
    n = 72  # not a multiple of the blocks
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    q[0, 1, 7] += 1e4

    def pattern(b, h, i, j):
        return (j <= i) & ((i - j) <= 20) & (i % 17 != 3)  # rows with no key

    bm = ak.patterns.block_mask(pattern, n, block_q=16, block_k=16)
    allowed = ak.patterns.dense(pattern, n, n)
    slopes = torch.tensor([0.5, 0.125])

    def alibi(e, b, h, i, j):
        return e + slopes[h] * (j - i).to(e.dtype)

    pos = torch.arange(n, dtype=torch.float64)
    shift = slopes.double().view(2, 1, 1) * (pos[None, :] - pos[:, None])
    d = [x.double() for x in (q, k, v)]
    for kwargs, ref in [
        ({}, _reference(*d, allowed)),
        ({"score_mod": alibi}, _reference(*d, allowed, shift)),
        ({"align": ak.alignments.Softmax(temperature=2.0)}, _reference(*d, allowed, None, 2.0)),
    ]:
        out = ak.attention(q, k, v, block_mask=bm, kernel="flex", **kwargs).context
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_flex_is_opt_in_and_names_what_it_cannot_do():
    q = torch.randn(1, 2, 64, 8)
    bm = ak.patterns.block_mask(ak.patterns.causal(), 64, block_q=16, block_k=16)
    with mock.patch.object(flex, "_attend", side_effect=flex._attend) as spy:
        ak.attention(q, q, q, block_mask=bm)
    assert spy.call_count == 0  # never chosen automatically
    with pytest.raises(ValueError, match="flex"):
        ak.attention(q, q, q, block_mask=bm, kernel="flex", align="sparsemax")
    with pytest.raises(ValueError, match="backward"):
        ak.attention(q.requires_grad_(), q, q, block_mask=bm, kernel="flex")
    dense_bm = ak.kernels.BlockMask.from_dense(torch.ones(64, 64, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="mask function"):
        ak.attention(q.detach(), q, q, block_mask=dense_bm, kernel="flex")


def test_flex_failure_falls_back_to_the_chunked_kernel():
    q, k, v = (torch.randn(1, 2, 40, 8) for _ in range(3))
    bm = ak.patterns.block_mask(ak.patterns.causal(), 40, block_q=8, block_k=8)
    ref = _reference(q, k, v, ak.patterns.dense(ak.patterns.causal(), 40, 40))
    failing = mock.patch.object(flex, "_attend", side_effect=RuntimeError("no compiler"))
    warned = pytest.warns(RuntimeWarning, match="chunked")
    with failing, mock.patch.object(flex, "_WARNED", False), warned:
        out = ak.attention(q, k, v, block_mask=bm, kernel="flex").context
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
