"""Adaptively sparse attention (Correia et al. 2019): each head's weights are α_h-entmax of its
scores with its own learned α_h, checked head by head against the fixed-α alignments."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.efficient import AdaptivelySparseAttention

D = torch.float64


def test_each_head_uses_its_own_alpha():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g, dtype=D) for _ in range(3))
    part = AdaptivelySparseAttention(3).to(D)
    rho = part.attention.align.rho
    with torch.no_grad():  # α = 1 + softplus(ρ): 1.2, 1.5 and 2 (sparsemax)
        for h, alpha in enumerate((1.2, 1.5, 2.0)):
            rho[h] = torch.log(torch.expm1(torch.tensor(alpha - 1.0, dtype=D)))
    torch.testing.assert_close(part.alphas, torch.tensor([1.2, 1.5, 2.0], dtype=D))
    mask = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    out = part(q, k, v, mask=mask[:, None], need_weights=True)
    for h, align in enumerate(
        (ak.alignments.Entmax(1.2), ak.alignments.Entmax15(), ak.alignments.Sparsemax())
    ):
        ref = ak.attention(q[:, h], k[:, h], v[:, h], align=align, mask=mask, need_weights=True)
        torch.testing.assert_close(out.weights[:, h], ref.weights, atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(out.context[:, h], ref.context, atol=1e-7, rtol=1e-6)
    zeros = (out.weights == 0).float().mean((0, 2, 3))
    assert zeros[2] > zeros[0]  # the sparsemax head is sparser than the α = 1.2 head


def test_alpha_is_learned_per_head():
    part = AdaptivelySparseAttention(2)
    mha = ak.MultiHeadAttention(8, 2, attention=part)
    mha(torch.randn(2, 5, 8)).context.square().sum().backward()
    grad = part.attention.align.rho.grad.reshape(-1)
    assert (grad != 0).all() and grad[0] != grad[1]
    assert (part.alphas > 1).all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="alpha"):
        AdaptivelySparseAttention(2, alpha=1.0)
    with pytest.raises(ValueError, match=r"num_heads=2\) needs q"):
        AdaptivelySparseAttention(2)(*(torch.randn(2, 3, 4, 4) for _ in range(3)))
