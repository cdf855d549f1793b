"""Effective attention leaves the output unchanged and removes exactly the null-space part."""

import pytest
import torch

import attnkit as ak
from attnkit.evaluation import capture
from attnkit.evaluation.effective import effective_attention


def test_hand_example_constant_values():
    a = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    v = torch.ones(3, 1, dtype=torch.float64)  # spans (1, 1, 1): only the row's mass matters
    torch.testing.assert_close(effective_attention(a, v), torch.full((1, 3), 1 / 3).double())


def test_full_rank_values_keep_the_weights():
    a = torch.softmax(torch.randn(2, 4, 3, dtype=torch.float64), -1)
    v = torch.randn(2, 3, 5, dtype=torch.float64)  # N = 3 ≤ d_v: no null space
    torch.testing.assert_close(effective_attention(a, v), a)


def test_output_unchanged_and_difference_in_left_null_space_on_a_real_head():
    torch.manual_seed(0)
    n, d_v = 12, 3
    a = torch.softmax(torch.randn(2, 5, n, n, dtype=torch.float64) * 3, -1)
    v = torch.randn(2, 5, n, d_v, dtype=torch.float64)
    eff = effective_attention(a, v)
    torch.testing.assert_close(eff @ v, a @ v)
    assert float((a - eff).abs().max()) > 0.05  # something was removed
    # the removed part is orthogonal to the values' column space, and Ã lies inside it
    torch.testing.assert_close((a - eff) @ v, torch.zeros(2, 5, n, d_v).double())
    q, _ = torch.linalg.qr(v)
    torch.testing.assert_close(eff @ q @ q.transpose(-2, -1), eff)


def test_rank_deficient_values():
    v = torch.tensor([[1.0, 2.0], [2.0, 4.0], [0.0, 0.0]], dtype=torch.float64)  # rank 1
    a = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)
    # column space spanned by (1, 2, 0)/√5: Ã = (a·u) u = (0.8/5)(1, 2, 0)
    torch.testing.assert_close(
        effective_attention(a, v), torch.tensor([[0.16, 0.32, 0.0]]).double()
    )


def test_on_multihead_attention_through_capture():
    torch.manual_seed(1)
    mha = ak.MultiHeadAttention(4, 2).double()  # head_dim 2 < 6 keys
    x = torch.randn(1, 6, 4, dtype=torch.float64)
    with capture(mha) as records:
        out = mha(x).context
    w = records["attention"][0]  # (1, 2, 6, 6)
    e = mha.embed_dim
    vw, vb = (
        mha.in_proj_weight[2 * e :],
        mha.in_proj_bias[2 * e :] if mha.in_proj_bias is not None else None,
    )
    v = torch.nn.functional.linear(x, vw, vb).unflatten(-1, (2, 2)).transpose(1, 2)
    eff = effective_attention(w, v)
    context = (eff @ v).transpose(1, 2).flatten(-2)
    torch.testing.assert_close(mha.out_proj(context), out)


def test_errors():
    with pytest.raises(ValueError, match="share N"):
        effective_attention(torch.zeros(2, 3), torch.zeros(4, 2))
    with pytest.raises(TypeError):
        effective_attention([1.0], torch.zeros(1, 1))
