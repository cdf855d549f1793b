"""Attention over per-query key subsets and the lightning indexer at the selected keys, evaluated
in blocks of queries with hand-written backwards, against float64 loops over queries from the
formulas (forward and gradients), with blocks of one query and of all queries."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.sparse_trainable import _gathered
from attnkit.sparse_trainable._gathered import gathered_softmax

D = torch.float64


def _problem(seed=0, lead=(2, 3), m=6, n=7, t=4, d=5, dv=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, m, d, generator=g, dtype=D)
    k = torch.randn(*lead, n, d, generator=g, dtype=D)
    v = torch.randn(*lead, n, dv, generator=g, dtype=D)
    index = torch.randint(0, n, (*lead, m, t), generator=g)
    ok = torch.rand(*lead, m, t, generator=g) < 0.7
    ok[0, 0, 1] = False  # a row without a key
    bias = torch.randn(*lead, m, t, generator=g, dtype=D)
    return q, k, v, index, ok, bias


def _attention_loop(q, k, v, index, ok, scale, bias):
    """o_m = Σ_t p_{m,t} v_{index[m,t]}, p_m = softmax over the ok entries of
    scale · q_m · k_{index[m,t]} + b_{m,t}; a row without an entry gives 0."""
    lead = q.shape[:-2]
    out = torch.zeros(*lead, q.shape[-2], v.shape[-1], dtype=D)
    weights = torch.zeros(index.shape, dtype=D)
    for item in torch.cartesian_prod(*[torch.arange(s) for s in lead]).tolist():
        item = tuple(item)
        for m in range(q.shape[-2]):
            chosen = [t for t in range(index.shape[-1]) if ok[item][m, t]]
            if not chosen:
                continue
            e = torch.stack(
                [scale * q[item][m] @ k[item][index[item][m, t]] + bias[item][m, t] for t in chosen]
            )
            p = torch.softmax(e, 0)
            for c, t in enumerate(chosen):
                weights[item][m, t] = p[c]
                out[item][m] = out[item][m] + p[c] * v[item][index[item][m, t]]
    return out, weights


@pytest.mark.parametrize("block_elements", [1, 1 << 20])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gathered_softmax_matches_the_loop(monkeypatch, block_elements, with_bias):
    monkeypatch.setattr(_gathered, "BLOCK_ELEMENTS", block_elements)
    q, k, v, index, ok, bias = _problem()
    q, k, v, bias = (x.requires_grad_() for x in (q, k, v, bias))
    b = bias if with_bias else torch.zeros_like(bias)
    out, weights = gathered_softmax(q, k, v, index, ok, 0.7, bias if with_bias else None)
    ref_out, ref_weights = _attention_loop(q, k, v, index, ok, 0.7, b)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(weights, ref_weights, atol=1e-12, rtol=1e-10)
    assert not out[0, 0, 1].any() and not weights[0, 0, 1].any()
    g = torch.Generator().manual_seed(1)
    r_out = torch.randn(out.shape, generator=g, dtype=D)
    r_w = torch.randn(weights.shape, generator=g, dtype=D)  # the weights are differentiable too
    leaves = (q, k, v, bias) if with_bias else (q, k, v)
    got = torch.autograd.grad((out * r_out).sum() + (weights * r_w).sum(), leaves)
    want = torch.autograd.grad((ref_out * r_out).sum() + (ref_weights * r_w).sum(), leaves)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, atol=1e-12, rtol=1e-10)


def test_gathered_softmax_reads_nothing_unselected():
    """NaN in keys and values that no ok entry names reaches neither the output nor the
    gradients, and those keys and values receive zero gradient."""
    q, k, v, index, ok, _ = _problem(2)
    hits = torch.zeros(*k.shape[:-1], dtype=torch.long)
    used = hits.scatter_add(-1, index.flatten(-2), ok.flatten(-2).long()) > 0
    k = k.where(used[..., None], float("nan")).requires_grad_()
    v = v.where(used[..., None], float("nan")).requires_grad_()
    q = q.requires_grad_()
    out, _ = gathered_softmax(q, k, v, index, ok, 1.0)
    assert not out.isnan().any()
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert not dq.isnan().any()
    assert not dk[~used].any() and not dv[~used].any()


def test_query_block_keeps_a_block_near_the_budget():
    assert _gathered.query_block(10, 1) == 10
    assert _gathered.query_block(1 << 30, 1 << 10) == _gathered.BLOCK_ELEMENTS >> 10
    assert _gathered.query_block(5, 1 << 40) == 1
    assert math.isclose(_gathered.query_block(1 << 30, 3) * 3, _gathered.BLOCK_ELEMENTS, abs_tol=3)
