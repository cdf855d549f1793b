"""Sparse Sinkhorn attention and SortCut (Tay et al. 2020) against a loop of the paper's steps:
block sums, sorting scores, Sinkhorn balancing (plain, not in log space), sorted blocks, and
attention to the own block and the sorted one (or to the first n sorted blocks)."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.efficient import SinkhornAttention
from attnkit.efficient.sinkhorn import sinkhorn

D = torch.float64


def _balanced(r, n_iter):
    """Plain Sinkhorn: S = exp(R); n_iter × (rows, columns); then rows."""
    s = r.exp()
    for _ in range(n_iter):
        s = s / s.sum(1, keepdim=True)
        s = s / s.sum(0, keepdim=True)
    return s / s.sum(1, keepdim=True)


def _reference(part, q, k, v, lengths):
    b, d = part.block_size, part.head_dim
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=D)
    for z in range(q.shape[0]):
        n = int(lengths[z])
        blocks = [list(range(s, min(s + b, n))) for s in range(0, n, b)]
        sums = torch.stack([k[z, blk].sum(0) for blk in blocks])
        r = part.sort_query(sums) @ part.sort_key(sums).T / math.sqrt(d)
        p = _balanced(r / part.temperature, part.n_iter)

        def sorted_slots(i, p=p, blocks=blocks, z=z):
            slots = []
            for t in range(b):
                js = [j for j in range(len(blocks)) if t < len(blocks[j])]
                if not js:
                    continue
                w = torch.stack([p[i, j] for j in js])
                w = w / w.sum()
                slots.append(
                    (
                        sum(w[u] * k[z, blocks[j][t]] for u, j in enumerate(js)),
                        sum(w[u] * v[z, blocks[j][t]] for u, j in enumerate(js)),
                    )
                )
            return slots

        for i in range(q.shape[1]):
            bi = i // b
            if part.sortcut is None:
                if bi >= len(blocks):
                    continue
                keys = [(k[z, j], v[z, j]) for j in blocks[bi]] + sorted_slots(bi)
            else:
                keys = [s for c in range(min(part.sortcut, len(blocks))) for s in sorted_slots(c)]
            e = torch.stack([q[z, i] @ kk / math.sqrt(d) for kk, _ in keys])
            a = torch.softmax(e, 0)
            out[z, i] = sum(a[t] * vv for t, (_, vv) in enumerate(keys))
    return out


@pytest.mark.parametrize("sortcut", [None, 1, 2])
def test_equals_the_loop_of_the_paper_steps(sortcut):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 10, 4, generator=g, dtype=D) for _ in range(3))
    torch.manual_seed(0)
    part = SinkhornAttention(4, block_size=3, sortcut=sortcut, n_iter=5).to(D).eval()
    lengths = torch.tensor([10, 7])
    mask = ak.masks.from_lengths(lengths, 10)
    out = part(q, k, v, mask=mask, need_weights=True)
    ref = _reference(part, q, k, v, lengths)
    torch.testing.assert_close(out.context, ref, atol=1e-12, rtol=1e-10)
    # the weights attribute the sorted slots to the keys they mix: context = weights @ v
    torch.testing.assert_close(out.weights @ v, out.context, atol=1e-12, rtol=1e-10)
    sums = out.weights.sum(-1)
    torch.testing.assert_close(sums[sums > 0], torch.ones_like(sums[sums > 0]))
    assert (out.weights[1, :, 7:] == 0).all()


def test_log_space_balancing_equals_plain_sinkhorn_and_is_doubly_stochastic():
    r = torch.randn(2, 5, 5, dtype=D, generator=torch.Generator().manual_seed(1))
    ok = torch.ones(2, 5, 5, dtype=torch.bool)
    ok[1, 3:, :] = ok[1, :, 3:] = False  # item 1 has 3 real blocks
    p = sinkhorn(r, ok, 30).exp()
    torch.testing.assert_close(p[0], _balanced(r[0], 30))
    torch.testing.assert_close(p[1, :3, :3], _balanced(r[1, :3, :3], 30))
    assert (p[1][~ok[1]] == 0).all()
    torch.testing.assert_close(p[0].sum(0), torch.ones(5, dtype=D), atol=1e-6, rtol=0)
    torch.testing.assert_close(p[0].sum(1), torch.ones(5, dtype=D))


def test_one_block_is_full_attention():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 6, 4, generator=g, dtype=D) for _ in range(3))
    full = ak.attention(q, k, v).context
    for sortcut in (None, 1):
        part = SinkhornAttention(4, block_size=8, sortcut=sortcut).to(D).eval()
        torch.testing.assert_close(part(q, k, v).context, full, atol=1e-12, rtol=1e-10)


def test_sorting_is_learned_and_in_multi_head_attention():
    part = SinkhornAttention(4, block_size=2)
    mha = ak.MultiHeadAttention(8, 2, attention=part).train()
    x = torch.randn(2, 8, 8)
    out = mha(x)
    out.context.square().sum().backward()
    assert part.sort_query.weight.grad.abs().sum() > 0
    assert part.sort_key.weight.grad.abs().sum() > 0


def test_masks_and_biases_it_cannot_honour_are_refused():
    part = SinkhornAttention(4, block_size=2)
    q = torch.randn(2, 6, 4)
    with pytest.raises(ValueError, match=r"SinkhornAttention: the mask varies over queries"):
        part(q, q, q, mask=ak.masks.causal(6))
    with pytest.raises(ValueError, match=r"SinkhornAttention.*accepts_bias"):
        part(q, q, q, bias=torch.zeros(6, 6))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SinkhornAttention(4, temperature=0.0)
    with pytest.raises(ValueError, match="sortcut"):
        SinkhornAttention(4, sortcut=0)
