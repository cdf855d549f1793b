"""QANet's encoder block (Yu et al. 2018): the depthwise-separable convolution and the block
against loops written from the equations, the layer-dropout survival probabilities and how often
sublayers survive in training, padding == truncation, and a retrieval task it learns."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_same_forward_backward, rand
from torch import nn

from attnkit.positions import sinusoid_table
from attnkit.qanet import (
    DepthwiseSeparableConv,
    QANetEncoder,
    QANetEncoderBlock,
    survival_probability,
)


def _conv_loop(conv, x):
    """y[b, n] = ReLU(W_p d + b_p), d_c = Σ_j w_c[j] x[b, n + j − k//2, c] (zeros outside)."""
    wd = conv.depthwise.weight[:, 0]  # (D, k)
    wp, bp = conv.pointwise.weight[:, :, 0], conv.pointwise.bias
    k = wd.shape[1]
    B, N, D = x.shape
    out = []
    for b in range(B):
        rows = []
        for n in range(N):
            taps = [j for j in range(k) if 0 <= n + j - k // 2 < N]
            depth = sum(
                (wd[:, j] * x[b, n + j - k // 2] for j in taps), torch.zeros(D, dtype=x.dtype)
            )
            rows.append(torch.relu(wp @ depth + bp))
        out.append(torch.stack(rows))
    return torch.stack(out)


def test_depthwise_separable_convolution_matches_the_loop():
    torch.manual_seed(0)
    conv = DepthwiseSeparableConv(3, 5).double()
    x = rand(2, 6, 3, seed=1)
    assert_same_forward_backward(
        lambda: conv(x), lambda: _conv_loop(conv, x), [x, *conv.parameters()]
    )
    assert sum(p.numel() for p in conv.depthwise.parameters()) == 3 * 5  # D·k, not D²·k


def test_survival_decays_linearly_to_p_last():
    block = QANetEncoderBlock(8, 2, num_convs=2, survival_last=0.9)
    assert block.survival == pytest.approx([1 - l / 4 * 0.1 for l in (1, 2, 3, 4)])
    stack = QANetEncoder(3, 8, 2, num_convs=2, survival_last=0.5)
    probs = [p for b in stack.blocks for p in b.survival]
    assert probs == pytest.approx([1 - l / 12 * 0.5 for l in range(1, 13)])
    assert probs[-1] == pytest.approx(0.5)
    assert survival_probability(3, 12, 0.5) == pytest.approx(probs[2])


def _block_loop(block, x, keep):
    """x + PE, then x ← x + p_l f_l(LN_l(x)) for the convolutions (on zeroed padding), the
    self-attention over real keys and the feed-forward; padded rows zeroed at the end."""
    _, N, D = x.shape
    pe = torch.tensor(
        [
            [
                math.sin(n / 10000 ** (i / D))
                if i % 2 == 0
                else math.cos(n / 10000 ** ((i - 1) / D))
                for i in range(D)
            ]
            for n in range(N)
        ],
        dtype=x.dtype,
    )
    h = x + pe
    real = keep[..., None].to(x.dtype)

    def ln(i, t):
        norm = block.norms[i]
        mu = t.mean(-1, keepdim=True)
        var = ((t - mu) ** 2).mean(-1, keepdim=True)
        return (t - mu) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias

    for i, conv in enumerate(block.convs):
        h = h + block.survival[i] * _conv_loop(conv, ln(i, h) * real)
    c = len(block.convs)
    a = ln(c, h)
    att = block.attention(a, a, a, mask=keep[:, None, :]).context
    h = h + block.survival[c] * att
    ff = block.ff
    hidden = torch.relu(ln(c + 1, h) @ ff[0].weight.T + ff[0].bias)
    h = h + block.survival[c + 1] * (hidden @ ff[2].weight.T + ff[2].bias)
    return h * real


def test_block_in_evaluation_matches_the_loop():
    torch.manual_seed(0)
    block = (
        QANetEncoderBlock(4, 2, num_convs=2, kernel_size=3, d_ff=6, survival_last=0.7)
        .double()
        .eval()
    )
    x = rand(2, 5, 4, seed=1)
    keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    assert_same_forward_backward(
        lambda: block(x, keep), lambda: _block_loop(block, x, keep), [x, *block.parameters()]
    )


def test_layer_dropout_keeps_each_sublayer_with_its_probability():
    torch.manual_seed(0)
    block = QANetEncoderBlock(4, 2, num_convs=2, kernel_size=3, survival_last=0.4).train()
    calls = [0] * 4
    parts = [*block.convs, block.attention, block.ff]
    for i, part in enumerate(parts):
        part.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    x = torch.randn(1, 5, 4)
    runs = 300
    with torch.no_grad():
        for _ in range(runs):
            block(x)
    for i, p in enumerate(block.survival):
        assert abs(calls[i] / runs - p) < 0.09, (i, calls[i] / runs, p)
    # every sublayer skipped: the block adds the positions only
    never = QANetEncoderBlock(4, 2, num_convs=1, kernel_size=3, survival_last=1e-9).train()
    never.survival = (0.0, 0.0, 0.0)
    torch.testing.assert_close(never(x), x + sinusoid_table(torch.arange(5.0), 4))


def test_padding_equals_truncation():
    torch.manual_seed(0)
    stack = QANetEncoder(2, 4, 2, num_convs=2, kernel_size=3).double().eval()
    x = rand(2, 6, 4, seed=1, grad=False)
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = stack(x, keep)
    torch.testing.assert_close(out[1, :4], stack(x[1:, :4])[0])
    torch.testing.assert_close(out[0], stack(x[:1])[0])
    assert (out[1, 4:] == 0).all()
    x2 = x.clone()
    x2[1, 4:] = float("nan")
    torch.testing.assert_close(stack(x2, keep), out)


N, VOCAB, D = 12, 6, 16


def _flag_batch(size, g):
    """Tokens with one flagged position; the last position must output the flagged token (too
    far for the convolutions alone: it takes the self-attention)."""
    x = torch.randint(0, VOCAB, (size, N), generator=g)
    pos = torch.randint(0, N - 6, (size,), generator=g)
    flag = torch.zeros(size, N, dtype=torch.long)
    flag[torch.arange(size), pos] = 1
    flag[:, -1] = 2
    return x, flag, x[torch.arange(size), pos]


def test_learns_flag_retrieval():
    torch.manual_seed(0)
    tok, flags = nn.Embedding(VOCAB, D), nn.Embedding(3, D)
    block = QANetEncoderBlock(D, 2, num_convs=2, kernel_size=5)
    out = nn.Linear(D, VOCAB)
    params = [*tok.parameters(), *flags.parameters(), *block.parameters(), *out.parameters()]
    opt = torch.optim.Adam(params, 1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        x, f, y = _flag_batch(32, g)
        loss = nn.functional.cross_entropy(out(block(tok(x) + flags(f))[:, -1]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    block.eval()
    x, f, y = _flag_batch(1000, torch.Generator().manual_seed(9))
    with torch.no_grad():
        accuracy = (out(block(tok(x) + flags(f))[:, -1]).argmax(-1) == y).float().mean()
    assert accuracy > 0.9  # chance 1/6


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        QANetEncoderBlock(4, 2, kernel_size=4)
    with pytest.raises(ValueError, match=r"survival_last must be in \(0, 1\]"):
        QANetEncoderBlock(4, 2, survival_last=1.5)
    with pytest.raises(ValueError, match="total_layers = 3"):
        QANetEncoderBlock(4, 2, num_convs=2, total_layers=3)
    block = QANetEncoderBlock(4, 2, num_convs=1, kernel_size=3)
    with pytest.raises(ValueError, match=r"x must be \(B, N, D\) with D = embed_dim = 4"):
        block(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match=r"mask must be \(B, N\) or \(B, 1, N\)"):
        block(torch.randn(2, 5, 4), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a boolean tensor"):
        block(torch.randn(2, 5, 4), torch.ones(2, 5))
