"""Decomposable attention (Parikh et al. 2016) against a loop of the paper's equations (1)-(5)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit.features import DecomposableAttention


def _ff(seq, x):
    """A feed-forward network written out from its Linear layers (ReLU between, and after the
    last layer when the Sequential ends with one)."""
    layers = [m for m in seq if isinstance(m, torch.nn.Linear)]
    for i, lin in enumerate(layers):
        x = lin.weight @ x + lin.bias
        if i < len(layers) - 1 or isinstance(seq[-1], torch.nn.ReLU):
            x = torch.relu(x)
    return x


def _loop(m, a, b):
    """One pair: a (la, d), b (lb, d) -> (ŷ, weights1 (la, lb), weights2 (lb, la))."""
    A, B = list(a), list(b)
    e = [[_ff(m.F, ai) @ _ff(m.F, bj) for bj in B] for ai in A]  # eq. 1
    w1, w2 = [], []
    betas = []
    for i in range(len(A)):  # eq. 2: β_i
        z = sum(torch.exp(e[i][k]) for k in range(len(B)))
        w = [torch.exp(e[i][j]) / z for j in range(len(B))]
        w1.append(torch.stack(w))
        betas.append(sum(wj * bj for wj, bj in zip(w, B, strict=True)))
    alphas = []
    for j in range(len(B)):  # eq. 2: α_j
        z = sum(torch.exp(e[k][j]) for k in range(len(A)))
        w = [torch.exp(e[i][j]) / z for i in range(len(A))]
        w2.append(torch.stack(w))
        alphas.append(sum(wi * ai for wi, ai in zip(w, A, strict=True)))
    v1 = sum(_ff(m.G, torch.cat([ai, bi])) for ai, bi in zip(A, betas, strict=True))  # eqs. 3-4
    v2 = sum(_ff(m.G, torch.cat([bj, aj])) for bj, aj in zip(B, alphas, strict=True))
    y = _ff(m.H, torch.cat([v1, v2]))  # eq. 5
    return y, torch.stack(w1), torch.stack(w2)


def test_attend_compare_aggregate_match_the_loop():
    torch.manual_seed(0)
    m = DecomposableAttention(3, 5, 2).double()
    a, b = rand(2, 4, 3, seed=1), rand(2, 3, 3, seed=2)
    mask1 = ak.masks.from_lengths(torch.tensor([4, 2]), 4)
    mask2 = ak.masks.from_lengths(torch.tensor([3, 1]), 3)
    out = m(a, b, mask1, mask2)
    lengths = [(4, 3), (2, 1)]

    def slow():
        return torch.stack(
            [_loop(m, a[i, :la], b[i, :lb])[0] for i, (la, lb) in enumerate(lengths)]
        )

    assert_same_forward_backward(
        lambda: m(a, b, mask1, mask2).logits, slow, [a, b, *m.parameters()], atol=1e-12, rtol=1e-10
    )
    for i, (la, lb) in enumerate(lengths):
        _, w1, w2 = _loop(m, a[i, :la], b[i, :lb])
        torch.testing.assert_close(out.weights1[i, :la, :lb], w1)
        torch.testing.assert_close(out.weights2[i, :lb, :la], w2)
        assert (out.weights1[i, la:] == 0).all() and (out.weights1[i, :, lb:] == 0).all()


def test_permuting_either_sentence_changes_nothing():
    """Bag-of-words model: the aggregation sums over tokens, so order is ignored."""
    torch.manual_seed(0)
    m = DecomposableAttention(3, 5, 2).double()
    a, b = rand(2, 4, 3, seed=1, grad=False), rand(2, 3, 3, seed=2, grad=False)
    pa, pb = torch.randperm(4), torch.randperm(3)
    torch.testing.assert_close(m(a[:, pa], b[:, pb]).logits, m(a, b).logits)


def test_learns_whether_the_hypothesis_token_is_in_the_premise():
    """Premise: 4 distinct tokens of 10; hypothesis: one token, from the premise (label 1) or
    not (label 0). Aligning the hypothesis token to its copy solves it; a short run does (the
    model ignores order, so the copy's position does not matter)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    vocab, d = 10, 16
    embed = torch.nn.Embedding(vocab, d)
    m = DecomposableAttention(d, d, 2)
    opt = torch.optim.Adam([*m.parameters(), *embed.parameters()], lr=1e-2)

    def batch(n):
        perm = torch.rand(n, vocab, generator=g).argsort(-1)
        label = torch.randint(0, 2, (n,), generator=g)
        hypothesis = torch.where(label.bool(), perm[:, 0], perm[:, 4])[:, None]
        return perm[:, :4], hypothesis, label

    for _ in range(120):
        prem, hyp, label = batch(32)
        loss = torch.nn.functional.cross_entropy(m(embed(prem), embed(hyp)).logits, label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    prem, hyp, label = batch(500)
    with torch.no_grad():
        accuracy = (m(embed(prem), embed(hyp)).logits.argmax(-1) == label).float().mean()
    assert accuracy > 0.9, accuracy


def test_bad_inputs_are_named():
    m = DecomposableAttention(3, 4, 2)
    with pytest.raises(ValueError, match=r"f2 has 4 features"):
        m(torch.randn(2, 4, 3), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="d_hidden"):
        DecomposableAttention(3, 0, 2)
