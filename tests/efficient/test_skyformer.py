"""Skyformer (Chen et al. 2021): Nyström on the kernel matrix of [Q; K]; with every point of
[Q; K] a landmark it is the dense Gaussian-kernel attention κ(Q, K) V (written out by loops
below); with fewer it is κ(Q, L) κ(L, L)⁺ κ(L, K) V on segment means of [Q; K]."""

from __future__ import annotations

import math

import pytest
import torch
from flag_task import flag_retrieval_accuracy

import attnkit as ak
from attnkit.efficient import Skyformer

D = torch.float64


def _qkv(seed=0, lead=(2,), m=6, n=6, d=4, dv=3):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*lead, m, d, generator=g, dtype=D),
        torch.randn(*lead, n, d, generator=g, dtype=D),
        torch.randn(*lead, n, dv, generator=g, dtype=D),
    )


def gaussian(x, y):
    """κ(x_i, y_j) = exp(−‖x_i − y_j‖² / (2√d)) entry by entry (Skyformer)."""
    d = x.shape[-1]
    out = torch.empty(len(x), len(y), dtype=D)
    for i in range(len(x)):
        for j in range(len(y)):
            out[i, j] = math.exp(-float(((x[i] - y[j]) ** 2).sum()) / (2 * math.sqrt(d)))
    return out


def _segments(x, m):
    return torch.stack([x[i * len(x) // m : (i + 1) * len(x) // m].mean(0) for i in range(m)])


def test_every_point_a_landmark_is_the_dense_gaussian_kernel_attention():
    q, k, v = _qkv(5, m=4, n=5)
    out = Skyformer(9, iterations=40)(q, k, v, need_weights=True)
    for b in range(2):
        c = gaussian(q[b], k[b])
        torch.testing.assert_close(out.context[b], c @ v[b])
        torch.testing.assert_close(out.weights[b], c)


def test_fewer_landmarks_follow_the_papers_nystrom_form():
    q, k, v = _qkv(6, lead=(1,), m=6, n=10)
    out = Skyformer(4, iterations=40)(q, k, v)
    points = _segments(torch.cat((q[0], k[0])), 4)
    ref = gaussian(q[0], points) @ torch.linalg.pinv(gaussian(points, points))
    torch.testing.assert_close(out.context[0], ref @ gaussian(points, k[0]) @ v[0])


def test_padding_leaves_padded_queries_and_keys_out_of_the_landmarks():
    q, k, v = _qkv(7, m=6, n=6)
    part = Skyformer(3, iterations=12)
    keep = ak.masks.from_lengths(torch.tensor([6, 4]), 6)[:, 0]
    out = part(q, k, v, mask=keep[:, :, None] & keep[:, None, :])
    assert (out.context[1, 4:] == 0).all()
    alone = part(q[1:, :4], k[1:, :4], v[1:, :4]).context
    torch.testing.assert_close(out.context[1:, :4], alone, atol=1e-12, rtol=1e-10)


def test_refuses_causal_masks_and_bias():
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="Skyformer: the mask varies over queries"):
        Skyformer(3)(q, k, v, mask=ak.masks.causal(6))
    with pytest.raises(ValueError, match="bias"):
        Skyformer(3)(q, k, v, bias=torch.zeros(6, 6, dtype=D))


@pytest.mark.slow
def test_learns_flag_retrieval():
    """Inside MultiHeadAttention it learns the flag-retrieval task (chance 1/8)."""
    assert flag_retrieval_accuracy(Skyformer(8)) > 0.9
