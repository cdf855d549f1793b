"""SOFT (Lu et al. 2021): the Gaussian kernel exp(−‖q − k‖²/2√d), unnormalised, written out by
loops below; with every token a landmark it is exact; with fewer it is the paper's Nyström form
on segment means (exact pseudo-inverse in the reference); the Newton-Schulz iteration converges
to torch.linalg.pinv; per-query masks are refused."""

from __future__ import annotations

import math

import pytest
import torch
from flag_task import flag_retrieval_accuracy

import attnkit as ak
from attnkit.efficient import SoftmaxFreeAttention
from attnkit.efficient.landmarks import newton_pinv

D = torch.float64


def _qkv(seed=0, lead=(2,), m=6, n=6, d=4, dv=3):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*lead, m, d, generator=g, dtype=D),
        torch.randn(*lead, n, d, generator=g, dtype=D),
        torch.randn(*lead, n, dv, generator=g, dtype=D),
    )


def gaussian(x, y):
    """exp(−‖x_i − y_j‖² / (2√d)) entry by entry (SOFT)."""
    d = x.shape[-1]
    out = torch.empty(len(x), len(y), dtype=D)
    for i in range(len(x)):
        for j in range(len(y)):
            out[i, j] = math.exp(-float(((x[i] - y[j]) ** 2).sum()) / (2 * math.sqrt(d)))
    return out


def _segments(x, m):
    return torch.stack([x[i * len(x) // m : (i + 1) * len(x) // m].mean(0) for i in range(m)])


def test_newton_schulz_converges_to_the_pseudo_inverse():
    q, k, _ = _qkv()
    a = gaussian(q[0], k[0])
    exact = torch.linalg.pinv(a)
    errors = [float((newton_pinv(a, i) - exact).norm() / exact.norm()) for i in (2, 8, 40)]
    assert errors[0] > errors[1] > errors[2]
    torch.testing.assert_close(newton_pinv(a, 40), exact, atol=1e-9, rtol=1e-9)


def test_every_token_a_landmark_is_the_dense_gaussian_kernel_attention():
    q, k, v = _qkv(1)
    out = SoftmaxFreeAttention(6, iterations=60)(q, k, v, need_weights=True)
    for b in range(2):
        s = gaussian(q[b], k[b])
        torch.testing.assert_close(out.context[b], s @ v[b])
        torch.testing.assert_close(out.weights[b], s)


def test_fewer_landmarks_follow_the_papers_nystrom_form():
    q, k, v = _qkv(2, lead=(1,), m=8, n=12)
    out = SoftmaxFreeAttention(4, iterations=60)(q, k, v, need_weights=True)
    ql, kl = _segments(q[0], 4), _segments(k[0], 4)
    f, a, b = gaussian(q[0], kl), gaussian(ql, kl), gaussian(ql, k[0])
    torch.testing.assert_close(out.context[0], f @ torch.linalg.pinv(a) @ b @ v[0])
    torch.testing.assert_close(out.extra["to_landmarks"][0], f)
    torch.testing.assert_close(out.extra["from_landmarks"][0], b)


def test_tied_queries_and_keys_give_a_symmetric_approximation():
    """The paper's K = Q: Ŝ is a Nyström approximation of a symmetric PSD kernel matrix."""
    q, _, v = _qkv(3, n=8, m=8)
    w = SoftmaxFreeAttention(4, iterations=60)(q, q, v, need_weights=True).weights
    torch.testing.assert_close(w, w.transpose(-1, -2))
    assert torch.linalg.eigvalsh(w).min() > -1e-8


def test_refuses_causal_masks_and_fits_the_attention_slot():
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match="SoftmaxFreeAttention: the mask varies over queries"):
        SoftmaxFreeAttention(3)(q, k, v, mask=ak.masks.causal(6))
    mha = ak.MultiHeadAttention(8, 2, attention=SoftmaxFreeAttention(4)).to(D)
    x = torch.randn(2, 12, 8, dtype=D)
    assert mha(x, x, x).context.shape == (2, 12, 8)


@pytest.mark.slow
def test_learns_flag_retrieval():
    """Inside MultiHeadAttention it learns the flag-retrieval task (chance 1/8)."""
    assert flag_retrieval_accuracy(SoftmaxFreeAttention(8)) > 0.9
