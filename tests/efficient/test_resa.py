"""Reinforced self-attention (Shen et al. 2018): RSS is its formula (context fusion, two-layer
network, Bernoulli draws and their log-probability), the sparse mask is head × dependent without
the diagonal, ReSA matches a loop over the paper's equations, and REINFORCE trains the samplers
on a task."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnkit as ak
from attnkit.efficient import ReinforcedSelfAttention
from attnkit.efficient.resa import ReinforcedSequenceSampler
from attnkit.tasks.parts import task_loss

D = torch.float64


def _rss_loop(sampler, x, keep):
    """p_i = σ(w₂ᵀ elu(W₁ [x_i; x̄; x_i ⊙ x̄] + b₁) + b₂), x̄ the mean of the real tokens."""
    b_size, n, _ = x.shape
    p = torch.zeros(b_size, n, dtype=x.dtype)
    for b in range(b_size):
        real = [i for i in range(n) if keep[b, i]]
        mean = sum(x[b, i] for i in real) / max(len(real), 1)
        for i in range(n):
            f = torch.cat([x[b, i], mean, x[b, i] * mean])
            hidden = F.elu(sampler.first.weight @ f + sampler.first.bias)
            p[b, i] = torch.sigmoid(sampler.second.weight[0] @ hidden + sampler.second.bias[0])
    return p


def test_rss_is_its_formula_with_the_log_probability_of_the_draw():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 4, generator=g, dtype=D)
    keep = ak.masks.from_lengths(torch.tensor([7, 5, 1]), 7).reshape(3, 7)
    sampler = ReinforcedSequenceSampler(4, 6).to(D)
    with torch.no_grad():
        p = _rss_loop(sampler, x, keep)
    torch.manual_seed(1)
    drawn = sampler.train()(x, keep)
    torch.testing.assert_close(drawn.prob, p)
    assert not (drawn.selected & ~keep).any()  # padding is never selected
    expected = [
        sum(
            math.log(p[b, i] if drawn.selected[b, i] else 1 - p[b, i])
            for i in range(7)
            if keep[b, i]
        )
        for b in range(3)
    ]
    torch.testing.assert_close(drawn.log_prob, torch.tensor(expected, dtype=D))
    # the draws are Bernoulli(p): over many draws the frequencies follow p
    torch.manual_seed(2)
    with torch.no_grad():
        many = torch.stack([sampler(x, keep).selected for _ in range(500)]).double().mean(0)
    assert ((many - p)[keep].abs() < 0.1).all()  # 4.5 standard deviations
    # evaluation keeps exactly the tokens with p > 1/2
    assert torch.equal(sampler.eval()(x, keep).selected, (p > 0.5) & keep)


def _resa_loop(module, x, head, dep):
    """ReSA (section 3.2) by loops: h = elu(W_h x + b_h); f_ij = c·tanh((W⁽¹⁾h_i + W⁽²⁾h_j +
    b⁽¹⁾)/c) per feature; a_ij = softmax over the j with ẑʰ_i = ẑᵈ_j = 1, i ≠ j; s_i = Σ a_ij ⊙ h_j
    (0 if no such j); u = F ⊙ h + (1 − F) ⊙ s with F = σ(W⁽ᶠ¹⁾h + W⁽ᶠ²⁾s + b⁽ᶠ⁾)."""
    b_size, n, d = x.shape
    c = module.scale
    u = torch.zeros(b_size, n, d, dtype=x.dtype)
    weights = torch.zeros(b_size, d, n, n, dtype=x.dtype)
    for b in range(b_size):
        h = [F.elu(module.map.weight @ x[b, i] + module.map.bias) for i in range(n)]
        for i in range(n):
            js = [j for j in range(n) if head[b, i] and dep[b, j] and j != i]
            s = torch.zeros(d, dtype=x.dtype)
            if js:
                f = torch.stack(
                    [
                        c
                        * torch.tanh(
                            (
                                module.head_proj.weight @ h[i]
                                + module.dependent_proj.weight @ h[j]
                                + module.score_bias
                            )
                            / c
                        )
                        for j in js
                    ]
                )  # (|js|, d)
                a = torch.softmax(f, 0)
                for t, j in enumerate(js):
                    s = s + a[t] * h[j]
                    weights[b, :, i, j] = a[t]
            gate = torch.sigmoid(
                module.fuse_h.weight @ h[i] + module.fuse_h.bias + module.fuse_s.weight @ s
            )
            u[b, i] = gate * h[i] + (1 - gate) * s
    return u, weights


def test_resa_is_the_papers_equations_and_its_mask_excludes_the_diagonal():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 4, generator=g, dtype=D).requires_grad_()
    module = ReinforcedSelfAttention(4, 5, init_bias=0.3).to(D).eval()
    mask = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    out = module(x, mask=mask, need_weights=True)
    keep = mask.reshape(2, 6)
    # the mask from the two samplers: head i to dependent j iff both selected and i ≠ j
    m = module.sparse_mask(out.head, out.dependent)
    for b in range(2):
        for i in range(6):
            for j in range(6):
                assert bool(m[b, i, j]) == bool(out.head[b, i] and out.dependent[b, j] and i != j)
    assert not (m & torch.eye(6, dtype=torch.bool)).any()
    assert out.head.any() and out.dependent.any() and not out.head[~keep].any()
    u, w = _resa_loop(module, x, out.head, out.dependent)
    torch.testing.assert_close(out.output[keep], u[keep])
    torch.testing.assert_close(out.weights, w)
    r = torch.randn(u.shape, generator=g, dtype=D) * keep[..., None]
    fast = torch.autograd.grad((out.output * r).sum(), x)[0]
    slow = torch.autograd.grad((u * r).sum(), x)[0]
    torch.testing.assert_close(fast, slow)
    # log_prob is the two samplers' log-probabilities of their selections
    lp = sum(s(x, keep).log_prob for s in (module.head_sampler, module.dependent_sampler))
    torch.testing.assert_close(out.log_prob, lp)


def test_errors():
    with pytest.raises(ValueError, match="scale must be > 0"):
        ReinforcedSelfAttention(4, scale=0.0)
    with pytest.raises(ValueError, match=r"ReinforcedSelfAttention\(d=4\) needs x"):
        ReinforcedSelfAttention(4)(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="padding mask"):
        ReinforcedSelfAttention(4)(torch.randn(2, 5, 4), mask=torch.ones(2, 5, 5, dtype=bool))


N = 8


def _batch(size, g):
    """Token i must output the mean value of the *relevant* tokens j ≠ i; distractors carry
    five times larger values. Tokens are [type, value, 1 − type, 1]."""
    t = torch.rand(size, N, generator=g) < 0.5
    a = torch.randn(size, N, generator=g)
    a = torch.where(t, a, 5 * a)
    x = torch.stack([t.float(), a, 1 - t.float(), torch.ones(size, N)], -1)
    rel = torch.where(t, a, 0.0)
    y = (rel.sum(-1, keepdim=True) - rel) / (t.sum(-1, keepdim=True) - t.long()).clamp_min(1)
    return x, y, t


def test_reinforce_trains_the_dependent_sampler_to_drop_distractors():
    torch.manual_seed(0)
    resa = ReinforcedSelfAttention(4, 8, init_bias=1.0)
    readout = nn.Linear(4, 1)
    opt = torch.optim.Adam([*resa.parameters(), *readout.parameters()], 1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        x, y, _ = _batch(64, g)
        out = resa(x)
        per_item = (readout(out.output).squeeze(-1) - y).square().mean(-1)
        loss = task_loss(per_item, out.log_prob)  # task loss + REINFORCE (reward −loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y, t = _batch(1000, torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = resa.eval()(x)
        error = float((readout(out.output).squeeze(-1) - y).square().mean())
    # every token stays a head and every relevant token a dependent; distractors, all kept at
    # first (p ≈ 0.73), are dropped as dependents by the policy gradient alone
    assert float(out.head.float().mean()) > 0.95
    assert float(out.dependent[t].float().mean()) > 0.95
    assert float(out.dependent[~t].float().mean()) < 0.85
    # the target's variance is ≈ 0.36; with the samplers frozen the error stays ≈ 0.09
    assert error < 0.03, error
