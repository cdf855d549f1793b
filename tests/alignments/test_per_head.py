"""PerHead: a multi-head attention with one alignment per head equals each head run alone."""

import math

import pytest
import torch
from helpers import rand

import attnkit as ak
from attnkit import alignments as al


def heads_alone(mha, aligns, x, mask):
    """Brauwers eqs. 38-40 head by head: head h projects x, scores q_h k_hᵀ/√d, aligns with its
    own alignment, sums its values; the heads are concatenated and projected by W^O."""
    d = mha.head_dim
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3)
    contexts, weights = [], []
    for h, align in enumerate(aligns):
        rows = slice(h * d, (h + 1) * d)
        q, k, v = (x @ w[rows].T + b[rows] for w, b in ((wq, bq), (wk, bk), (wv, bv)))
        e = q @ k.transpose(-1, -2) / math.sqrt(d)
        a = align(e, mask, query=q).weights
        weights.append(a)
        contexts.append(a @ v)
    out = torch.cat(contexts, dim=-1) @ mha.out_proj.weight.T + mha.out_proj.bias
    return out, torch.stack(weights, dim=1)


def test_each_head_with_its_alignment():
    torch.manual_seed(0)
    aligns = [al.Local(1), al.Softmax(), al.Sparsemax(), al.Local(2, gaussian=True)]
    mha = ak.MultiHeadAttention(8, 4, align=al.PerHead(aligns), dtype=torch.float64)
    x = rand(2, 6, 8)
    mask = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    out = mha(x, mask=mask, need_weights=True)
    ref, ref_w = heads_alone(mha, aligns, x, mask)
    torch.testing.assert_close(out.context, ref)
    torch.testing.assert_close(out.weights, ref_w)
    (g1,) = torch.autograd.grad(out.context.sum(), x)
    (g2,) = torch.autograd.grad(ref.sum(), x)
    torch.testing.assert_close(g1, g2)
    assert out.weights[:, 0].triu(2).abs().sum() == 0  # the local head stays in its window
    assert set(ak.describe(mha).alignment.split(" + ")) == {"Global", "Sparse", "Local"}


def test_groups_of_heads():
    torch.manual_seed(1)
    grouped = al.PerHead([al.Local(1), "sparsemax"], counts=[1, 3])
    mha = ak.MultiHeadAttention(8, 4, align=grouped, dtype=torch.float64)
    x = rand(2, 5, 8, seed=1)
    mask = torch.rand(2, 4, 5, 5, generator=torch.Generator().manual_seed(2)) > 0.3
    mask[..., 0] = True
    ref, _ = heads_alone(mha, [al.Local(1)] + [al.Sparsemax()] * 3, x, None)
    torch.testing.assert_close(mha(x).context, ref)
    # a per-head mask is split with the heads
    out = mha(x, mask=mask, need_weights=True).weights
    e = _scores(mha, x)
    torch.testing.assert_close(out[:, :1], al.Local(1)(e[:, :1], mask[:, :1]).weights)
    torch.testing.assert_close(out[:, 1:], al.Sparsemax()(e[:, 1:], mask[:, 1:]).weights)
    assert (out[~mask] == 0).all()


def _scores(mha, x):
    d = mha.head_dim
    wq, wk, _ = mha.in_proj_weight.chunk(3)
    bq, bk, _ = mha.in_proj_bias.chunk(3)
    q = (x @ wq.T + bq).unflatten(-1, (mha.num_heads, d)).transpose(1, 2)
    k = (x @ wk.T + bk).unflatten(-1, (mha.num_heads, d)).transpose(1, 2)
    return q @ k.transpose(-1, -2) / math.sqrt(d)


def test_the_query_is_split_with_the_heads():
    torch.manual_seed(2)
    local = al.Local(1, "predictive", d_q=3, num_heads=2, dtype=torch.float64)
    align = al.PerHead([local, al.Softmax()], counts=[2, 1])
    e, q = rand(2, 3, 4, 5, seed=3), rand(2, 3, 4, 3, seed=4)
    w = align(e, query=q).weights
    torch.testing.assert_close(w[:, :2], local(e[:, :2], query=q[:, :2]).weights)
    torch.testing.assert_close(w[:, 2:], torch.softmax(e[:, 2:], -1))


def test_capabilities_and_log_prob():
    align = al.PerHead([al.Hard(), al.Softmax(), al.Local(1, gaussian=True)], counts=[1, 2, 1])
    assert align.stochastic and align.position_based and not align.normalized
    assert al.PerHead(["softmax", "sparsemax"]).normalized
    assert not al.PerHead(["softmax", "sparsemax"]).position_based
    e = rand(2, 4, 3, 5, seed=5, grad=False)
    out = align.train()(e)
    assert out.log_prob.shape == (2, 4, 3)
    assert (out.log_prob[:, 1:] == 0).all() and (out.log_prob[:, 0] < 0).all()
    torch.testing.assert_close(out.weights[:, 1:3], torch.softmax(e[:, 1:3], -1))


def test_bad_arguments():
    with pytest.raises(ValueError, match="H = 3"):
        al.PerHead(["softmax"] * 3)(torch.randn(2, 4, 3, 5))
    with pytest.raises(ValueError, match="H = 2"):
        al.PerHead(["softmax"] * 2)(torch.randn(3, 5))
    with pytest.raises(ValueError, match="at least one"):
        al.PerHead([])
    with pytest.raises(ValueError, match="counts has 1"):
        al.PerHead(["softmax", "sparsemax"], counts=[2])
    with pytest.raises(TypeError, match="sequence"):
        al.PerHead("softmax")
    with pytest.raises(TypeError, match="Alignment"):
        al.PerHead([torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="counts"):
        al.PerHead(["softmax"], counts=[0])
