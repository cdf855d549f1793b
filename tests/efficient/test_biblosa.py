"""Bi-BloSA (Shen et al. 2018) against a loop over tokens and blocks of the paper's four steps,
and DiSAN's directional masks against their definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.efficient import BiBloSA

D = torch.float64


def test_directional_masks():
    fw = ak.patterns.dense(ak.patterns.forward(), 5, 5)
    bw = ak.patterns.dense(ak.patterns.backward(), 5, 5)
    for i in range(5):
        for j in range(5):
            assert bool(fw[i, j]) == (j < i) and bool(bw[i, j]) == (j > i)
    # composed with the block-sparse kernel: equals the dense masked attention
    q, k, v = (torch.randn(1, 40, 4, dtype=D) for _ in range(3))
    bm = ak.patterns.block_mask(ak.patterns.forward(), 40, block_q=16, block_k=16)
    dense = ak.attention(q, k, v, mask=ak.patterns.dense(ak.patterns.forward(), 40, 40))
    torch.testing.assert_close(ak.attention(q, k, v, block_mask=bm).context, dense.context)


def _attend(score, q, keys, values):
    if not keys:
        return torch.zeros_like(values[0]) if values else None
    e = torch.stack(
        [score(None if q is None else q[None, None], kk[None, None])[0, 0, 0] for kk in keys]
    )
    a = torch.softmax(e, 0)
    return sum(a[t] * values[t] for t in range(len(keys)))


def _direction_reference(part, x, n, r, before):
    d = x.shape[-1]
    blocks = [list(range(s, min(s + r, n))) for s in range(0, n, r)]
    h = torch.zeros(n, d, dtype=D)
    for blk in blocks:
        for i in blk:
            js = [j for j in blk if before(j, i)]
            if js:
                h[i] = _attend(part.intra.score, x[i], [x[j] for j in js], [x[j] for j in js])
    v = torch.stack(
        [
            _attend(part.summary.score, None, [h[j] for j in blk], [h[j] for j in blk])
            for blk in blocks
        ]
    )
    o = torch.zeros_like(v)
    for a in range(len(blocks)):
        cs = [c for c in range(len(blocks)) if before(c, a)]
        if cs:
            o[a] = _attend(part.inter.score, v[a], [v[c] for c in cs], [v[c] for c in cs])
    g = torch.sigmoid(part.gate_o(o) + part.gate_v(v))
    e = g * o + (1 - g) * v
    out = torch.zeros(n, d, dtype=D)
    for t, blk in enumerate(blocks):
        for i in blk:
            cat = torch.cat([x[i], h[i], e[t]])
            f = torch.sigmoid(part.fuse_gate(cat))
            out[i] = f * F.elu(part.fuse(cat)) + (1 - f) * x[i]
    return out


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_equals_the_loop_of_the_paper_steps(block_size):
    torch.manual_seed(block_size)
    model = BiBloSA(4, block_size).to(D)
    x = torch.randn(2, 10, 4, dtype=D)
    lengths = torch.tensor([10, 7])
    out = model(x, mask=ak.masks.from_lengths(lengths, 10)).output
    for b in range(2):
        n = int(lengths[b])
        fw = _direction_reference(model.forward_direction, x[b], n, block_size, lambda j, i: j < i)
        bw = _direction_reference(model.backward_direction, x[b], n, block_size, lambda j, i: j > i)
        torch.testing.assert_close(out[b, :n], torch.cat([fw, bw], -1))


def test_memory_is_blocks_not_pairs():
    model = BiBloSA(4, 5)
    out = model(torch.randn(2, 50, 4), need_weights=True)
    shapes = {k: tuple(w.shape) for k, w in out.named_weights().items()}
    assert shapes["forward.intra"] == (2, 10, 5, 5)  # m = 10 blocks of r = 5: 250 pairs
    assert shapes["forward.inter"] == (2, 10, 10)  # and 100 block pairs, not 50² = 2500
    assert shapes["backward.summary"] == (2, 10, 1, 5)
    assert (out.named_weights()["forward.intra"].triu() == 0).all()  # strictly earlier
    assert (out.named_weights()["backward.inter"].tril() == 0).all()  # strictly later


def test_bad_arguments_and_masks_it_cannot_honour():
    model = BiBloSA(4, 3)
    with pytest.raises(ValueError, match="padding mask"):
        model(torch.randn(2, 6, 4), mask=ak.masks.causal(6))
    with pytest.raises(ValueError, match=r"needs x \(B, N, 4\)"):
        model(torch.randn(2, 6, 5))
    with pytest.raises(ValueError, match="block_size"):
        BiBloSA(4, 0)
