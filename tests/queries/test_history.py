"""Truncated history-attention (Li et al.; Galassi IV-A) against a loop written from its
equations, and a task that needs the history: following a linked list through the keys."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.queries import TruncatedHistoryAttention


def _loop(m, x, k, v, keep):
    """q_t = [x_t ; c_{t−1} ; … ; c_{t−T}] (zeros before the first step), e_n = wᵀ tanh(W_1 q_t
    + W_2 k_n + b), a softmax over the allowed keys, c_t = Σ_n a_n v_n; step by step."""
    score = m.attention.score
    W1, W2, b2, w = score.W1.weight, score.W2.weight, score.W2.bias, score.w.weight[0]
    out = []
    for b in range(x.shape[0]):
        history = [torch.zeros(v.shape[-1], dtype=x.dtype)] * m.history
        allowed = [n for n in range(k.shape[1]) if keep[b, 0, n]]
        steps = []
        for t in range(x.shape[1]):
            q = torch.cat([x[b, t], *history])
            e = {n: w @ torch.tanh(W1 @ q + W2 @ k[b, n] + b2) for n in allowed}
            z = sum(torch.exp(e[n]) for n in allowed)
            c = sum(torch.exp(e[n]) / z * v[b, n] for n in allowed)
            history = [c, *history[:-1]]
            steps.append(c)
        out.append(torch.stack(steps))
    return torch.stack(out)


@pytest.mark.parametrize("history", [1, 3])
def test_matches_the_equations_forward_and_backward(history):
    torch.manual_seed(0)
    m = TruncatedHistoryAttention(4, 5, 3, history, d_w=6).double()
    x, k, v = rand(2, 5, 4, seed=1), rand(2, 6, 5, seed=2), rand(2, 6, 3, seed=3)
    keep = ak.masks.from_lengths(torch.tensor([6, 4]), 6)  # (B, 1, N)
    assert_same_forward_backward(
        lambda: m(x, k, v, mask=keep).contexts,
        lambda: _loop(m, x, k, v, keep),
        [x, k, v, *m.parameters()],
    )


def test_the_query_holds_the_last_t_contexts():
    """T = 2: step 3's query is [x_3 ; c_2 ; c_1]. Per-step masks that let step 1 see only key 0
    and step 2 only key 1 fix c_1 = k_0 and c_2 = k_1; c_3 is then one attention call with that
    query."""
    torch.manual_seed(0)
    m = TruncatedHistoryAttention(2, 3, 3, 2, d_w=4).double()
    x, k = rand(1, 4, 2, seed=1, grad=False), rand(1, 3, 3, seed=2, grad=False)
    mask = torch.ones(1, 4, 3, dtype=torch.bool)
    mask[0, 0] = torch.tensor([True, False, False])
    mask[0, 1] = torch.tensor([False, True, False])
    out = m(x, k, mask=mask)
    torch.testing.assert_close(out.contexts[0, :2], k[0, :2])
    q3 = torch.cat([x[0, 2], k[0, 1], k[0, 0]])  # [x_3 ; c_2 ; c_1]
    ref = ak.attention(q3[None, None], k, score=m.attention.score).context[0, 0]
    torch.testing.assert_close(out.contexts[0, 2], ref)


def test_per_step_masks_and_values_default_to_keys():
    torch.manual_seed(0)
    m = TruncatedHistoryAttention(2, 3, 3, 1, d_w=4).double()
    x, k = rand(2, 3, 2, seed=1), rand(2, 4, 3, seed=2)
    mask = torch.ones(2, 3, 4, dtype=torch.bool)
    mask[:, 1, 2:] = False
    out = m(x, k, mask=mask)
    assert out.weights.shape == (2, 3, 4) and out.contexts.shape == (2, 3, 3)
    assert (out.weights[:, 1, 2:] == 0).all() and not (out.weights[:, 0, 2:] == 0).all()
    torch.testing.assert_close(out.contexts, out.weights @ k)


N, S = 6, 4


def _walk_batch(size, g):
    """Keys [label ; next label] (one-hot) at shuffled positions, the next labels a random
    permutation; x_1 names the start label and x_t = 0 after, so from step 2 on the only way to
    the next node is the previous context's "next label"."""
    label = torch.argsort(torch.rand(size, N, generator=g), -1)
    nxt = torch.argsort(torch.rand(size, N, generator=g), -1)
    eye = torch.eye(N)
    k = torch.cat([eye[label], eye[torch.gather(nxt, 1, label)]], -1)
    start = torch.randint(0, N, (size,), generator=g)
    x = torch.zeros(size, S, N)
    x[torch.arange(size), 0, start] = 1
    position = torch.argsort(label, -1)
    node, targets = start, []
    for _ in range(S):
        targets.append(position[torch.arange(size), node])
        node = nxt[torch.arange(size), node]
    return x, k, torch.stack(targets, 1)


def test_learns_to_follow_a_linked_list():
    torch.manual_seed(0)
    m = TruncatedHistoryAttention(N, 2 * N, 2 * N, 1, score=ak.scores.General(3 * N, 2 * N))
    opt = torch.optim.Adam(m.parameters(), 0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        x, k, y = _walk_batch(64, g)
        w = m(x, k).weights
        loss = -torch.log(w.gather(-1, y[..., None]) + 1e-9).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, k, y = _walk_batch(1000, torch.Generator().manual_seed(9))
    with torch.no_grad():
        accuracy = (m(x, k).weights.argmax(-1) == y).float().mean(0)
    assert (accuracy[1:] > 0.95).all(), accuracy  # steps 2-4: only the history says where


def test_bad_calls_are_named():
    m = TruncatedHistoryAttention(2, 3, 3, 2, d_w=4)
    with pytest.raises(ValueError, match=r"x must be \(B, L, 2\)"):
        m(torch.randn(2, 3, 5), torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match=r"v must be \(B, L, 3\)"):
        m(torch.randn(2, 3, 2), torch.randn(2, 4, 3), torch.randn(2, 4, 2))
    with pytest.raises(ValueError, match=r"d_x \+ T·d_v = 2 \+ 2·3 = 8"):
        TruncatedHistoryAttention(2, 3, 3, 2, score=ak.scores.General(5, 3))
    with pytest.raises(ValueError, match="history"):
        TruncatedHistoryAttention(2, 3, 3, 0)
    assert "truncated_history" in ak.mechanisms.available()
