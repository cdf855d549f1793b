"""The fusion-gate merge ([93], Galassi II-B) against a loop written from its equations, around
single- and multi-dimensional attention, and a task that needs the gate: output either the query's
own token or the attended one, as a switch in the query says."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand
from torch import nn

import attnkit as ak
from attnkit.features import GatedMerge


def _loop(m, q, k, v, keep, h=None):
    """u = F ⊙ h + (1 − F) ⊙ s, s = Σ_n a_n v_n, a = softmax over the allowed keys of the
    additive score e_n = wᵀ tanh(W_1 q + W_2 k_n + b), F = σ(W_f1 s + W_f2 h + b_f); one query
    and one key at a time."""
    score = m.attention.score
    W1, W2, b2, w = score.W1.weight, score.W2.weight, score.W2.bias, score.w.weight[0]
    Wf1, bf, Wf2 = m.fuse_s.weight, m.fuse_s.bias, m.fuse_h.weight
    h = q if h is None else h
    rows = []
    for b in range(q.shape[0]):
        row = []
        for i in range(q.shape[1]):
            allowed = [n for n in range(k.shape[1]) if keep[b, 0, n]]
            e = {n: w @ torch.tanh(W1 @ q[b, i] + W2 @ k[b, n] + b2) for n in allowed}
            top = max(float(x.detach()) for x in e.values())
            z = sum(torch.exp(e[n] - top) for n in allowed)
            s = sum(torch.exp(e[n] - top) / z * v[b, n] for n in allowed)
            gate = torch.stack(
                [
                    1 / (1 + torch.exp(-(Wf1[f] @ s + bf[f] + Wf2[f] @ h[b, i])))
                    for f in range(len(s))
                ]
            )
            row.append(gate * h[b, i] + (1 - gate) * s)
        rows.append(torch.stack(row))
    return torch.stack(rows)


def test_matches_the_equations_forward_and_backward():
    torch.manual_seed(0)
    m = GatedMerge(4, attention=ak.Attention(ak.scores.Additive(4, 6, 5))).double()
    q, k, v = rand(2, 3, 4, seed=1), rand(2, 5, 6, seed=2), rand(2, 5, 4, seed=3)
    keep = ak.masks.from_lengths(torch.tensor([5, 3]), 5)  # (B, 1, N)
    assert_same_forward_backward(
        lambda: m(q, k, v, mask=keep).output,
        lambda: _loop(m, q, k, v, keep),
        [q, k, v, *m.parameters()],
    )
    h = rand(2, 3, 4, seed=4)
    assert_same_forward_backward(
        lambda: m(q, k, v, h=h, mask=keep).output,
        lambda: _loop(m, q, k, v, keep, h=h),
        [q, k, v, h, *m.parameters()],
    )


def test_gate_picks_between_context_and_h():
    """F → 1 keeps h, F → 0 gives the summed context: the gate replaces the plain sum."""
    torch.manual_seed(0)
    m = GatedMerge(4).double()
    q, k, v = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2), rand(2, 5, 4, seed=3)
    plain = ak.attention(q, k, v).context
    for b_f, want in ((50.0, q), (-50.0, plain)):
        with torch.no_grad():
            m.fuse_s.weight.zero_()
            m.fuse_h.weight.zero_()
            m.fuse_s.bias.fill_(b_f)
        torch.testing.assert_close(m(q, k, v).output, want)
    torch.testing.assert_close(m(q, k, v).context, plain)


def test_around_multi_dimensional_and_multi_head_attention():
    torch.manual_seed(0)
    md = GatedMerge(4, attention=ak.Attention(ak.scores.Additive(4, 6, 5, d_out=4))).double()
    q, k, v = rand(2, 3, 4, seed=1), rand(2, 5, 6, seed=2), rand(2, 5, 4, seed=3)
    out = md(q, k, v)
    assert out.weights.shape == (2, 3, 5, 4) and out.output.shape == (2, 3, 4)
    mha = GatedMerge(8, attention=ak.MultiHeadAttention(8, 2, kdim=6, vdim=5)).double()
    x, kk, vv = rand(2, 3, 8, seed=1), rand(2, 7, 6, seed=2), rand(2, 7, 5, seed=3)
    out = mha(x, kk, vv)
    assert out.output.shape == (2, 3, 8) and out.weights.shape == (2, 2, 3, 7)
    assert "gated_merge" in ak.mechanisms.available()


V, N, D = 6, 8, 8


def _switch_batch(size, g):
    """Keys [token; flag; 1], values [token; 0; 0], query [token; switch; 1] (one-hot tokens);
    the answer is the query's own token when switch = 1, else the flagged key's token."""
    tok = torch.randint(0, V, (size, N), generator=g)
    pos = torch.randint(0, N, (size,), generator=g)
    qtok = torch.randint(0, V, (size,), generator=g)
    switch = torch.randint(0, 2, (size,), generator=g)
    eye = torch.eye(V)
    flag = torch.zeros(size, N)
    flag[torch.arange(size), pos] = 1
    k = torch.cat([eye[tok], flag[..., None], torch.ones(size, N, 1)], -1)
    v = torch.cat([eye[tok], torch.zeros(size, N, 2)], -1)
    q = torch.cat([eye[qtok], switch[:, None].float(), torch.ones(size, 1)], -1)[:, None]
    return q, k, v, torch.where(switch.bool(), qtok, tok[torch.arange(size), pos]), switch


def test_learns_to_switch_between_the_query_and_the_attended_value():
    torch.manual_seed(0)
    m = GatedMerge(D, attention=ak.Attention(ak.scores.General(D, D), "softmax"))
    readout = nn.Linear(D, V)
    opt = torch.optim.Adam([*m.parameters(), *readout.parameters()], 0.03)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        q, k, v, y, _ = _switch_batch(64, g)
        loss = nn.functional.cross_entropy(readout(m(q, k, v).output[:, 0]), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    q, k, v, y, switch = _switch_batch(1000, torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = m(q, k, v)
        accuracy = (readout(out.output[:, 0]).argmax(-1) == y).float().mean()
    assert accuracy > 0.95  # the summed context alone cannot name the query's token
    gate = out.gate[:, 0, :V].mean(-1)  # the gate on the token features
    assert gate[switch == 1].mean() > gate[switch == 0].mean() + 0.4


def test_bad_calls_are_named():
    m = GatedMerge(4)
    with pytest.raises(ValueError, match=r"q must have d = 4 features"):
        m(torch.randn(2, 3, 5), torch.randn(2, 4, 5), torch.randn(2, 4, 4))
    with pytest.raises(ValueError, match=r"h must have the shape"):
        m(torch.randn(2, 3, 4), torch.randn(2, 4, 4), h=torch.randn(2, 2, 4))
    with pytest.raises(TypeError, match="attention must be an attention module"):
        GatedMerge(4, attention="scaled_dot")
    with pytest.raises(ValueError, match="d"):
        GatedMerge(0)
