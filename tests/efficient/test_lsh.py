"""Reformer LSH attention against a loop written from the paper's definitions (Kitaev et al.
2020, Sec. 2): buckets by argmax([xR; −xR]), per round the set P_i^(r) of same-bucket keys in the
query's chunk or the chunk before after sorting by (bucket, position), and softmax over the union
of the rounds."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_same_forward_backward

import attnkit as ak
from attnkit.efficient import LSHAttention

D = torch.float64


def _reference(part, q, k, v, mask=None, shared=False):
    """One batch item at a time, one query at a time, straight from the definitions."""
    if shared:
        k = q / q.norm(dim=-1, keepdim=True)
    z, m, d = q.shape
    n = k.shape[1]
    c = part.chunk_size
    out = torch.zeros(z, m, v.shape[-1], dtype=q.dtype)
    weights = torch.zeros(z, m, n, dtype=q.dtype)
    for b in range(z):
        allowed = [
            [mask is None or bool(mask[b, min(i, mask.shape[1] - 1), j]) for j in range(n)]
            for i in range(m)
        ]
        key_valid = [any(allowed[i][j] for i in range(m)) for j in range(n)]
        in_union = [[False] * n for _ in range(m)]
        for r in range(part.n_rounds):
            rot = part.rotations[r]

            def bucket(x, rot=rot):
                if part.n_buckets == 1:
                    return 0
                p = x @ rot
                return int(torch.cat([p, -p]).argmax())

            query_valid = [any(allowed[i]) for i in range(m)]
            hq = [bucket(q[b, i]) if query_valid[i] else part.n_buckets for i in range(m)]
            hk = [bucket(k[b, j]) if key_valid[j] else part.n_buckets for j in range(n)]
            q_rank = {i: rank for rank, i in enumerate(sorted(range(m), key=lambda i: (hq[i], i)))}
            k_rank = {j: rank for rank, j in enumerate(sorted(range(n), key=lambda j: (hk[j], j)))}
            for i in range(m):
                for j in range(n):
                    ci, cj = q_rank[i] // c, k_rank[j] // c
                    if hq[i] == hk[j] and cj in (ci, ci - 1) and ci < math.ceil(m / c):
                        in_union[i][j] = True
        for i in range(m):
            js = [j for j in range(n) if in_union[i][j] and allowed[i][j]]
            if not js:
                continue
            logits = torch.stack([q[b, i] @ k[b, j] / math.sqrt(d) for j in js])
            if shared:
                logits = logits - 1e5 * torch.tensor([float(j == i) for j in js], dtype=q.dtype)
            a = torch.softmax(logits, 0)
            for t, j in enumerate(js):
                weights[b, i, j] = a[t]
                out[b, i] = out[b, i] + a[t] * v[b, j]
    return out, weights


def _inputs(m=11, n=11, d=6, dv=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, length, size, generator=g, dtype=D).requires_grad_()
        for length, size in ((m, d), (n, d), (n, dv))
    ]


@pytest.mark.parametrize(
    "buckets, rounds, chunk",
    [(1, 1, 4), (2, 1, 3), (4, 3, 4), (4, 2, 5), (8, 4, 2)],
)
def test_equals_attention_over_the_union_of_the_rounds(buckets, rounds, chunk):
    q, k, v = _inputs()
    part = LSHAttention(6, buckets, rounds, chunk, seed=buckets + rounds).to(D).eval()
    ref_out, ref_w = _reference(part, q, k, v)
    out = part(q, k, v, need_weights=True)
    torch.testing.assert_close(out.weights, ref_w, atol=1e-12, rtol=1e-10)
    assert_same_forward_backward(lambda: part(q, k, v).context, lambda: ref_out, [q, k, v])


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("rounds", [1, 2, 3])
@pytest.mark.parametrize("m, n", [(24, 24), (22, 22), (16, 21), (21, 16)])
def test_unmasked_path_equals_the_general_one(shared, rounds, m, n):
    """Without mask, bias or weights the rounds run through one node each; the general path
    (taken when the weights are asked for) gives the same context and gradients, also when
    the chunks do not divide the queries (padded slots) and M ≠ N."""
    if shared and m != n:
        return
    q, k, v = _inputs(m=m, n=n, d=6, dv=3, seed=rounds)
    part = LSHAttention(6, 4, rounds, 4, seed=2).to(D).eval()
    key = None if shared else k
    assert_same_forward_backward(
        lambda: part(q, key, v).context,
        lambda: part(q, key, v, need_weights=True).context,
        [q, k, v],
        atol=1e-12,
        rtol=1e-10,
    )


def test_unmasked_path_second_derivatives_and_non_finite_values():
    q, k, v = _inputs(m=12, n=12, d=6, dv=3, seed=7)
    part = LSHAttention(6, 2, 2, 4, seed=3).to(D).eval()
    q, k, v = (x.detach()[:1].requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradgradcheck(lambda q, k, v: part(q, k, v).context, (q, k, v))
    # a NaN value: the rows that give it weight 0 stay finite, as on the general path
    bad = v.detach().clone()
    bad[0, 5] = torch.nan
    out = part(q, k, bad).context
    ref = part(q, k, bad, need_weights=True).context
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    torch.testing.assert_close(out.nan_to_num(0.0), ref.nan_to_num(0.0))


def test_shared_qk_excludes_self_unless_alone_and_padding_sorts_last():
    q, _, v = _inputs(m=9, n=9)
    mask = ak.masks.from_lengths(torch.tensor([9, 6]), 9)
    part = LSHAttention(6, 4, 3, 3, seed=5).to(D).eval()
    out = part(q, None, v, mask=mask, need_weights=True)
    ref_out, ref_w = _reference(part, q, None, v, mask=mask, shared=True)
    torch.testing.assert_close(out.weights, ref_w, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out.context, ref_out, atol=1e-12, rtol=1e-10)
    diag = out.weights.diagonal(dim1=-2, dim2=-1)
    alone = (out.weights - torch.diag_embed(diag)).sum(-1) == 0
    assert (diag[~alone] < 1e-30).all()  # only a query with no other key attends to itself
    assert (out.weights[1, :, 6:] == 0).all()


def test_any_mask_and_bias_on_the_pairs_and_padded_queries_sorted_last():
    q, k, v = _inputs(m=10, n=10)
    g = torch.Generator().manual_seed(3)
    pad = ak.masks.from_lengths(torch.tensor([10, 7]), 10)
    mask = pad & pad.transpose(-1, -2) & (torch.rand(2, 10, 10, generator=g) > 0.2)
    bias = torch.randn(2, 10, 10, generator=g, dtype=D)
    part = LSHAttention(6, 2, 2, 3, seed=1).to(D).eval()
    out = part(q, k, v, mask=mask, bias=bias, need_weights=True)
    assert (out.weights[~mask] == 0).all()
    # the reference with the bias folded into the logits: compare on a part without bias
    ref_out, ref_w = _reference(part, q, k, v, mask=mask)
    plain = part(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(plain.weights, ref_w, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(plain.context, ref_out, atol=1e-12, rtol=1e-10)
    # the bias changes the weights within the same support, as softmax(e + bias) on it
    support = plain.weights > 0
    assert torch.equal(out.weights > 0, support)
    e = torch.einsum("bid,bjd->bij", q, k) / math.sqrt(6) + bias
    expected = torch.softmax(e.masked_fill(~support, float("-inf")), -1).nan_to_num(0.0)
    torch.testing.assert_close(out.weights, expected, atol=1e-12, rtol=1e-10)


def test_one_bucket_and_one_chunk_is_full_attention():
    q, k, v = _inputs()
    part = LSHAttention(6, n_buckets=1, n_rounds=1, chunk_size=16).to(D).eval()
    mask = ak.masks.causal(11)
    full = ak.attention(q, k, v, mask=mask, need_weights=True)
    out = part(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(out.context, full.context, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out.weights, full.weights, atol=1e-12, rtol=1e-10)
    # shared QK: full attention with normalised keys and the diagonal excluded
    shared = part(q, None, v).context
    keys = q / q.norm(dim=-1, keepdim=True)
    ref = ak.attention(q, keys, v, mask=~torch.eye(11, dtype=torch.bool)).context
    torch.testing.assert_close(shared, ref, atol=1e-12, rtol=1e-10)


def test_approaches_full_attention_as_rounds_grow():
    """Clustered sequences (the case LSH is for): the error to full attention falls with the
    number of hash rounds (mean over seeds, shared QK, 64 positions, 8 buckets, chunks of 8)."""
    errors = {}
    for rounds in (1, 2, 4, 8):
        total = 0.0
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            centres = 3 * torch.randn(4, 16, generator=g, dtype=D)
            x = centres[torch.randint(0, 4, (1, 64), generator=g)] + torch.randn(
                1, 64, 16, generator=g, dtype=D
            )
            v = torch.randn(1, 64, 4, generator=g, dtype=D)
            keys = x / x.norm(dim=-1, keepdim=True)
            full = ak.attention(x, keys, v, mask=~torch.eye(64, dtype=torch.bool)).context
            part = LSHAttention(16, 8, rounds, 8, seed=seed).to(D).eval()
            total += (part(x, None, v).context - full).norm().item() / full.norm().item()
        errors[rounds] = total / 4
    assert errors[1] > errors[2] > errors[4] > errors[8]
    assert errors[8] < 0.5 * errors[1], errors


def test_fresh_rotations_in_training_and_fixed_ones_in_eval():
    q, k, v = _inputs()
    part = LSHAttention(6, 4, 1, 3).to(D)
    part.eval()
    assert torch.equal(part(q, k, v).context, part(q, k, v).context)
    part.train()
    torch.manual_seed(0)
    a = part(q, k, v, need_weights=True).weights
    b = part(q, k, v, need_weights=True).weights
    assert not torch.equal(a != 0, b != 0)


def test_in_multi_head_attention_with_capture():
    mha = ak.MultiHeadAttention(12, 2, attention=LSHAttention(6, 2, 2, 4)).eval()
    x = torch.randn(2, 10, 12)
    mask = ak.masks.from_lengths(torch.tensor([10, 7]), 10)
    with ak.evaluation.capture(mha) as records:
        out = mha(x, mask=mask, need_weights=True)
    assert out.context.shape == (2, 10, 12) and out.weights.shape == (2, 2, 10, 10)
    torch.testing.assert_close(records["attention"][0], out.weights)
    assert (out.weights[1, ..., 7:] == 0).all()
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 2, 10))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="n_buckets must be 1 or even"):
        LSHAttention(4, n_buckets=3)
    with pytest.raises(ValueError, match="chunk_size"):
        LSHAttention(4, chunk_size=0)
    part = LSHAttention(4)
    q = torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match=r"LSHAttention\(head_dim=4\) got q with 3 features"):
        part(torch.randn(2, 5, 3), torch.randn(2, 5, 3), torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="shared QK"):
        part(q, None, torch.randn(2, 6, 4))
    with pytest.raises(ValueError, match="mask"):
        part(q, q, q, mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask"):
        part(q, q, q, mask=torch.ones(5, 5))


def test_values_stated_finite_are_not_scanned_and_give_the_same_result():
    """finite=True (a caller whose activations are finite) skips the scans for NaN values,
    on the unmasked path and the general one; the result is the same."""
    q, k, v = _inputs(m=12, n=12, d=6, dv=3, seed=4)
    part = LSHAttention(6, 2, 2, 4, seed=1).to(D).eval()
    for kw in ({}, {"need_weights": True}):
        want = part(q, k, v, **kw).context
        got = part(q, k, v, finite=True, **kw).context
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
