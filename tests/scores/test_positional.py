"""Location- and convolution-based scores against loops from their definitions (Galassi IV-B)."""

import pytest
import torch
from helpers import assert_same_forward_backward, rand

import attnkit as ak
from attnkit import scores as sc


def test_location_depends_only_on_query_and_position():
    torch.manual_seed(0)
    s = sc.Location(5, max_len=8).double()
    q, k = rand(2, 3, 5, seed=1), rand(2, 6, 4, seed=2)
    W, b = s.W_a.weight, s.W_a.bias

    def loop():
        return torch.stack(
            [
                torch.stack(
                    [torch.stack([W[l] @ q[i, m] + b[l] for l in range(6)]) for m in range(3)]
                )
                for i in range(2)
            ]
        )

    assert_same_forward_backward(lambda: s(q, k), loop, [q, W, b])
    torch.testing.assert_close(s(q, k), s(q, torch.randn_like(k)))  # content is ignored


def test_location_rejects_too_long_sequences():
    with pytest.raises(ValueError, match=r"N = 9 keys .* max_len = 8"):
        sc.Location(5, max_len=8)(torch.randn(1, 2, 5), torch.randn(1, 9, 3))


@pytest.mark.parametrize("width", [1, 2, 3])
def test_convolutional(width):
    torch.manual_seed(0)
    s = sc.Convolutional(4, width=width).double()
    with torch.no_grad():
        s.b.fill_(0.2)
    n = 6
    k = rand(2, n, 4, seed=2)
    f, b = s.filter[0], s.b[0]  # (d_k, width), scalar

    def key(i, j):  # zero padding outside the sequence
        return k[i, j] if 0 <= j < n else torch.zeros(4, dtype=k.dtype)

    def window(i, j):  # energy of the window starting at key j
        return torch.tanh(sum(f[:, t] @ key(i, j + t) for t in range(width)) + b)

    def loop():
        per_key = [
            [sum(window(i, j) for j in range(l - width + 1, l + 1)) / width for l in range(n)]
            for i in range(2)
        ]
        return torch.stack([torch.stack(row) for row in per_key]).unsqueeze(1)

    assert_same_forward_backward(lambda: s(None, k), loop, [k, s.filter, s.b])


def test_convolutional_heads_equal_one_score_per_head():
    torch.manual_seed(0)
    heads = sc.Convolutional(4, width=3, num_heads=2).double()
    k = rand(2, 2, 6, 4, seed=2, grad=False)
    e = heads(None, k)
    assert e.shape == (2, 2, 1, 6)
    for h in range(2):
        one = sc.Convolutional(4, width=3).double()
        with torch.no_grad():
            one.filter.copy_(heads.filter[h : h + 1])
            one.b.copy_(heads.b[h : h + 1])
        torch.testing.assert_close(e[:, h], one(None, k[:, h]))


def test_convolutional_under_a_mask_reads_masked_keys_as_zeros():
    """With keep=, row m is the score of the keys row m may attend, the others replaced by
    zeros (a loop over rows of the unmasked score of the zeroed keys)."""
    torch.manual_seed(0)
    s = sc.Convolutional(4, width=3).double()
    with torch.no_grad():
        s.b.fill_(0.1)
    n = 6
    k = rand(2, n, 4, seed=3)
    keep = torch.rand(2, 5, n, generator=torch.Generator().manual_seed(4)) > 0.4

    def loop():
        rows = [
            [
                s(None, torch.where(keep[i, m].unsqueeze(-1), k[i], 0.0).unsqueeze(0))[0, 0]
                for m in range(5)
            ]
            for i in range(2)
        ]
        return torch.stack([torch.stack(r) for r in rows])

    assert_same_forward_backward(lambda: s(None, k, keep=keep), loop, [k, s.filter, s.b])


def test_convolutional_heads_under_a_mask_equal_one_score_per_head():
    torch.manual_seed(0)
    heads = sc.Convolutional(4, width=2, num_heads=2).double()
    with torch.no_grad():
        heads.b.copy_(torch.tensor([0.3, -0.2]))
    k = rand(2, 2, 6, 4, seed=2, grad=False)
    keep = torch.rand(2, 2, 3, 6, generator=torch.Generator().manual_seed(5)) > 0.3
    e = heads(None, k, keep=keep)
    assert e.shape == (2, 2, 3, 6)
    for h in range(2):
        one = sc.Convolutional(4, width=2).double()
        with torch.no_grad():
            one.filter.copy_(heads.filter[h : h + 1])
            one.b.copy_(heads.b[h : h + 1])
        torch.testing.assert_close(e[:, h], one(None, k[:, h], keep=keep[:, h]))


def test_convolutional_causal_attention_does_not_read_later_keys():
    """Under a causal mask, row t depends on keys ≤ t only, equals attention over the sequence
    cut after key t, and a NaN in a masked key reaches nothing (forward or gradient)."""
    torch.manual_seed(0)
    s = sc.Convolutional(4, width=3).double()
    n = 6
    q, k, v = (rand(2, n, 4, seed=i, grad=False) for i in range(3))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    out = ak.attention(q, k, v, score=s, mask=causal).context
    for t in range(n):
        cut = ak.attention(q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], score=s).context
        torch.testing.assert_close(out[:, t : t + 1], cut)
    later = k.clone()
    later[:, 4:] = float("nan")
    nan_v = v.clone()
    nan_v[:, 4:] = float("nan")
    out = ak.attention(q, later, nan_v, score=s, mask=causal).context
    assert torch.isfinite(out[:, :4]).all()
    padding = torch.ones(2, 1, n, dtype=torch.bool)
    padding[:, :, 4:] = False
    out = ak.attention(q, later, nan_v, score=s, mask=padding).context
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(s.filter.grad).all() and torch.isfinite(s.b.grad).all()


def test_convolutional_refuses_the_chunked_kernel_under_a_mask():
    s = sc.Convolutional(4)
    q, k = torch.randn(1, 3, 4), torch.randn(1, 5, 4)
    with pytest.raises(ValueError, match=r"chunked.*mixes neighbouring keys"):
        ak.attention(q, k, k, score=s, mask=torch.ones(3, 5, dtype=torch.bool), chunk_size=2)


def test_keep_is_refused_by_a_score_that_does_not_mix_keys():
    with pytest.raises(TypeError, match=r"keep= is for scores that mix"):
        sc.Dot()(
            torch.randn(1, 2, 3), torch.randn(1, 4, 3), keep=torch.ones(2, 4, dtype=torch.bool)
        )
