"""The gated merge of heads (GaAN) against a loop over positions and heads."""

import pytest
import torch
from helpers import rand

import attnkit as ak
from attnkit.head_merge import GatedHeadMerge
from attnkit.regularisers import head_parts


def merge_loop(merge, x, heads, key, mask):
    """GaAN eq. 5 per query position i: g_i = σ(W_g [x_i; max_j W_m k_j; mean_j k_j] + b_g)
    over the real keys j, then y_i = Σ_h g_i^h O_i^h W^O_h + b^O."""
    b, h, m, d = heads.shape
    out = torch.zeros(b, m, merge.embed_dim, dtype=x.dtype)
    for item in range(b):
        real = [j for j in range(key.shape[1]) if mask is None or bool(mask[item, j])]
        pooled = torch.stack([merge.pool(key[item, j]) for j in real]).amax(0)
        mean = torch.stack([key[item, j] for j in real]).mean(0)
        for i in range(m):
            g = torch.sigmoid(merge.gate(torch.cat([x[item, i], pooled, mean])))
            y = merge.out_proj.bias.clone()
            for head in range(h):
                w_h = merge.out_proj.weight[:, head * d : (head + 1) * d]
                y = y + g[head] * (w_h @ heads[item, head, i])
            out[item, i] = y
    return out


def test_gated_merge_equals_the_loop():
    torch.manual_seed(0)
    merge = GatedHeadMerge(6, 3, 2, kdim=5, d_pool=4, dtype=torch.float64)
    x, key, heads = rand(2, 4, 6), rand(2, 7, 5, seed=1), rand(2, 3, 4, 2, seed=2)
    mask = ak.masks.from_lengths(torch.tensor([7, 5]), 7)
    out = merge(x, heads, key, mask=mask)
    assert out.gates.shape == (2, 4, 3) and ((out.gates > 0) & (out.gates < 1)).all()
    ref = merge_loop(merge, x, heads, key, mask.reshape(2, 7))
    torch.testing.assert_close(out.output, ref)
    g1 = torch.autograd.grad(out.output.sum(), [x, key, heads])
    g2 = torch.autograd.grad(ref.sum(), [x, key, heads])
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)


def test_open_gates_give_the_concatenation_merge():
    """With every gate at 1 the merge is MultiHeadAttention's own concat(O) W^O."""
    torch.manual_seed(1)
    mha = ak.MultiHeadAttention(8, 2, dtype=torch.float64)
    merge = GatedHeadMerge(8, 2, dtype=torch.float64)
    merge.out_proj.load_state_dict(mha.out_proj.state_dict())
    x = rand(2, 5, 8, seed=3, grad=False)
    parts = head_parts(mha, x)
    ones = torch.ones(2, 5, 2, dtype=torch.float64)
    torch.testing.assert_close(merge.combine(parts.outputs, ones), parts.output.context)
    closed = merge.combine(parts.outputs, torch.zeros_like(ones))
    torch.testing.assert_close(closed, mha.out_proj.bias.expand(2, 5, 8))


def test_a_gate_from_the_query_alone():
    torch.manual_seed(2)
    merge = GatedHeadMerge(4, 2, dtype=torch.float64)
    x, heads = rand(1, 3, 4), rand(1, 2, 3, 2, seed=4)
    g = torch.sigmoid(x @ merge.gate.weight.T + merge.gate.bias)
    torch.testing.assert_close(merge(x, heads).gates, g)


def test_bad_inputs():
    merge = GatedHeadMerge(4, 2, kdim=3)
    x, heads = torch.randn(1, 3, 4), torch.randn(1, 2, 3, 2)
    with pytest.raises(ValueError, match="pass key"):
        merge(x, heads)
    with pytest.raises(ValueError, match="heads must be"):
        merge(x, torch.randn(1, 3, 3, 2), torch.randn(1, 5, 3))
    with pytest.raises(ValueError, match="key must be"):
        merge(x, heads, torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="takes no key"):
        GatedHeadMerge(4, 2)(x, heads, torch.randn(1, 5, 3))
    with pytest.raises(ValueError, match="divisible"):
        GatedHeadMerge(5, 2)
    with pytest.raises(TypeError, match="d_pool"):
        GatedHeadMerge(4, 2, d_pool=3)
