"""Routing attention (Roy et al. 2021): nearest-centroid routing by distance, attention within
the cluster, and the centroids' moving average, each checked against its definition."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.efficient import RoutingAttention

D = torch.float64


def _inputs(seed=0, m=9, n=9):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, length, 5, generator=g, dtype=D).requires_grad_() for length in (m, n, n)
    ]


def test_one_cluster_is_full_attention():
    q, k, v = _inputs()
    part = RoutingAttention(5, n_clusters=1).to(D).eval()
    mask = ak.masks.causal(9)
    out = part(q, k, v, mask=mask, need_weights=True)
    full = ak.attention(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(out.context, full.context, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out.weights, full.weights, atol=1e-12, rtol=1e-10)


def test_attends_within_the_nearest_centroid_cluster():
    q, k, v = _inputs(1, m=8, n=10)
    part = RoutingAttention(5, n_clusters=3, seed=2).to(D).eval()
    out = part(q, k, v, need_weights=True)
    mu = part.centroids

    def cluster(x):  # nearest centroid by Euclidean distance of the unit vector
        x = x.detach()
        return min(range(3), key=lambda c: float((x / x.norm() - mu[c]).norm()))

    for b in range(2):
        for i in range(8):
            js = [j for j in range(10) if cluster(k[b, j]) == cluster(q[b, i])]
            if not js:
                assert (out.weights[b, i] == 0).all() and (out.context[b, i] == 0).all()
                continue
            e = torch.stack([q[b, i] @ k[b, j] / math.sqrt(5) for j in js])
            a = torch.softmax(e, 0)
            ref = sum(a[t] * v[b, j] for t, j in enumerate(js))
            torch.testing.assert_close(out.context[b, i], ref, atol=1e-12, rtol=1e-10)
            assert out.weights[b, i].count_nonzero() == len(js)
    assert 0 < (out.weights > 0).float().mean() < 0.9  # routing made it sparse


def test_centroids_follow_the_moving_average_in_training_only():
    q, k, v = _inputs(2)
    part = RoutingAttention(5, n_clusters=3, decay=0.8).to(D)
    mask = ak.masks.from_lengths(torch.tensor([9, 6]), 9)
    before = part.centroids.clone()
    part.eval()(q, k, v, mask=mask)
    assert torch.equal(part.centroids, before)
    part.train()(q, k, v, mask=mask)
    unit_q = (q / q.norm(dim=-1, keepdim=True)).detach()
    unit_k = (k / k.norm(dim=-1, keepdim=True)).detach()
    routed = [(x, int((x @ before.T).argmax())) for x in unit_q.reshape(-1, 5)]
    routed += [
        (unit_k[b, j], int((unit_k[b, j] @ before.T).argmax()))
        for b in range(2)
        for j in range(9)
        if bool(mask[b, 0, j])
    ]
    for c in range(3):
        xs = [x for x, cc in routed if cc == c]
        if not xs:
            torch.testing.assert_close(part.centroids[c], before[c])
            continue
        moved = 0.8 * before[c] + 0.2 * torch.stack(xs).mean(0)
        torch.testing.assert_close(part.centroids[c], moved / moved.norm())


def test_online_k_means_finds_the_clusters():
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(3, 8, generator=g, dtype=D), dim=-1)
    part = RoutingAttention(8, n_clusters=3, decay=0.9, seed=3).to(D).train()
    for _ in range(60):
        x = 4 * centres[torch.randint(0, 3, (4, 16), generator=g)]
        x = x + 0.3 * torch.randn(4, 16, 8, generator=g, dtype=D)
        part(x, x, x)
    cos = centres @ part.centroids.T  # each true centre has a centroid pointing at it
    assert (cos.max(-1).values > 0.97).all(), cos


def test_in_multi_head_attention_and_errors():
    mha = ak.MultiHeadAttention(8, 2, attention=RoutingAttention(4, 2)).eval()
    x = torch.randn(2, 6, 8)
    with ak.evaluation.capture(mha) as records:
        out = mha(x, need_weights=True)
    assert out.weights.shape == (2, 2, 6, 6) and records
    with pytest.raises(ValueError, match="decay"):
        RoutingAttention(4, decay=1.0)
    with pytest.raises(ValueError, match="n_clusters"):
        RoutingAttention(4, n_clusters=0)
    with pytest.raises(ValueError, match=r"RoutingAttention\(head_dim=4\) got q with 3 features"):
        RoutingAttention(4)(*(torch.randn(2, 5, 3) for _ in range(3)))
    with pytest.raises(ValueError, match="mask"):
        RoutingAttention(4)(x[..., :4], x[..., :4], x, mask=torch.ones(2, 5, 6, dtype=torch.bool))


def _balanced_loop(q, k, v, mu, mask=None):
    """Balanced routing by its definition (Roy et al.): cluster c takes the ⌈n/C⌉ real queries
    and keys with the largest q̂·μ_c (k̂·μ_c); each query's context is the mean over the clusters
    holding it (and giving it a key) of softmax attention inside the cluster."""
    b_size, m, d = q.shape
    n, c = k.shape[1], mu.shape[0]
    context = torch.zeros(b_size, m, v.shape[-1], dtype=q.dtype)
    weights = torch.zeros(b_size, m, n, dtype=q.dtype)
    for b in range(b_size):
        ok = [[mask is None or bool(mask[b, i, j]) for j in range(n)] for i in range(m)]
        real_q = [i for i in range(m) if any(ok[i])]
        real_k = [j for j in range(n) if any(ok[i][j] for i in range(m))]
        parts = {i: [] for i in range(m)}
        for cl in range(c):

            def near(x, cl=cl):
                return float((x / x.norm()) @ mu[cl])

            qs = sorted(real_q, key=lambda i: -near(q[b, i].detach()))[: -(-len(real_q) // c)]
            ks = sorted(real_k, key=lambda j: -near(k[b, j].detach()))[: -(-len(real_k) // c)]
            for i in qs:
                js = [j for j in ks if ok[i][j]]
                if not js:
                    continue
                e = torch.stack([q[b, i] @ k[b, j] / math.sqrt(d) for j in js])
                a = torch.softmax(e, 0)
                parts[i].append({j: a[t] for t, j in enumerate(js)})
        for i, found in parts.items():
            for row in found:
                for j, a in row.items():
                    weights[b, i, j] = weights[b, i, j] + a / len(found)
                    context[b, i] = context[b, i] + a / len(found) * v[b, j]
    return context, weights


@pytest.mark.parametrize("masked", [False, True])
def test_balanced_routing_is_top_k_per_cluster_and_the_mean_over_clusters(masked):
    q, k, v = _inputs(3, m=10, n=11)
    part = RoutingAttention(5, n_clusters=3, seed=1, balanced=True).to(D).eval()
    mask = None
    if masked:  # key padding and a causal-like pattern
        mask = ak.masks.from_lengths(torch.tensor([11, 8]), 11) & (
            torch.arange(10)[:, None] + 2 >= torch.arange(11)
        )
    out = part(q, k, v, mask=mask, need_weights=True)
    ref, ref_w = _balanced_loop(q, k, v, part.centroids, mask)
    torch.testing.assert_close(out.context, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(out.weights, ref_w, atol=1e-12, rtol=1e-10)
    r = torch.randn(ref.shape, dtype=D)
    fast = torch.autograd.grad((out.context * r).sum(), (q, k, v))
    slow = torch.autograd.grad((ref * r).sum(), (q, k, v))
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_balanced_clusters_have_equal_sizes_and_one_cluster_is_full_attention():
    q, k, v = _inputs(4, m=12, n=12)
    one = RoutingAttention(5, n_clusters=1, balanced=True).to(D).eval()
    full = ak.attention(q, k, v, need_weights=True)
    out = one(q, k, v, need_weights=True)
    torch.testing.assert_close(out.context, full.context, atol=1e-12, rtol=1e-10)
    part = RoutingAttention(5, n_clusters=4, balanced=True).to(D).eval()
    w = part(q, k, v, need_weights=True).weights
    # 4 clusters of 3 queries × 3 keys: at most 4·9 pairs are attended per item
    assert ((w > 0).sum((-1, -2)) <= 36).all()
    assert part.decodes_with_cache is False and one.balanced
    assert RoutingAttention(5).decodes_with_cache is True


def test_balanced_routing_learns_flag_retrieval():
    from tests.flag_task import flag_retrieval_accuracy

    accuracy = flag_retrieval_accuracy(
        RoutingAttention(16, n_clusters=2, decay=0.9, balanced=True), steps=100
    )
    assert accuracy > 0.9, accuracy  # chance is 1/8
