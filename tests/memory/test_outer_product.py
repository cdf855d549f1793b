"""Outer product attention (SAM's OPA) against a loop over Le et al.'s formula, its reduction to
unnormalised dot-product attention with identity functions, and masks."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.memory.outer_product import outer_product_attention

D = torch.float64


def test_equals_the_formula_loop():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, d, generator=g, dtype=D) for s, d in ((3, 4), (5, 4), (5, 2)))
    mask = torch.rand(2, 3, 5, generator=g) < 0.6
    got = outer_product_attention(q, k, v, mask=mask)
    assert got.shape == (2, 3, 4, 2)
    for b in range(2):
        for m in range(3):
            want = torch.zeros(4, 2, dtype=D)
            for i in range(5):
                if not mask[b, m, i]:
                    continue
                for r in range(4):
                    for c in range(2):
                        want[r, c] += math.tanh(q[b, m, r] * k[b, i, r]) * v[b, i, c]
            torch.testing.assert_close(got[b, m], want)


def test_identity_functions_reduce_to_unnormalised_dot_product_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 6, 3, generator=g, dtype=D) for _ in range(3))
    out = outer_product_attention(q, k, v, activation=lambda x: x)
    torch.testing.assert_close(out.sum(-2), (q @ k.transpose(-1, -2)) @ v)


def test_masked_keys_and_errors():
    q = torch.randn(1, 2, 3, dtype=D)
    k = torch.randn(1, 4, 3, dtype=D)
    v = torch.randn(1, 4, 2, dtype=D)
    v_nan = v.clone()
    v_nan[:, 3] = float("nan")
    k_nan = k.clone()
    k_nan[:, 3] = float("nan")
    keep = torch.tensor([[[True, True, True, False]]])
    torch.testing.assert_close(
        outer_product_attention(q, k_nan, v_nan, mask=keep),
        outer_product_attention(q, k[:, :3], v[:, :3]),
    )
    with pytest.raises(ValueError, match="d_qk"):
        outer_product_attention(q, torch.randn(1, 4, 2, dtype=D), v)
    with pytest.raises(ValueError, match="same N"):
        outer_product_attention(q, k, torch.randn(1, 5, 2, dtype=D))
