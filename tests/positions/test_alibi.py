"""ALiBi: the paper's slopes and a bias linear in |i − j|, depending on i − j only."""

import pytest
import torch

import attnkit as ak
from attnkit.positions import ALiBi, alibi_slopes


def test_slopes_from_the_paper():
    # Press et al. 3: 8 heads -> 1/2, 1/4, ..., 1/256; 16 heads -> 1/2^0.5, 1/2, ..., 1/256.
    assert alibi_slopes(8) == [2.0**-p for p in range(1, 9)]
    assert alibi_slopes(16) == pytest.approx([2.0 ** (-p / 2) for p in range(1, 17)])
    # not a power of two: the 4-head slopes, then every other slope of 8 heads
    assert alibi_slopes(6) == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]


def test_bias_loop_and_shift_invariance():
    q = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    k = torch.randn(2, 4, 6, 5, dtype=torch.float64)
    out = ALiBi()(q, k, q_offset=4, k_offset=1)
    slopes = alibi_slopes(4)
    expected = [
        [[-slopes[h] * abs((4 + i) - (1 + j)) for j in range(6)] for i in range(3)]
        for h in range(4)
    ]
    torch.testing.assert_close(out.bias, torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(out.bias, ALiBi()(q, k, q_offset=103, k_offset=100).bias)
    assert out.q is q and out.k is k


def test_gradcheck_through_attention():
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)

    def f(q, k):
        out = ALiBi()(q, k, q_offset=2)
        return ak.attention(out.q, out.k, out.k, bias=out.bias).context

    assert torch.autograd.gradcheck(f, (q, k))


def test_in_multi_head_attention():
    mha = ak.MultiHeadAttention(8, 4, position="alibi")
    x = torch.randn(2, 5, 8)
    perm = torch.tensor([1, 0, 2, 3, 4])  # swap two tokens (a swap is its own inverse)
    moved = mha(x[:, perm]).context[:, perm]
    assert not torch.allclose(mha(x).context, moved, atol=1e-4)  # order now matters


def test_needs_heads():
    with pytest.raises(ValueError, match="per-head"):
        ALiBi()(torch.randn(3, 4), torch.randn(3, 4))


@pytest.mark.parametrize("heads", [1, 3, 5, 6, 8, 12, 16, 20, 24])
def test_slopes_equal_bloom_alibi_in_transformers(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    theirs = build_alibi_tensor(torch.ones(1, 3), heads, torch.float64)[:, 0, 1]  # slope · 1
    # BLOOM computes the slopes in float32
    torch.testing.assert_close(
        torch.tensor(alibi_slopes(heads), dtype=torch.float64), theirs, rtol=1e-6, atol=0
    )
