"""Shaw et al.'s relation-aware attention in MultiHeadAttention against a loop of eqs. 3-4."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.positions import ShawRelative


def shaw_loop(mha, x):
    """Eqs. 3-4 per head and per pair, with MHA's projections: e_ij = q_i (k_j + a^K_ij)ᵀ / √d,
    α = softmax_j, z_i = Σ_j α_ij (v_j + a^V_ij); the heads concatenated, then W^O."""
    e, h = mha.embed_dim, mha.num_heads
    d, kk = e // h, mha.position.max_distance
    w, b = mha.in_proj_weight, mha.in_proj_bias
    wk, wv = mha.position.key_table, mha.position.value_table
    batch, n = x.shape[0], x.shape[1]
    out = torch.zeros(batch, n, e, dtype=x.dtype)
    for bi in range(batch):
        for head in range(h):
            rows = slice(head * d, (head + 1) * d)
            q = x[bi] @ w[:e][rows].T + b[:e][rows]
            k = x[bi] @ w[e : 2 * e][rows].T + b[e : 2 * e][rows]
            v = x[bi] @ w[2 * e :][rows].T + b[2 * e :][rows]
            for i in range(n):
                clip = [max(-kk, min(kk, j - i)) + kk for j in range(n)]
                scores = torch.stack([q[i] @ (k[j] + wk[clip[j]]) for j in range(n)]) / math.sqrt(d)
                alpha = scores.softmax(0)
                z = sum(alpha[j] * (v[j] + wv[clip[j]]) for j in range(n))
                out[bi, i, rows] = z
    return mha.out_proj(out)


def test_multi_head_attention_matches_eqs_3_and_4():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(
        8, 2, position=ShawRelative(4, max_distance=2, dtype=torch.float64), dtype=torch.float64
    )
    x = torch.randn(2, 6, 8, dtype=torch.float64)  # 6 > 2k + 1: clipping happens
    out = mha(x, need_weights=True)
    torch.testing.assert_close(out.context, shaw_loop(mha, x))
    assert out.weights.shape == (2, 2, 6, 6)
    assert mha(x).weights is None  # weights only when asked, though the value term used them


def test_logits_and_value_term_are_shift_invariant():
    shaw = ShawRelative(4, max_distance=3, dtype=torch.float64)
    q, k = torch.randn(2, 5, 4, dtype=torch.float64), torch.randn(2, 7, 4, dtype=torch.float64)
    a, b = shaw(q, k, q_offset=1), shaw(q, k, q_offset=31, k_offset=30)
    torch.testing.assert_close(a.bias, b.bias)
    weights = torch.rand(2, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(a.values(weights), b.values(weights))


def test_gradcheck():
    shaw = ShawRelative(2, max_distance=1, dtype=torch.float64)
    q = torch.randn(1, 2, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 4, 2, dtype=torch.float64, requires_grad=True)
    tables = (shaw.key_table.detach().clone().requires_grad_(),
              shaw.value_table.detach().clone().requires_grad_())  # fmt: skip

    def f(q, k, wk, wv):
        p = torch.func.functional_call(
            shaw, {"key_table": wk, "value_table": wv}, (q, k), {"q_offset": 1}
        )
        out = ak.attention(p.q, p.k, k, bias=p.bias, need_weights=True)
        return out.context + p.values(out.weights)

    assert torch.autograd.gradcheck(f, (q, k, *tables))


def test_errors_and_by_name():
    assert ak.MultiHeadAttention(8, 2, position="shaw").position.head_dim == 4
    with pytest.raises(ValueError, match="head_dim = 4"):
        ShawRelative(4)(torch.randn(2, 3, 6), torch.randn(2, 3, 6))


def test_a_part_without_weights_is_refused():
    class NoWeights(ak.HeadAttention):
        accepts_bias = True  # declared, so that the missing weights are what is refused

        def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
            return ak.AttentionOutput(v.mean(-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1]))

    mha = ak.MultiHeadAttention(8, 2, attention=NoWeights(), position="shaw")
    with pytest.raises(TypeError, match="returned none"):
        mha(torch.randn(2, 3, 8))
