"""Mixture of Block Attention against a float64 loop from the MoBA paper's definition (sec. 2.2:
the gate q · mean(K_block); the top k − 1 earlier blocks and the query's own; softmax over the
chosen keys, causal), a dense-masked reference built by its own vectorised selection, full
causal attention when k covers every block, padding equal to truncation, cached decoding equal
to the causal pass, and a generated task it learns by routing to the right block."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.kv_cache import LayerCache
from attnkit.sparse_trainable import MixtureOfBlockAttention


def _inputs(b=2, h=2, m=13, n=13, d=4, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, m, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, h, n, dv, generator=g, dtype=torch.float64)
    return q, k, v


def _loop(q, k, v, block, top_k, q_offset=0, keep=None, bias=None):
    """Per item, head and query t at p = q_offset + t: the gate s_b = q·mean of block b's keys
    the query may attend over the earlier blocks holding one, the top k − 1 of them by s (ties:
    the earlier block) and the own block ⌊p/B⌋; softmax of q·k/√d (+ bias) over the chosen
    keys j ≤ p it may attend. Returns the context and the chosen
    (query, key) pairs."""
    bsz, heads, m, d = q.shape
    n = k.shape[-2]
    out = torch.zeros(bsz, heads, m, v.shape[-1], dtype=q.dtype)
    read = torch.zeros(bsz, heads, m, n, dtype=torch.bool)
    for b in range(bsz):
        for h in range(heads):
            for t in range(m):
                p = q_offset + t
                own = p // block

                def may(j, b=b, h=h, t=t, p=p):
                    return j <= p and (keep is None or bool(keep[b, h, t, j]))

                gates = []
                for blk in range(own):
                    keys = [j for j in range(blk * block, min((blk + 1) * block, n)) if may(j)]
                    if keys:
                        mean = k[b, h, keys].mean(0)
                        gates.append((-float((q[b, h, t] @ mean).detach()), blk))
                chosen = [blk for _, blk in sorted(gates)[: top_k - 1]] + [own]
                keys = sorted(
                    j for blk in chosen for j in range(blk * block, (blk + 1) * block)
                    if j < n and may(j)
                )  # fmt: skip
                if not keys:
                    continue
                e = k[b, h, keys] @ q[b, h, t] / math.sqrt(d)
                if bias is not None:
                    e = e + bias[b, h, t, keys]
                out[b, h, t] = torch.softmax(e, 0) @ v[b, h, keys]
                read[b, h, t, keys] = True
    return out, read


CASES = {
    "blocks of 3, k=2": dict(block=3, top_k=2),
    "blocks of 3, k=3": dict(block=3, top_k=3),
    "blocks of 1 (token routing)": dict(block=1, top_k=4),
    "queries after 7 cached keys": dict(block=4, top_k=2, q_offset=7, m=5, n=12),
    "key padding": dict(block=3, top_k=2, pad=True),
    "bias": dict(block=2, top_k=3, bias=True),
    "ragged last block": dict(block=5, top_k=2, m=12, n=12),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_the_loop_from_the_equations(case):
    c = dict(CASES[case])
    block, top_k, q_offset = c.pop("block"), c.pop("top_k"), c.pop("q_offset", 0)
    pad, with_bias = c.pop("pad", False), c.pop("bias", False)
    q, k, v = (x.requires_grad_() for x in _inputs(**c))
    n, m = k.shape[-2], q.shape[-2]
    mask = keep = bias = None
    if pad:  # item 1: the last 4 keys are padding, every query row reads the same keys
        mask = ak.masks.from_lengths(torch.tensor([n, n - 4]), n)[:, None]  # (2, 1, 1, N)
        keep = mask.expand(2, 2, m, n)
    if with_bias:
        bias = torch.randn(2, 2, m, n, dtype=torch.float64, requires_grad=True)
    part = MixtureOfBlockAttention(block, top_k)
    out = part(q, k, v, mask=mask, bias=bias, q_offset=q_offset, need_weights=True)
    ref, read = _loop(q, k, v, block, top_k, q_offset, keep, bias)
    print(f"MoBA vs loop ({case}): {float((out.context - ref).detach().abs().max()):.1e}")
    torch.testing.assert_close(out.context, ref, atol=1e-12, rtol=1e-10)
    assert torch.equal(out.weights > 0, read)  # exactly the chosen keys carry weight
    torch.testing.assert_close(out.weights.sum(-1), read.any(-1).double())
    r = torch.randn(
        out.context.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    leaves = (q, k, v) if bias is None else (q, k, v, bias)
    got = torch.autograd.grad((out.context * r).sum(), leaves)
    want = torch.autograd.grad((ref * r).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def _block_mask(q, k, block, top_k):
    """The (…, M, N) keys MoBA reads, by tensors: block means, gates, a descending stable sort
    of the earlier blocks, the first k − 1 and the own block, then causality."""
    m, n = q.shape[-2], k.shape[-2]
    nb = -(-n // block)
    key_block = torch.arange(n) // block
    means = torch.stack([k[..., key_block == b, :].mean(-2) for b in range(nb)], -2)
    gate = q @ means.transpose(-1, -2)  # (…, M, nb)
    own = torch.arange(m) // block
    earlier = torch.arange(nb) < own[:, None]
    order = torch.sort(gate.masked_fill(~earlier, -math.inf), dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order.indices).scatter_(
        -1, order.indices, torch.arange(nb).expand_as(order.indices)
    )
    chosen = (earlier & (rank < top_k - 1)) | (torch.arange(nb) == own[:, None])
    return chosen[..., key_block] & ak.masks.causal(m, n)


@pytest.mark.parametrize("block, top_k", [(4, 2), (3, 3), (8, 2)])
def test_equals_dense_attention_under_its_block_mask(block, top_k):
    q, k, v = _inputs(m=32, n=32, dv=4, seed=2)
    out = MixtureOfBlockAttention(block, top_k)(q, k, v, need_weights=True)
    mask = _block_mask(q, k, block, top_k)
    dense = ak.attention(q, k, v, mask=mask, kernel="dense", need_weights=True)
    torch.testing.assert_close(out.context, dense.context, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out.weights, dense.weights, atol=1e-12, rtol=1e-10)
    assert int(mask[..., -1, :].sum(-1).max()) <= top_k * block  # sparse: k blocks at most


@pytest.mark.parametrize("top_k", [5, 50])
def test_top_k_covering_every_block_is_full_causal_attention(top_k):
    q, k, v = _inputs(m=15, n=15, seed=3)
    pad = ak.masks.from_lengths(torch.tensor([15, 10]), 15)[:, None]  # (B, 1, 1, N)
    full = ak.attention(q, k, v, mask=pad & ak.masks.causal(15), kernel="dense").context
    out = MixtureOfBlockAttention(3, top_k)(q, k, v, mask=pad).context  # 5 blocks
    torch.testing.assert_close(out[0], full[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out[1, :, :10], full[1, :, :10], atol=1e-12, rtol=1e-10)


def test_padding_equals_truncation_in_multihead_attention():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, attention=MixtureOfBlockAttention(3, 2)).double().eval()
    lengths = [14, 9, 5]
    x = torch.randn(3, 14, 8, dtype=torch.float64)
    mask = ak.masks.from_lengths(torch.tensor(lengths), 14)[:, None]  # (B, 1, N)
    batched = mha(x, mask=mask).context
    for i, length in enumerate(lengths):
        alone = mha(x[i : i + 1, :length]).context
        torch.testing.assert_close(batched[i, :length], alone[0], atol=1e-12, rtol=1e-10)


def test_decoding_with_a_cache_equals_the_causal_pass():
    torch.manual_seed(0)
    part = MixtureOfBlockAttention(3, 2)
    mha = ak.MultiHeadAttention(8, 2, attention=part, position="rope").double().eval()
    x = torch.randn(2, 13, 8, dtype=torch.float64)
    full = mha(x, mask=ak.masks.causal(13)).context
    cache = LayerCache()
    first = mha(x[:, :5], mask=ak.masks.causal(5), cache=cache).context  # a prompt, then steps
    steps = [mha(x[:, t : t + 1], cache=cache).context for t in range(5, 13)]
    torch.testing.assert_close(torch.cat([first, *steps], 1), full, atol=1e-12, rtol=1e-10)


def test_later_tokens_reach_no_earlier_query():
    """Causal by construction: no gradient from tokens after a query, and NaN or inf planted in
    them (inside the query's own block too) reaches no earlier output or gradient."""
    q, k, v = (x.requires_grad_() for x in _inputs(m=10, n=10, seed=4))
    part = MixtureOfBlockAttention(4, 2)
    out = part(q, k, v).context
    out[..., 5, :].sum().backward()
    assert not q.grad[..., 6:, :].any() and not k.grad[..., 6:, :].any()
    assert not v.grad[..., 6:, :].any() and k.grad[..., :6, :].abs().sum() > 0
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[..., 6:, :], v2[..., 6:, :] = float("nan"), float("inf")
    with torch.no_grad():  # every query: the earlier rows are untouched
        planted = part(q.detach(), k2, v2).context
    torch.testing.assert_close(planted[..., :6, :], out[..., :6, :].detach())
    # the first 6 queries over all 10 keys: output and gradients as without the planted tokens
    q6, k2, v2 = (x.detach().requires_grad_() for x in (q[..., :6, :], k2, v2))
    first = part(q6, k2, v2).context
    torch.testing.assert_close(first, out[..., :6, :].detach())
    first.sum().backward()
    clean = [x.detach().requires_grad_() for x in (q[..., :6, :], k[..., :6, :], v[..., :6, :])]
    part(*clean).context.sum().backward()
    for got, want in zip((q6, k2, v2), clean, strict=True):
        assert torch.isfinite(got.grad).all()
        torch.testing.assert_close(got.grad[..., :6, :], want.grad)


N, VOCAB, EMBED = 16, 8, 32


def _flag_batch(size, g):
    """Tokens (size, N), one earlier position flagged 1 and the last flagged 2 (the query), and
    the flagged token (the answer; chance 1/8)."""
    x = torch.randint(0, VOCAB, (size, N), generator=g)
    pos = torch.randint(0, N - 1, (size,), generator=g)
    flag = torch.zeros(size, N, dtype=torch.long)
    flag[torch.arange(size), pos] = 1
    flag[:, -1] = 2
    return x, flag, x[torch.arange(size), pos], pos


def test_learns_flag_retrieval_by_routing_to_the_flagged_block():
    """One MoBA layer (blocks of 4, k = 2: the last query reads its own block and one of three
    earlier ones) over token + flag embeddings learns to fetch the flagged token: the gate
    q·mean(K) — not trained itself — routes to the flagged block through the q and k that the
    attention trains. With k = 1 (its own block only) the same model cannot."""

    def train(top_k, steps=80):
        torch.manual_seed(0)
        tok, flag_emb = nn.Embedding(VOCAB, EMBED), nn.Embedding(3, EMBED)
        mha = ak.MultiHeadAttention(EMBED, 2, attention=MixtureOfBlockAttention(4, top_k))
        out = nn.Linear(EMBED, VOCAB)
        model = nn.ModuleList([tok, flag_emb, mha, out])

        def run(x, flag, need_weights=False):
            o = mha(tok(x) + flag_emb(flag), need_weights=need_weights)
            return out(o.context[:, -1]), o.weights

        opt = torch.optim.Adam(model.parameters(), 3e-2)
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, flag, y, _ = _flag_batch(64, g)
            loss = nn.functional.cross_entropy(run(x, flag)[0], y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        x, flag, y, pos = _flag_batch(500, torch.Generator().manual_seed(99))
        with torch.no_grad():
            logits, w = run(x, flag, need_weights=True)
        accuracy = float((logits.argmax(-1) == y).float().mean())
        read = w[:, :, -1].gather(-1, pos[:, None, None].expand(-1, 2, 1)) > 0  # (B, H, 1)
        earlier = pos < 12  # the flag lies outside the query's own block
        routed = float(read.any(1)[earlier].float().mean())
        return accuracy, routed

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small batches: one thread is faster
    try:
        accuracy, routed = train(2)
        own_only, _ = train(1, steps=40)
    finally:
        torch.set_num_threads(threads)
    print(f"MoBA k=2: accuracy {accuracy:.3f}, flagged block chosen {routed:.3f}")
    assert accuracy > 0.8 and routed > 0.8
    print(f"MoBA k=1: accuracy {own_only:.3f}")
    assert own_only < 0.45


def test_for_heads_sizes_the_blocks_and_refusals_name_the_argument():
    part = MixtureOfBlockAttention.for_heads(embed_dim=8, num_heads=2, head_dim=4, max_len=64)
    assert (part.block_size, part.top_k) == (8, 3)
    long = MixtureOfBlockAttention.for_heads(embed_dim=8, num_heads=2, head_dim=4, max_len=8192)
    assert long.block_size == 512
    given = MixtureOfBlockAttention.for_heads(
        embed_dim=8, num_heads=2, head_dim=4, max_len=64, block_size=5, top_k=4
    )
    assert (given.block_size, given.top_k) == (5, 4)
    assert "moba" in ak.mechanisms.available()
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        MixtureOfBlockAttention(0)
    with pytest.raises(ValueError, match="top_k must be a positive int, got -1"):
        MixtureOfBlockAttention(4, -1)
    q = torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match="q_offset"):
        MixtureOfBlockAttention(2)(q, q, q, q_offset=-2)


def test_keys_stated_finite_are_not_scanned_and_unstated_nan_values_reach_only_their_rows():
    """MoBA reads later values of its blocks with weight 0 (causal by construction): unstated, a
    NaN value is looked for and leaves the rows that do not attend it exact; stated finite, the
    keys are not looked at, and the result on finite keys is the same."""
    from unittest import mock

    from attnkit.sparse_trainable import moba

    q, k, v = _inputs(seed=3)
    part = MixtureOfBlockAttention(block_size=3, top_k=2)
    want, _ = _loop(q, k, v, 3, 2)
    with mock.patch.object(moba, "all_finite", wraps=moba.all_finite) as scans:
        stated = part(q, k, v, finite=True).context
        assert scans.call_count == 0
        unstated = part(q, k, v).context
        assert scans.call_count == 1
    torch.testing.assert_close(stated, want)
    torch.testing.assert_close(unstated, want)
    _, read = _loop(q, k, v, 3, 2)
    v = v.clone()
    v[:, :, 10] = float("nan")  # read with weight 0 in the tiles of the queries before it
    out = part(q, k, v).context
    spared = ~read[..., 10]  # (B, H, M): the rows that do not attend key 10
    assert spared.sum() > 10
    torch.testing.assert_close(out[spared], want[spared])
