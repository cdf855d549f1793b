"""Multi-linear attention (Ma et al. 2019): the single-block attention is the Tucker product of
eq. 5 with the diagonal core of eq. 6, the layer is eq. 7 (blocks sharing the factor matrices,
mean, SplitConcat, W^O), its parameter count is the formula against multi-head attention, and it
learns flag retrieval."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.efficient import MultiLinearAttention
from attnkit.efficient.tensorized import parameter_counts, single_block_attention

D = torch.float64


def _tucker_loop(core_tensor, q, k, v):
    """G •₁ Q •₂ K •₃ V = Σ_i Σ_j Σ_m G_ijm Q_i ∘ K_j ∘ V_m (eq. 5), Q_i the i-th column."""
    r = core_tensor.shape[0]
    t = torch.zeros(q.shape[0], k.shape[0], v.shape[0], dtype=q.dtype)
    for i in range(r):
        for j in range(r):
            for m in range(r):
                if core_tensor[i, j, m] != 0:
                    outer = q[:, i][:, None, None] * k[:, j][None, :, None] * v[:, m][None, None]
                    t = t + core_tensor[i, j, m] * outer
    return t


def test_single_block_attention_is_the_tucker_product_with_a_diagonal_core():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 3, generator=g, dtype=D) for _ in range(3))
    diagonal = torch.rand(3, generator=g, dtype=D)
    core_tensor = torch.zeros(3, 3, 3, dtype=D)  # eq. 6: G_ijm = g_r if i = j = m = r, else 0
    for r in range(3):
        core_tensor[r, r, r] = diagonal[r]
    torch.testing.assert_close(
        single_block_attention(diagonal, q, k, v), _tucker_loop(core_tensor, q, k, v)
    )


def test_the_layer_is_eq_7_by_loops():
    g = torch.Generator().manual_seed(1)
    layer = MultiLinearAttention(6, 3, 5, rank=2).to(D)
    x = torch.randn(2, 4, 6, generator=g, dtype=D)  # M = N = 4 < max_len 5
    mask = ak.masks.from_lengths(torch.tensor([4, 3]), 4)
    out = layer(x, mask=mask, need_weights=True)
    big_n = 5
    for b in range(2):
        n = 4 if b == 0 else 3  # padding = truncation: the real keys only, zero rows after

        def factor(proj, rows, b=b):
            f = torch.zeros(big_n, 2, dtype=D)
            for i in range(rows):
                f[i] = proj.weight @ x[b, i] + proj.bias
            return f

        q, k, v = factor(layer.q_proj, 4), factor(layer.k_proj, n), factor(layer.v_proj, n)
        blocks = []
        for j in range(3):  # T_j with its own core, the factor matrices shared
            g_j = torch.softmax(layer.core_logits[j], 0)
            core_tensor = torch.zeros(2, 2, 2, dtype=D)
            for r in range(2):
                core_tensor[r, r, r] = g_j[r]
            blocks.append(_tucker_loop(core_tensor, q, k, v))
        mean = sum(blocks) / 3
        for a in range(4):
            # SplitConcat: row a is the a-th N × N slice, flattened; then W^O
            row = torch.cat([mean[a, i] for i in range(big_n)])
            expected = layer.out_proj.weight @ row + layer.out_proj.bias
            torch.testing.assert_close(out.output[b, a], expected)
    torch.testing.assert_close(out.core[0], torch.softmax(layer.core_logits, -1))


def test_parameter_count_against_multi_head_attention_at_the_same_size():
    layer = MultiLinearAttention(32, 4, 6)
    counts = parameter_counts(32, 4, 6)
    assert counts.multi_linear == layer.parameter_count()
    torch_mha = nn.MultiheadAttention(32, 4)
    assert counts.multi_head == sum(p.numel() for p in torch_mha.parameters())
    # the paper's claim at a Transformer's size: d_model 512, 8 blocks, N = 16
    big = parameter_counts(512, 8, 16)
    assert big.multi_head == 4 * 512 * 512 + 4 * 512
    assert big.multi_linear == 3 * (512 * 64 + 64) + 8 * 64 + 256 * 512 + 512
    assert big.ratio < 0.25
    # SplitConcat's W^O grows with N²: at N = 64 the layer is no longer smaller
    assert parameter_counts(512, 8, 64).ratio > 1


def test_errors():
    with pytest.raises(ValueError, match="not divisible by num_blocks"):
        MultiLinearAttention(10, 3, 4)
    layer = MultiLinearAttention(8, 2, 4)
    with pytest.raises(ValueError, match=r"max_len=4\) got query of length 5"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"needs key \(B, L, 8\)"):
        layer(torch.randn(2, 3, 8), torch.randn(2, 3, 7))


N, VOCAB, EMBED = 8, 8, 32


def _flags(size, g):
    """Flag retrieval (tests/flag_task.py) at length 8: the last token outputs the flagged one."""
    x = torch.randint(0, VOCAB, (size, N), generator=g)
    pos = torch.randint(0, N - 1, (size,), generator=g)
    flag = torch.zeros(size, N, dtype=torch.long)
    flag[torch.arange(size), pos] = 1
    flag[:, -1] = 2
    return x, flag, x[torch.arange(size), pos]


def test_learns_flag_retrieval():
    torch.manual_seed(0)
    tok, flag_embedding = nn.Embedding(VOCAB, EMBED), nn.Embedding(3, EMBED)
    layer, readout = MultiLinearAttention(EMBED, 2, N), nn.Linear(EMBED, VOCAB)
    modules = nn.ModuleList([tok, flag_embedding, layer, readout])

    def predict(x, flag):
        h = tok(x) + flag_embedding(flag)
        return readout(layer(h).output[:, -1])

    opt = torch.optim.Adam(modules.parameters(), 1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        x, flag, y = _flags(64, g)
        loss = nn.functional.cross_entropy(predict(x, flag), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, flag, y = _flags(1000, torch.Generator().manual_seed(99))
    with torch.no_grad():
        accuracy = float((predict(x, flag).argmax(-1) == y).float().mean())
    assert accuracy > 0.9, accuracy  # chance is 1/8
