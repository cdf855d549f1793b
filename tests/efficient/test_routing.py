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
    with pytest.raises(ValueError, match=r"RoutingAttention\(d=4\) got q with 3 features"):
        RoutingAttention(4)(*(torch.randn(2, 5, 3) for _ in range(3)))
    with pytest.raises(ValueError, match="mask"):
        RoutingAttention(4)(x[..., :4], x[..., :4], x, mask=torch.ones(2, 5, 6, dtype=torch.bool))
