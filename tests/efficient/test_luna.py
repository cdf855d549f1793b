"""Luna: pack and unpack against two dense multi-head attentions written from the paper's
equations, masked inputs == removed inputs on the pack step, P' chaining, O(l·N) weights, and
causal masks refused."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.efficient.luna import LunaAttention

D, H, L = 8, 2, 3


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _attn(mha, query, context, keep=None):
    """Attn(Q, C): multi-head softmax attention (Vaswani eq. 1 per head, heads concatenated and
    projected), a loop over heads and query rows; ``keep`` (B, N) marks the real keys."""
    e, d = mha.embed_dim, mha.head_dim
    wq, wk, wv = mha.in_proj_weight.split(e)
    bq, bk, bv = mha.in_proj_bias.split(e)
    out = torch.zeros(query.shape[0], query.shape[1], e, dtype=query.dtype)
    for b in range(query.shape[0]):
        heads = []
        for h in range(mha.num_heads):
            c = slice(h * d, (h + 1) * d)
            rows = []
            for i in range(query.shape[1]):
                q = query[b, i] @ wq[c].T + bq[c]
                s = torch.stack([q @ (k @ wk[c].T + bk[c]) / d**0.5 for k in context[b]])
                if keep is not None:
                    s = s.masked_fill(~keep[b], float("-inf"))
                a = torch.softmax(s, 0)
                rows.append(sum(a[j] * (context[b, j] @ wv[c].T + bv[c]) for j in range(len(a))))
            heads.append(torch.stack(rows))
        out[b] = mha.out_proj(torch.cat(heads, -1))
    return out


def test_pack_then_unpack_match_dense_attention():
    torch.manual_seed(0)
    luna = LunaAttention(D, H, L).double()
    x = _x(2, 6, D, seed=1)
    keep = torch.tensor([[True] * 6, [True, True, False, True, False, True]])
    out = luna(x, mask=keep[:, None], need_weights=True)
    p = luna.p.expand(2, -1, -1)
    packed = _attn(luna.pack, p, x, keep)  # P' = Attn(P, X)
    torch.testing.assert_close(out.packed, packed)
    y = _attn(luna.unpack, x, packed)  # Y = Attn(X, P')
    torch.testing.assert_close(out.output[keep], y[keep])  # padded inputs' rows are padding
    assert out.pack_weights.shape == (2, H, L, 6) and out.unpack_weights.shape == (2, H, 6, L)
    assert (out.unpack_weights.transpose(1, 2)[~keep] == 0).all()


def test_the_packed_sequence_chains_to_the_next_layer():
    torch.manual_seed(0)
    first, second = LunaAttention(D, H, L).double(), LunaAttention(D, H, L).double()
    x = _x(2, 5, D, seed=2)
    out1 = first(x)
    out2 = second(out1.output, out1.packed)
    torch.testing.assert_close(out2.packed, _attn(second.pack, out1.packed, out1.output))
    torch.testing.assert_close(out2.output, _attn(second.unpack, out1.output, out2.packed))


def test_masking_an_input_removes_it():
    torch.manual_seed(0)
    luna = LunaAttention(D, H, L).double()
    x = _x(1, 7, D, seed=3)
    keep = torch.tensor([True, False, True, True, False, True, False])
    masked = luna(x, mask=keep[None, None])
    removed = luna(x[:, keep])
    torch.testing.assert_close(masked.packed, removed.packed)
    torch.testing.assert_close(masked.output[:, keep], removed.output)


def test_weights_grow_linearly_with_n():
    """Only (l × N) and (N × l) weights exist: no N × N tensor, for any N."""
    luna = LunaAttention(D, H, L).double()
    for n in (4, 64, 512):
        out = luna(_x(1, n, D), need_weights=True)
        assert out.pack_weights.shape == (1, H, L, n)
        assert out.unpack_weights.shape == (1, H, n, L)
        assert out.packed.shape == (1, L, D)


def test_causal_and_bad_inputs_are_refused():
    luna = LunaAttention(D, H, L).double()
    x = _x(2, 5, D)
    with pytest.raises(ValueError, match="causal"):
        luna(x, mask=ak.masks.causal(5))
    with pytest.raises(ValueError, match=r"p must be \(B, l, d\)"):
        luna(x, _x(2, 4, D))
    with pytest.raises(ValueError, match=r"x must be \(B, N, 8\)"):
        luna(_x(2, 5, 4))


def test_another_alignment_plugs_in():
    luna = LunaAttention(D, H, L, align="sparsemax").double()
    out = luna(_x(2, 6, D, seed=4), need_weights=True)
    assert isinstance(luna.unpack.align, ak.alignments.Sparsemax)
    sums = out.pack_weights.sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))
