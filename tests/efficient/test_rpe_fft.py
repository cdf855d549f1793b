"""Kernelized attention with relative positions by FFT (Luo et al. 2021): the FFT Toeplitz
product against the dense matrix product, the whole part against the O(N²) sum written from the
paper's equation (masks anywhere, causal), the causal receptive field by gradients, and with
Performer features an estimate of softmax attention with the relative bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.efficient import Performer
from attnkit.efficient.rpe_fft import RelativeKernelAttention, toeplitz_dense, toeplitz_fft


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("m, n", [(5, 5), (3, 8), (8, 3), (1, 1), (17, 33)])
def test_toeplitz_fft_equals_the_dense_product(m, n):
    c, u = _x(2, m + n - 1, seed=1), _x(2, n, 3, seed=2)
    dense = torch.zeros(2, m, n, dtype=torch.float64)
    for i in range(m):  # C_ij = c_{j−i}, c stored from offset −(m−1)
        for j in range(n):
            dense[:, i, j] = c[:, j - i + m - 1]
    torch.testing.assert_close(toeplitz_dense(c, m, n), dense)
    torch.testing.assert_close(toeplitz_fft(c, u, m), dense @ u)


def _reference(part, q, k, v, keep=None, causal=False, q_offset=0):
    """y_i = Σ_j exp(b_{j−i}) φ(q_i)·φ(k_j) v_j / Σ_j exp(b_{j−i}) φ(q_i)·φ(k_j) (Luo et al.
    eq. 5 with a kernel), a loop over batch, heads, queries and keys; ``keep`` (B, N); query
    row i sits at position i + q_offset."""
    b_, h_, m, _ = q.shape
    n = k.shape[-2]
    out = torch.zeros(b_, h_, m, v.shape[-1], dtype=q.dtype)
    for b in range(b_):
        for h in range(h_):
            for i in range(m):
                num, den = torch.zeros(v.shape[-1], dtype=q.dtype), 0.0
                p = i + q_offset
                for j in range(n):
                    if (keep is not None and not keep[b, j]) or (causal and j > p):
                        continue
                    rel = part.rel_bias[h, j - p + part.max_len - 1]
                    s = torch.exp(rel) * (F.elu(q[b, h, i]) + 1) @ (F.elu(k[b, h, j]) + 1)
                    num, den = num + s * v[b, h, j], den + s
                out[b, h, i] = num / den if den != 0 else 0
    return out


def _part(causal=False):
    part = RelativeKernelAttention(10, num_heads=2, causal=causal).double()
    with torch.no_grad():
        part.rel_bias.copy_(2 * _x(2, 19, seed=3))
    return part


@pytest.mark.parametrize("m", [6, 4, 9])
def test_matches_the_dense_sum_with_keys_masked_anywhere(m):
    part = _part()
    q, k, v = _x(2, 2, m, 4, seed=4), _x(2, 2, 6, 4, seed=5), _x(2, 2, 6, 3, seed=6)
    keep = torch.tensor([[True] * 6, [False, True, True, False, True, False]])
    out = part(q, k, v, mask=keep[:, None, None], need_weights=True)
    torch.testing.assert_close(out.context, _reference(part, q, k, v, keep))
    torch.testing.assert_close(out.weights @ v, out.context)  # the weights it applies


def test_causal_matches_the_dense_sum_and_sees_no_future():
    """Output i's gradient w.r.t. inputs j > i vanishes up to the FFT's rounding."""
    part = _part(causal=True)
    q, k, v = (_x(1, 2, 7, 4, seed=s).requires_grad_() for s in (7, 8, 9))
    out = part(q, k, v).context
    torch.testing.assert_close(out, _reference(part, q, k, v, causal=True))
    for i in range(7):
        grads = torch.autograd.grad(out[0, :, i].sum(), (q, k, v), retain_graph=True)
        # zero up to the FFT's rounding (~1e-16 of the gradients w.r.t. the past)
        past = max(float(g[0, :, : i + 1].abs().max()) for g in grads)
        assert past > 0.1
        for g in grads:
            assert (g[0, :, i + 1 :].abs() <= 1e-12 * past).all()


def test_with_performer_features_it_estimates_softmax_with_the_relative_bias():
    """Positive random features estimate exp(q·k/√d); the bias multiplies in exactly, so the
    estimate approaches softmax(QKᵀ/√d + B) V as the features grow (error falls ~1/√m)."""
    q, k, v = _x(1, 1, 12, 4, seed=10) / 2, _x(1, 1, 12, 4, seed=11) / 2, _x(1, 1, 12, 3, seed=12)
    rel = _x(23, seed=13)
    exact = ak.attention(q, k, v, bias=toeplitz_dense(rel, 12, 12)).context
    errors = []
    for features in (16, 256, 4096):
        part = RelativeKernelAttention(12, feature_map=Performer(4, features, seed=1)).double()
        with torch.no_grad():
            part.rel_bias.copy_(rel)
        with torch.no_grad():
            error = (part(q, k, v).context - exact).norm() / exact.norm()
        errors.append(float(error))
    assert errors[2] < errors[1] < errors[0] and errors[2] < 0.05, errors


def test_zero_bias_is_plain_kernelized_attention():
    q, k, v = _x(2, 5, 4, seed=14), _x(2, 8, 4, seed=15), _x(2, 8, 3, seed=16)
    plain = ak.efficient.LinearAttention()(q, k, v).context
    torch.testing.assert_close(RelativeKernelAttention(8).double()(q, k, v).context, plain)


def test_inside_multi_head_attention_and_bad_inputs():
    mha = ak.MultiHeadAttention(8, 2, attention=RelativeKernelAttention(16, num_heads=2))
    x = torch.randn(2, 10, 8)
    assert mha(x, mask=ak.masks.from_lengths(torch.tensor([10, 6]), 10)).context.shape == x.shape
    part = RelativeKernelAttention(4).double()
    q = _x(1, 5, 4)
    with pytest.raises(ValueError, match="max_len"):
        part(q, q, q)
    with pytest.raises(ValueError, match="varies over queries"):
        part(q[:, :3], q[:, :3], q[:, :3], mask=ak.masks.causal(3))
    with pytest.raises(ValueError, match=r"needs inputs \(B, 2, L, d\)"):
        RelativeKernelAttention(8, num_heads=2).double()(q, q, q)
    with pytest.raises(ValueError, match="bias"):
        part(q[:, :3], q[:, :3], q[:, :3], bias=torch.zeros(3, 3, dtype=torch.float64))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("q_offset", [1, 4])
def test_queries_after_the_keys_start_use_their_positions(causal, q_offset):
    part = _part(causal=causal)
    q, k, v = _x(2, 2, 3, 4, seed=14), _x(2, 2, 7, 4, seed=15), _x(2, 2, 7, 3, seed=16)
    out = part(q, k, v, q_offset=q_offset).context
    torch.testing.assert_close(out, _reference(part, q, k, v, causal=causal, q_offset=q_offset))
    with pytest.raises(ValueError, match="from position 8"):
        part(q, k, v, q_offset=8)  # positions 8 … 10 > max_len
