"""Pointer networks (Vinyals et al. 2015) against a loop of the paper's equations, and a short
training run that learns to sort."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.queries import PointerNetwork


def _lstm_step(x, h, c, w_ih, w_hh, b_ih, b_hh):
    """One LSTM step written out (gates i, f, g, o in PyTorch's order)."""
    z = w_ih @ x + b_ih + w_hh @ h + b_hh
    i, f, g, o = z.chunk(4)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _loop(m, x, length, targets=None, exclusive=False):
    """Vinyals et al.: encoder states e_j, decoder states d_i, u^i_j = vᵀ tanh(W_1 e_j + W_2 d_i)
    (+ the additive score's bias), p_i = softmax(u^i) over the inputs still allowed. One
    sequence x (n, d_in) with ``length`` real inputs; returns (steps, n) distributions."""
    enc, dec, score = m.encoder, m.decoder, m.attention.score
    emb = [m.embed.weight @ xj + m.embed.bias for xj in x[:length]]
    h = c = torch.zeros(enc.hidden_size, dtype=x.dtype)
    es = []
    for e in emb:
        h, c = _lstm_step(e, h, c, enc.weight_ih_l0, enc.weight_hh_l0, enc.bias_ih_l0,
                          enc.bias_hh_l0)  # fmt: skip
        es.append(h)
    inp, allowed, rows = m.start, list(range(length)), []
    steps = length if targets is None else len(targets)
    for i in range(steps):
        h, c = _lstm_step(inp, h, c, dec.weight_ih, dec.weight_hh, dec.bias_ih, dec.bias_hh)
        u = {
            j: score.w.weight[0]
            @ torch.tanh(score.W1.weight @ h + score.W2.weight @ es[j] + score.W2.bias)
            for j in allowed
        }
        total = sum(torch.exp(v) for v in u.values())
        p = [torch.exp(u[j]) / total if j in u else torch.zeros((), dtype=x.dtype)
             for j in range(x.shape[0])]  # fmt: skip
        row = torch.stack(p)
        rows.append(row)
        pick = int(targets[i]) if targets is not None else int(row.detach().argmax())
        if exclusive:
            allowed.remove(pick)
        inp = emb[pick]
    return torch.stack(rows)


@pytest.mark.parametrize("exclusive", [False, True])
def test_output_is_the_attention_distribution_greedy(exclusive):
    torch.manual_seed(0)
    m = PointerNetwork(2, 5, exclusive=exclusive).double()
    x = rand(2, 6, 2, seed=1)
    mask = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    out = m(x, mask)
    assert out.weights.shape == (2, 6, 6)
    for b, n in enumerate([6, 4]):
        ref = _loop(m, x[b], n, exclusive=exclusive)
        torch.testing.assert_close(out.weights[b, :n], ref, atol=1e-12, rtol=1e-10)
        assert torch.equal(out.pointers[b, :n], ref.argmax(-1))
    if exclusive:  # each real input is pointed at exactly once
        assert sorted(out.pointers[0].tolist()) == list(range(6))
        assert sorted(out.pointers[1, :4].tolist()) == list(range(4))


def test_teacher_forcing_matches_the_loop_forward_and_backward():
    torch.manual_seed(0)
    m = PointerNetwork(2, 4, exclusive=True).double()
    x = rand(2, 5, 2, seed=3)
    targets = torch.tensor([[4, 0, 2, 1, 3], [1, 2, 0, 0, 0]])
    mask = ak.masks.from_lengths(torch.tensor([5, 3]), 5)

    def fast():
        return m(x, mask, targets).weights[1, :3]

    def slow():
        return _loop(m, x[1], 3, targets[1, :3], exclusive=True)

    assert_same_forward_backward(fast, slow, [x, *m.parameters()], atol=1e-12, rtol=1e-10)
    full = m(x, mask, targets).weights[0]
    torch.testing.assert_close(full, _loop(m, x[0], 5, targets[0], exclusive=True))


def test_nll_reads_the_target_probabilities():
    torch.manual_seed(0)
    m = PointerNetwork(1, 4).double()
    x = rand(2, 4, 1, seed=2, grad=False)
    t = torch.tensor([[3, 1, 0, 2], [0, 1, 2, 3]])
    out = m(x, targets=t)
    want = -sum(out.weights[b, i, t[b, i]].log() for b in range(2) for i in range(4)) / 8
    torch.testing.assert_close(out.nll(t), want)


def _sort_batch(n, length, g):
    x = torch.rand(n, length, 1, generator=g)
    return x, x[..., 0].argsort(-1)


def test_learns_to_sort_five_numbers():
    """Sixty steps on lists of 5 numbers in [0, 1): per-position accuracy on fresh
    lists well above chance (1/5 for the first step; exclusive pointing alone cannot do it)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    m = PointerNetwork(1, 16, exclusive=True)
    opt = torch.optim.Adam(m.parameters(), lr=2e-2)
    for _ in range(60):
        x, t = _sort_batch(32, 5, g)
        loss = m(x, targets=t).nll(t)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, t = _sort_batch(500, 5, g)
    with torch.no_grad():
        pointers = m(x).pointers
    position_accuracy = (pointers == t).float().mean().item()
    assert position_accuracy > 0.85, position_accuracy


def test_bad_inputs_are_refused():
    m = PointerNetwork(2, 4)
    x = torch.randn(2, 5, 2)
    with pytest.raises(ValueError, match="targets must be"):
        m(x, targets=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="index the n = 5"):
        m(x, targets=torch.full((2, 3), 5))
    with pytest.raises(ValueError, match="prefix"):
        m(x, torch.tensor([[True, False, True, True, True]] * 2))
    with pytest.raises(ValueError, match="not both"):
        m(x, targets=torch.zeros(2, 3, dtype=torch.long), steps=3)
    with pytest.raises(ValueError, match="d_in"):
        m(torch.randn(2, 5, 3))
