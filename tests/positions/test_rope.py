"""RoPE against Su et al.'s rotation matrix (eq. 15); q·k depends only on the offset."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.positions import Rotary
from attnkit.positions.rope import rotate


def rotation_matrix(m: int, d: int, base: float = 10000.0) -> torch.Tensor:
    """R^d_{Θ,m} of eq. 15: block diagonal, 2×2 rotations by m·θ_i, θ_i = base^{−2(i−1)/d}."""
    r = torch.zeros(d, d, dtype=torch.float64)
    for i in range(d // 2):
        a = m * base ** (-2 * i / d)
        r[2 * i, 2 * i], r[2 * i, 2 * i + 1] = math.cos(a), -math.sin(a)
        r[2 * i + 1, 2 * i], r[2 * i + 1, 2 * i + 1] = math.sin(a), math.cos(a)
    return r


def test_matches_the_rotation_matrix_with_offsets():
    q = torch.randn(2, 3, 4, 6, dtype=torch.float64)
    k = torch.randn(2, 3, 5, 6, dtype=torch.float64)
    out = Rotary()(q, k, q_offset=7, k_offset=2)
    for i in range(4):
        torch.testing.assert_close(out.q[..., i, :], q[..., i, :] @ rotation_matrix(7 + i, 6).T)
    for j in range(5):
        torch.testing.assert_close(out.k[..., j, :], k[..., j, :] @ rotation_matrix(2 + j, 6).T)
    assert out.bias is None and out.values is None


def test_dot_products_depend_only_on_the_offset():
    rope = Rotary()
    q, k = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(3, 6, 8, dtype=torch.float64)

    def logits(qo, ko):
        out = rope(q, k, q_offset=qo, k_offset=ko)
        return out.q @ out.k.transpose(-1, -2)

    torch.testing.assert_close(logits(0, 0), logits(13, 13))
    torch.testing.assert_close(logits(2, 0), logits(40, 38))
    assert not torch.allclose(logits(0, 0), logits(1, 0))  # and does depend on it


def test_offset_places_tokens_like_a_longer_sequence():
    rope = Rotary()
    q = torch.randn(2, 9, 4, dtype=torch.float64)
    full = rope(q, q)
    part = rope(q[:, 5:], q[:, :3], q_offset=5)
    torch.testing.assert_close(part.q, full.q[:, 5:])
    torch.testing.assert_close(part.k, full.k[:, :3])


def test_cached_decoding_equals_one_causal_pass():
    mha = ak.MultiHeadAttention(8, 2, position="rope", dtype=torch.float64)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    full = mha(x, mask=ak.masks.causal(6)).context
    cache = ak.kv_cache.LayerCache()
    steps = [mha(x[:, t : t + 1], cache=cache).context for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_gradcheck():
    q = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: tuple(Rotary()(a, b, q_offset=3)[:2]), (q, k))


def test_errors():
    with pytest.raises(ValueError, match="even"):
        Rotary()(torch.randn(2, 3, 5), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="same size"):
        Rotary()(torch.randn(2, 3, 4), torch.randn(2, 3, 6))
    assert isinstance(ak.MultiHeadAttention(8, 2, position="rope").position, Rotary)


def test_rotation_equals_gptj_rotary_embedding_in_transformers():
    from transformers.models.gptj import modeling_gptj as gptj

    torch.manual_seed(0)
    length, d = 40, 16
    x = torch.randn(length, d)
    sincos = gptj.create_sinusoidal_positions(length, d)  # (L, d): sin and cos of m·θ_i
    sin, cos = sincos[None, :, : d // 2], sincos[None, :, d // 2 :]
    theirs = gptj.apply_rotary_pos_emb(x[None, :, None, :], sin, cos)[0, :, 0]
    torch.testing.assert_close(rotate(x, torch.arange(length)), theirs, rtol=1e-5, atol=1e-5)
