"""Nyström attention (Xiong et al. 2021): the pseudo-inverse iteration converges to
torch.linalg.pinv; with every token a landmark it is softmax attention; with fewer landmarks it is
the paper's approximation on segment means (written out below with torch.linalg.pinv); padding
equals truncation; causal masks and bias are refused."""

from __future__ import annotations

import math

import pytest
import torch
from flag_task import flag_retrieval_accuracy

import attnkit as ak
from attnkit.efficient import NystromAttention
from attnkit.efficient.landmarks import iterative_pinv

D = torch.float64


def _qkv(seed=0, lead=(2,), m=8, n=8, d=4, dv=3, scale=0.7):
    g = torch.Generator().manual_seed(seed)
    return (
        scale * torch.randn(*lead, m, d, generator=g, dtype=D),
        scale * torch.randn(*lead, n, d, generator=g, dtype=D),
        torch.randn(*lead, n, dv, generator=g, dtype=D),
    )


def _softmax_rows(s):
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def _reference(q, k, v, m):
    """Xiong et al.'s approximation for one item: segment means of N/m consecutive rows,
    three softmax matrices and the exact pseudo-inverse."""
    d = q.shape[-1]
    ql = torch.stack([q[i * len(q) // m : (i + 1) * len(q) // m].mean(0) for i in range(m)])
    kl = torch.stack([k[i * len(k) // m : (i + 1) * len(k) // m].mean(0) for i in range(m)])
    f = _softmax_rows(q @ kl.T / math.sqrt(d))
    a = _softmax_rows(ql @ kl.T / math.sqrt(d))
    b = _softmax_rows(ql @ k.T / math.sqrt(d))
    return f @ torch.linalg.pinv(a) @ b @ v


@pytest.mark.parametrize("rank", [6, 3])
def test_the_iteration_converges_to_the_pseudo_inverse(rank):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, rank, generator=g, dtype=D) @ torch.randn(rank, 6, generator=g, dtype=D)
    a = _softmax_rows(x) if rank == 6 else x  # a softmax kernel matrix, and a singular one
    exact = torch.linalg.pinv(a)
    errors = [float((iterative_pinv(a, i) - exact).norm() / exact.norm()) for i in (1, 3, 12)]
    assert errors[0] > errors[1] > errors[2]
    torch.testing.assert_close(iterative_pinv(a, 12), exact, atol=1e-10, rtol=1e-10)
    if rank == 6:  # invertible: stays there
        torch.testing.assert_close(iterative_pinv(a, 40), exact, atol=1e-10, rtol=1e-10)


def test_every_token_a_landmark_is_softmax_attention():
    """m = N: each segment is one token, K̃ = K and Q̃ = Q, so Ŝ = S Z S with Z → S⁺; 40
    iterations take Z to S⁺ to ~1e-15 here (see the test above), so Ŝ V = S V to 1e-7 (the
    default float64 tolerance)."""
    q, k, v = _qkv()
    out = NystromAttention(8, iterations=40)(q, k, v, need_weights=True)
    torch.testing.assert_close(out.context, ak.attention(q, k, v).context)
    torch.testing.assert_close(out.weights, _softmax_rows(q @ k.transpose(-1, -2) / 2))


def test_fewer_tokens_than_landmarks_is_exact_too():
    q, k, v = _qkv(1, m=3, n=3)
    out = NystromAttention(5, iterations=40)(q, k, v)
    torch.testing.assert_close(out.context, ak.attention(q, k, v).context)


def test_segment_mean_landmarks_match_the_papers_equation():
    q, k, v = _qkv(2, lead=(1,), m=8, n=12)
    out = NystromAttention(4, iterations=40)(q, k, v)
    torch.testing.assert_close(out.context[0], _reference(q[0], k[0], v[0], 4))
    assert (out.context - ak.attention(q, k, v).context).abs().max() > 1e-3  # an approximation


def test_fused_path_equals_the_equation_and_the_explicit_factors():
    """Without mask or weights the two softmax factors are never formed (fused softmax
    attention over the landmarks): the same context as the paper's equation and as the path
    that forms them (need_weights=True), and the same gradients as the latter."""
    q, k, v = (x.requires_grad_() for x in _qkv(5, lead=(2, 3), m=12, n=16))
    part = NystromAttention(4, iterations=30)
    out = part(q, k, v)
    assert out.extra is None  # the factors were never formed
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(out.context[b, h], _reference(q[b, h], k[b, h], v[b, h], 4))
    explicit = part(q, k, v, need_weights=True)
    assert set(explicit.named_weights()) == {"to_landmarks", "from_landmarks"}
    torch.testing.assert_close(out.context, explicit.context, atol=1e-12, rtol=1e-10)
    r = torch.randn_like(out.context)
    got = torch.autograd.grad((out.context * r).sum(), (q, k, v))
    want = torch.autograd.grad((explicit.context * r).sum(), (q, k, v))
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, atol=1e-10, rtol=1e-8)
    with ak.hooks.listen() as reports:  # a listener gets the factors and the weights
        part(q, k, v)
    assert {r.name for r in reports} == {"to_landmarks", "from_landmarks", "weights"}
    (dense,) = (r.weights for r in reports if r.name == "weights")
    torch.testing.assert_close(dense, explicit.weights)


def test_padding_equals_truncation_and_padded_queries_get_zero():
    q, k, v = _qkv(3, n=8)
    part = NystromAttention(3)
    keep = ak.masks.from_lengths(torch.tensor([8, 5]), 8)[:, 0]
    q, k = q.clone(), k.clone()
    q[1, 5:], k[1, 5:] = float("nan"), float("nan")
    out = part(q, k, v, mask=keep[:, :, None] & keep[:, None, :], need_weights=True)
    assert (out.context[1, 5:] == 0).all() and (out.weights[1, 5:] == 0).all()
    alone = part(q[1:, :5], k[1:, :5], v[1:, :5]).context
    torch.testing.assert_close(out.context[1:, :5], alone, atol=1e-12, rtol=1e-10)


def test_refuses_causal_masks_and_bias_and_fits_the_attention_slot():
    q, k, v = _qkv(4)
    part = NystromAttention(4)
    with pytest.raises(ValueError, match=r"NystromAttention: the mask varies over queries"):
        part(q, k, v, mask=ak.masks.causal(8))
    with pytest.raises(ValueError, match="bias"):
        part(q, k, v, bias=torch.zeros(8, 8, dtype=D))
    mha = ak.MultiHeadAttention(8, 2, attention=NystromAttention(4)).to(D)
    x = torch.randn(2, 16, 8, dtype=D)
    out = mha(x, x, x, need_weights=True)
    assert out.context.shape == (2, 16, 8) and out.weights.shape == (2, 2, 16, 16)


@pytest.mark.slow
def test_learns_flag_retrieval():
    """Inside MultiHeadAttention it learns the flag-retrieval task (chance 1/8)."""
    assert flag_retrieval_accuracy(NystromAttention(8)) > 0.9
