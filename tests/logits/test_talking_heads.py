"""Talking-heads attention against Shazeer et al.'s einsum program and a loop over heads."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.logits import TalkingHeadsAttention


def _loop(part, q, k, v, keep):
    """e'_h = Σ_h' P_l[h', h] e_h', a = softmax(e'), a'_h = Σ_h' P_w[h', h] a_h', o_h = a'_h v_h."""
    b_, h_, m, d = q.shape
    out = torch.zeros(b_, h_, m, v.shape[-1], dtype=q.dtype)
    for b in range(b_):
        for t in range(m):
            e = [q[b, h, t] @ k[b, h].T / math.sqrt(d) for h in range(h_)]
            a = []
            for h in range(h_):
                mixed = sum(part.logits_proj[g, h] * e[g] for g in range(h_))
                allowed = keep[b, h, t]
                w = torch.zeros_like(mixed)
                if allowed.any():
                    w[allowed] = torch.softmax(mixed[allowed], 0)
                a.append(w)
            for h in range(h_):
                w = sum(part.weights_proj[g, h] * a[g] for g in range(h_)) * keep[b, h, t]
                out[b, h, t] = w @ v[b, h]
    return out


def test_matches_the_loop_and_the_papers_einsums():
    module, (q, k, v), kw = ak.mechanisms.example("talking_heads")
    module = module.double()
    q, k, v = q.double(), k.double(), v.double()
    out = module(q, k, v, **kw).context
    keep = kw["mask"].expand(2, 3, 5, 5)
    ref = _loop(module, q, k, v, keep)
    print(f"talking heads vs loop: max abs diff {float((out - ref).detach().abs().max()):.2e}")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    # Shazeer et al. sec. 4, layout [batch, query N, key M, heads h], no mask
    logits = torch.einsum("bhnk,bhmk->bnmh", q, k) / math.sqrt(4)
    logits = torch.einsum("bnmh,hH->bnmH", logits, module.logits_proj)
    weights = torch.einsum("bnmH,Hh->bnmh", torch.softmax(logits, 2), module.weights_proj)
    paper = torch.einsum("bnmh,bhmv->bhnv", weights, v)
    torch.testing.assert_close(module(q, k, v).context, paper, atol=1e-12, rtol=1e-10)


def test_identity_projections_are_multihead_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, n, 8, dtype=torch.float64) for n in (3, 6, 6))
    part = TalkingHeadsAttention(4).double()
    torch.testing.assert_close(part(q, k, v).context, ak.attention(q, k, v).context)


def test_refuses_other_head_counts():
    with pytest.raises(ValueError, match=r"num_heads=3"):
        TalkingHeadsAttention(3)(*(torch.randn(1, 2, 4, 4) for _ in range(3)))
