"""GTrXL (Parisotto et al. 2019): the GRU-type gate against a loop written from its equations,
the layer against the reordered Transformer-XL sublayers, near-identity at the initial gate bias,
the stack's recurrence, and recall of a token from the previous segment through the memory."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_same_forward_backward, rand
from torch import nn

from attnkit.positions import (
    GatedTransformerXL,
    GatedTransformerXLLayer,
    GRUGate,
    TransformerXL,
)


def _sigmoid(t):
    return 1 / (1 + torch.exp(-t))


def _gate_loop(gate, x, y):
    """Per position and unit i: r_i = σ(W_r[i]·y + U_r[i]·x), z_i = σ(W_z[i]·y + U_z[i]·x −
    b_g[i]), ĥ_i = tanh(W_g[i]·y + U_g[i]·(r ⊙ x)), g_i = (1 − z_i) x_i + z_i ĥ_i."""
    W_r, U_r, W_z, U_z, W_g, U_g = (
        getattr(gate, n).weight for n in ("W_r", "U_r", "W_z", "U_z", "W_g", "U_g")
    )
    flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    out = []
    for xv, yv in zip(flat_x, flat_y, strict=True):
        d = len(xv)
        r = torch.stack([_sigmoid(W_r[i] @ yv + U_r[i] @ xv) for i in range(d)])
        z = [_sigmoid(W_z[i] @ yv + U_z[i] @ xv - gate.b_g[i]) for i in range(d)]
        h = [torch.tanh(W_g[i] @ yv + U_g[i] @ (r * xv)) for i in range(d)]
        out.append(torch.stack([(1 - z[i]) * xv[i] + z[i] * h[i] for i in range(d)]))
    return torch.stack(out).reshape(x.shape)


def test_gate_matches_the_equations():
    torch.manual_seed(0)
    gate = GRUGate(4, gate_bias=1.5).double()
    with torch.no_grad():
        gate.b_g.add_(torch.randn(4, dtype=torch.float64))  # a learned bias, not one number
    x, y = rand(1, 3, 4, seed=1), rand(1, 3, 4, seed=2)
    assert_same_forward_backward(
        lambda: gate(x, y), lambda: _gate_loop(gate, x, y), [x, y, *gate.parameters()]
    )


def _layer_norm(norm, t):
    mu = t.mean(-1, keepdim=True)
    var = ((t - mu) ** 2).mean(-1, keepdim=True)
    return (t - mu) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


def test_layer_is_the_reordered_xl_layer_with_gates():
    """Ȳ = RelMHA(LN([SG(M) ∘ E])), Y = g_MHA(E, ReLU(Ȳ)), Ē = f(LN(Y)), E' = g_MLP(Y, ReLU(Ē))."""
    torch.manual_seed(0)
    layer = GatedTransformerXLLayer(8, 2, 12).double()
    h, memory = rand(2, 3, 8, seed=1), rand(2, 4, 8, seed=2)
    xl = layer.xl

    def reference():
        context = _layer_norm(xl.norm1, torch.cat([memory, h], dim=-2))
        y_bar = xl.relative_attention(context[:, 4:], context, None)
        y = _gate_loop(layer.gate_attention, h, torch.relu(y_bar))
        ff = xl.ff
        f = _layer_norm(xl.norm2, y)
        e_bar = torch.relu(f @ ff[0].weight.T + ff[0].bias) @ ff[2].weight.T + ff[2].bias
        return _gate_loop(layer.gate_ff, y, torch.relu(e_bar))

    assert_same_forward_backward(
        lambda: layer(h, memory), reference, [h, memory, *layer.parameters()]
    )


def test_the_initial_gate_bias_starts_the_layer_near_the_identity():
    torch.manual_seed(0)
    x, memory = torch.randn(4, 10, 32), torch.randn(4, 6, 32)
    deviation = {}
    for b_g in (0.0, 2.0, 8.0):
        torch.manual_seed(1)
        layer = GatedTransformerXLLayer(32, 4, gate_bias=b_g)
        with torch.no_grad():
            deviation[b_g] = float((layer(x, memory) - x).norm() / x.norm())
            if b_g == 2.0:  # the update gate of the attention sublayer is about σ(−2) ≈ 0.12
                context = layer.xl.norm1(torch.cat([memory, x], dim=-2))
                y_bar = layer.xl.relative_attention(context[:, 6:], context, None)
                z = layer.gate_attention.update(x, torch.relu(y_bar))
                assert z.mean() < 0.2 and abs(float(z.mean()) - 1 / (1 + math.exp(2))) < 0.05
    assert deviation[0.0] > 0.5  # without the bias the gates mix half and half
    assert deviation[2.0] < 0.4
    assert deviation[8.0] < 5e-3  # σ(−8) ≈ 3e-4: the identity up to that
    assert deviation[0.0] > deviation[2.0] > deviation[8.0]


def test_stack_recurs_over_segments_with_gated_layers():
    torch.manual_seed(0)
    stack = GatedTransformerXL(2, 8, 2, 16, mem_len=4).double()
    assert all(isinstance(layer, GatedTransformerXLLayer) for layer in stack.layers)
    assert isinstance(stack, TransformerXL)
    x1, x2 = rand(2, 3, 8, seed=1, grad=False), rand(2, 3, 8, seed=2, grad=False)
    y1, memory = stack(x1)
    y2, _ = stack(x2, memory)
    # one pass over the two segments with each layer's memory = its earlier inputs
    h = torch.cat([x1, x2], dim=1)
    for layer in stack.layers:
        h = layer(h)
    torch.testing.assert_close(y1, h[:, :3])
    torch.testing.assert_close(memory[0], x1)  # 3 positions ≤ mem_len: all kept
    # segment 2 attends over the cached states: equal to the full pass when mem_len covers it
    torch.testing.assert_close(y2, h[:, 3:])


SEG, VOCAB, D = 6, 6, 16


def _recall_batch(size, g):
    """Segment 1: tokens, one of them flagged; segment 2: tokens, the last one asks for the
    flagged token of segment 1, which only the memory holds."""
    first = torch.randint(0, VOCAB, (size, SEG), generator=g)
    second = torch.randint(0, VOCAB, (size, SEG), generator=g)
    pos = torch.randint(0, SEG, (size,), generator=g)
    flag1 = torch.zeros(size, SEG, dtype=torch.long)
    flag1[torch.arange(size), pos] = 1
    flag2 = torch.zeros(size, SEG, dtype=torch.long)
    flag2[:, -1] = 2
    return first, flag1, second, flag2, first[torch.arange(size), pos]


def test_learns_to_recall_from_the_previous_segment():
    torch.manual_seed(0)
    tok, flags = nn.Embedding(VOCAB, D), nn.Embedding(3, D)
    layer = GatedTransformerXLLayer(D, 2, 32)
    out = nn.Linear(D, VOCAB)
    params = [*tok.parameters(), *flags.parameters(), *layer.parameters(), *out.parameters()]
    opt = torch.optim.Adam(params, 1e-2)
    g = torch.Generator().manual_seed(1)

    def predict(first, flag1, second, flag2):
        memory = (tok(first) + flags(flag1)).detach()  # the layer's input on segment 1, SG
        return out(layer(tok(second) + flags(flag2), memory)[:, -1])

    for _ in range(100):
        *batch, y = _recall_batch(32, g)
        loss = nn.functional.cross_entropy(predict(*batch), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    *batch, y = _recall_batch(1000, torch.Generator().manual_seed(9))
    with torch.no_grad():
        accuracy = (predict(*batch).argmax(-1) == y).float().mean()
    assert accuracy > 0.9  # chance 1/6


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="gate_bias"):
        GRUGate(4, gate_bias="2")
    with pytest.raises(ValueError, match="embed_dim = 6 is not divisible by num_heads = 4"):
        GatedTransformerXLLayer(6, 4)
    layer = GatedTransformerXLLayer(8, 2)
    with pytest.raises(ValueError, match=r"h must be \(B, M, D\) with D = embed_dim = 8"):
        layer(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"memory must be \(B, P, D\)"):
        layer(torch.randn(2, 3, 8), torch.randn(3, 4, 8))
