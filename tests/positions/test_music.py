"""Music Transformer: the skewed relative logits equal the naive O(N²·d) ones (Huang et al. 3.4)."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.positions import MusicRelative, skew


def naive(scheme, q, k, q_offset=0, k_offset=0):
    """S^rel_hij = q_hi · E^r_h[clip(i − j)], by gathering an (H, M, N, d) tensor of embeddings
    (Shaw et al.'s formulation, which the skewing avoids), then / √d."""
    kk, (h, m, n) = scheme.max_distance, (q.shape[-3], q.shape[-2], k.shape[-2])
    r = torch.empty(h, m, n, q.shape[-1], dtype=q.dtype)
    for i in range(m):
        for j in range(n):
            dist = max(-kk, min(kk, (q_offset + i) - (k_offset + j)))
            r[:, i, j] = scheme.weight[:, dist + kk]
    return torch.einsum("...hmd,hmnd->...hmn", q, r) / math.sqrt(q.shape[-1])


@pytest.mark.parametrize(
    ("m", "n", "q_offset", "k_offset"), [(5, 5, 0, 0), (2, 6, 4, 0), (4, 3, 1, 7)]
)
def test_skewing_equals_the_naive_relative_logits(m, n, q_offset, k_offset):
    scheme = MusicRelative(4, 2, max_distance=3, dtype=torch.float64)
    q, k = (
        torch.randn(2, 2, m, 4, dtype=torch.float64),
        torch.randn(2, 2, n, 4, dtype=torch.float64),
    )
    out = scheme(q, k, q_offset=q_offset, k_offset=k_offset)
    torch.testing.assert_close(out.bias, naive(scheme, q, k, q_offset, k_offset))


def test_skew_reads_the_diagonals():
    m, n = 3, 4
    x = torch.arange(m * (m + n - 1), dtype=torch.float64).view(m, m + n - 1)
    want = [[x[i, m - 1 - i + j].item() for j in range(n)] for i in range(m)]
    assert skew(x, n).tolist() == want
    with pytest.raises(ValueError, match="distances"):
        skew(x, n + 1)


def test_shift_invariance():
    scheme = MusicRelative(4, 2, max_distance=3)
    q, k = torch.randn(2, 4, 4), torch.randn(2, 6, 4)
    q, k = q.unsqueeze(1).expand(2, 2, 4, 4), k.unsqueeze(1).expand(2, 2, 6, 4)
    torch.testing.assert_close(scheme(q, k).bias, scheme(q, k, q_offset=9, k_offset=9).bias)


def test_gradcheck():
    scheme = MusicRelative(2, 1, max_distance=2, dtype=torch.float64)
    q = torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 4, 2, dtype=torch.float64, requires_grad=True)
    w = scheme.weight.detach().clone().requires_grad_()

    def f(q, k, w):
        p = torch.func.functional_call(scheme, {"weight": w}, (q, k), {"q_offset": 1})
        return ak.attention(p.q, p.k, k, bias=p.bias, mask=ak.masks.causal(3, 4)).context

    assert torch.autograd.gradcheck(f, (q, k, w))


def test_by_name_and_errors():
    mha = ak.MultiHeadAttention(8, 2, position="music")
    assert mha.position.weight.shape[0] == 2
    with pytest.raises(ValueError, match="2 heads"):
        mha.position(torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4))
