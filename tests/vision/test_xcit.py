"""Cross-covariance attention against a loop written from El-Nouby et al. 2021, eq. 4."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.vision import CrossCovarianceAttention


def _loop(module: CrossCovarianceAttention, x: torch.Tensor) -> tuple[list, list]:
    """One item x (N, D): per head, q̂/k̂ normalised along tokens, A_ij = softmax_j(τ q̂_iᵀ k̂_j),
    out_{n,i} = Σ_j A_ij v_{n,j}, heads concatenated, then W_o. Scalars only."""
    n, d = x.shape
    h, dh = module.num_heads, module.head_dim
    w, bias = module.qkv.weight, module.qkv.bias
    proj = [[sum(float(w[r, c]) * float(x[t, c]) for c in range(d)) + float(bias[r])
             for r in range(3 * d)] for t in range(n)]  # fmt: skip
    heads_out = [[0.0] * d for _ in range(n)]
    maps = []
    for head in range(h):

        def chan(part, i, head=head):
            return [proj[t][part * d + head * dh + i] for t in range(n)]

        def unit(col):
            norm = math.sqrt(sum(c * c for c in col))
            return [c / max(norm, 1e-12) for c in col]

        qs = [unit(chan(0, i)) for i in range(dh)]
        ks = [unit(chan(1, j)) for j in range(dh)]
        vs = [chan(2, j) for j in range(dh)]
        tau = float(module.temperature[head])
        a = []
        for i in range(dh):
            s = [tau * sum(qs[i][t] * ks[j][t] for t in range(n)) for j in range(dh)]
            m = max(s)
            e = [math.exp(v - m) for v in s]
            a.append([v / sum(e) for v in e])
        maps.append(a)
        for t in range(n):
            for i in range(dh):
                heads_out[t][head * dh + i] = sum(a[i][j] * vs[j][t] for j in range(dh))
    wo, bo = module.out.weight, module.out.bias
    out = [[sum(float(wo[r, c]) * heads_out[t][c] for c in range(d)) + float(bo[r])
            for r in range(d)] for t in range(n)]  # fmt: skip
    return out, maps


@torch.no_grad()
def test_matches_a_loop_of_the_equation():
    torch.manual_seed(0)
    module = CrossCovarianceAttention(6, 2).double()
    module.temperature.copy_(torch.tensor([0.7, 1.9], dtype=torch.float64).view(2, 1, 1))
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    got = module(x)
    for b in range(2):
        out, maps = _loop(module, x[b])
        torch.testing.assert_close(got.output[b], torch.tensor(out, dtype=torch.float64))
        torch.testing.assert_close(got.weights[b], torch.tensor(maps, dtype=torch.float64))


@torch.no_grad()
def test_permutation_equivariant_over_tokens():
    torch.manual_seed(1)
    module = CrossCovarianceAttention(8, 2).double()
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    perm = torch.randperm(7)
    a, b = module(x), module(x[:, perm])
    torch.testing.assert_close(b.output, a.output[:, perm])
    torch.testing.assert_close(b.weights, a.weights)


@pytest.mark.parametrize("n", [1, 3, 50])
def test_map_is_head_dim_squared_whatever_the_token_count(n):
    module = CrossCovarianceAttention(12, 3)
    out = module(torch.randn(2, n, 12))
    assert out.weights.shape == (2, 3, 4, 4)
    assert out.output.shape == (2, n, 12)


@torch.no_grad()
def test_masking_a_token_equals_removing_it():
    torch.manual_seed(2)
    module = CrossCovarianceAttention(6, 2).double()
    x = torch.randn(1, 5, 6, dtype=torch.float64)
    keep = torch.tensor([[True, False, True, True, False]])
    masked = module(x, mask=keep[:, None])
    removed = module(x[:, keep[0]])
    torch.testing.assert_close(masked.output[:, keep[0]], removed.output)
    torch.testing.assert_close(masked.weights, removed.weights)
    assert (masked.output[:, ~keep[0]] == 0).all()


def test_bad_inputs_are_refused():
    module = CrossCovarianceAttention(6, 2)
    with pytest.raises(ValueError, match="embed_dim=6"):
        module(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="key padding mask"):
        module(torch.randn(2, 5, 6), mask=torch.ones(2, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="divisible"):
        CrossCovarianceAttention(6, 4)
