"""Scaled, partial rotary embeddings: frequencies and attention factors against Hugging Face's
``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` built from small configs; the halves
layout against Hugging Face Llama's ``apply_rotary_pos_emb``; the interleaved layout against
RoFormer's rotation (:func:`attnkit.positions.rotate`); the layout conversion (Llama porting)."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.positions import rope_scaling as rs

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402


def _config(head_dim=64, fraction=1.0, max_len=4096, **rope):
    return transformers.LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        max_position_embeddings=max_len,
        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": fraction, **rope},
    )


CASES = [
    ("linear", rs.LinearScaling(4.0), {"factor": 4.0}, 1.0, None),
    ("linear", rs.LinearScaling(2.0), {"factor": 2.0}, 0.5, None),
    ("dynamic", rs.DynamicNTKScaling(4.0, 4096), {"factor": 4.0}, 1.0, 9000),
    ("dynamic", rs.DynamicNTKScaling(2.0, 4096), {"factor": 2.0}, 0.25, 100),  # below L0
    ("yarn", rs.YaRNScaling(8.0, 2048), {"factor": 8.0, "original_max_position_embeddings": 2048},
     1.0, None),
    ("yarn", rs.YaRNScaling(4.0, 512, beta_fast=16.0, beta_slow=2.0),
     {"factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 16.0,
      "beta_slow": 2.0}, 0.5, None),
    ("llama3", rs.Llama3Scaling(8.0, 1024),
     {"factor": 8.0, "original_max_position_embeddings": 1024, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0}, 1.0, None),
    ("llama3", rs.Llama3Scaling(4.0, 2048, low_freq_factor=2.0, high_freq_factor=8.0),
     {"factor": 4.0, "original_max_position_embeddings": 2048, "low_freq_factor": 2.0,
      "high_freq_factor": 8.0}, 0.5, None),
]  # fmt: skip


@pytest.mark.parametrize("kind, scaling, params, fraction, seq_len", CASES)
def test_frequencies_and_attention_factor_match_transformers(
    kind, scaling, params, fraction, seq_len
):
    config = _config(fraction=fraction, rope_type=kind, **params)
    kw = {} if seq_len is None else {"seq_len": seq_len}
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", **kw)
    scheme = ak.positions.ScaledRotary(10000.0, fraction=fraction, scaling=scaling)
    got, factor = scheme.frequencies(64, 0 if seq_len is None else seq_len)
    assert got.shape == want.shape == (int(64 * fraction) // 2,)
    diff = float((got - want.double()).abs().div(want.double()).max())
    print(f"{kind} x{params['factor']:g}, fraction {fraction}: max relative diff {diff:.1e}")
    torch.testing.assert_close(got, want.double(), rtol=2e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    assert not torch.equal(got, rs.inverse_frequencies(int(64 * fraction), 10000.0)) or (
        kind == "dynamic" and seq_len <= 4096
    )  # the scaling did something (dynamic below L0: nothing, as it should)


def test_yarn_attention_factor_is_0_1_ln_s_plus_1():
    assert rs.YaRNScaling(16.0, 1024).frequencies(32, 1e4, 0)[1] == pytest.approx(
        0.1 * math.log(16) + 1
    )


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_halves_layout_equals_hugging_face_llama(fraction):
    torch.manual_seed(0)
    q, k = (
        torch.randn(2, 2, 5, 16, dtype=torch.float64),
        torch.randn(2, 2, 7, 16, dtype=torch.float64),
    )
    scaling = rs.YaRNScaling(4.0, 8)
    scheme = ak.positions.ScaledRotary(fraction=fraction, layout="halves", scaling=scaling)
    out = scheme(q, k, q_offset=2)
    r = int(16 * fraction)
    theta, factor = scheme.frequencies(16, 7)
    for x, got, start in ((q, out.q, 2), (k, out.k, 0)):
        pos = torch.arange(start, start + x.shape[-2], dtype=torch.float64)
        emb = torch.cat([pos[:, None] * theta] * 2, -1)
        cos, sin = (emb.cos() * factor)[None], (emb.sin() * factor)[None]
        want, _ = apply_rotary_pos_emb(x[..., :r], x[..., :r], cos, sin)
        torch.testing.assert_close(got[..., :r], want)
        torch.testing.assert_close(got[..., r:], x[..., r:])  # the rest passes unchanged


def test_interleaved_full_rotary_is_roformers_rotation():
    q = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    out = ak.positions.ScaledRotary()(q, q, q_offset=3)
    torch.testing.assert_close(out.q, ak.positions.rotate(q, torch.arange(3, 9)))
    torch.testing.assert_close(out.q, ak.positions.Rotary()(q, q, q_offset=3).q)


def test_porting_interleaved_weights_to_the_halves_layout_keeps_every_score():
    """A Meta-layout (interleaved) projection, its rows permuted per head by P, rotated in the
    halves layout (Hugging Face's own rotation) gives the same q·k."""
    torch.manual_seed(0)
    heads, d, r = 2, 8, 4  # partial: the first 4 of 8 features rotate
    wq, wk = (
        torch.randn(heads * d, 6, dtype=torch.float64),
        torch.randn(heads * d, 6, dtype=torch.float64),
    )
    x = torch.randn(1, 5, 6, dtype=torch.float64)
    pos = torch.arange(5)
    theta = rs.inverse_frequencies(r, 10000.0)

    def scores(wq, wk, layout):
        q = (x @ wq.T).unflatten(-1, (heads, d)).transpose(1, 2)
        k = (x @ wk.T).unflatten(-1, (heads, d)).transpose(1, 2)
        q = rs.rotate_partial(q, pos, theta, layout=layout)
        k = rs.rotate_partial(k, pos, theta, layout=layout)
        return q @ k.transpose(-1, -2)

    meta = scores(wq, wk, "interleaved")
    ported = scores(rs.permute_heads(wq, heads, r), rs.permute_heads(wk, heads, r), "halves")
    torch.testing.assert_close(ported, meta)
    p = rs.interleaved_to_halves(6)
    assert p.tolist() == [0, 2, 4, 1, 3, 5]
    assert p[rs.halves_to_interleaved(6)].tolist() == list(range(6))
    v = torch.randn(3, 6, dtype=torch.float64)
    th = rs.inverse_frequencies(6, 100.0)
    torch.testing.assert_close(
        rs.rotate_partial(v[:, p], torch.arange(3), th, layout="halves"),
        rs.rotate_partial(v, torch.arange(3), th, layout="interleaved")[:, p],
    )


def test_in_multihead_attention_and_decoding_with_a_dynamic_scaling():
    torch.manual_seed(0)
    scheme = ak.positions.ScaledRotary(fraction=0.5, layout="halves",
                                       scaling=rs.LinearScaling(2.0))  # fmt: skip
    mha = ak.MultiHeadAttention(16, 2, position=scheme).double().eval()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    cache = ak.kv_cache.LayerCache()
    steps = torch.cat([mha(x[:, i : i + 1], cache=cache).context for i in range(6)], 1)
    torch.testing.assert_close(steps, mha(x, mask=ak.masks.causal(6)).context)
    assert isinstance(ak.MultiHeadAttention(16, 2, position="rope_scaled").position,
                      rs.ScaledRotary)  # fmt: skip


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="layout must be one of"):
        ak.positions.ScaledRotary(layout="pairs")
    with pytest.raises(ValueError, match="fraction must lie in"):
        ak.positions.ScaledRotary(fraction=1.5)
    with pytest.raises(ValueError, match="must be even"):
        ak.positions.ScaledRotary(fraction=0.3)(torch.randn(1, 4, 10), torch.randn(1, 4, 10))
    with pytest.raises(TypeError, match="scaling must be"):
        ak.positions.ScaledRotary(scaling="yarn")
    with pytest.raises(ValueError, match="factor must be >= 1"):
        rs.LinearScaling(0.5)
    with pytest.raises(ValueError, match="high_freq_factor must exceed"):
        rs.Llama3Scaling(low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="rows"):
        rs.permute_heads(torch.randn(7, 3), 2)


@pytest.mark.parametrize(("fast", "slow"), [(1.0, 32.0), (4.0, 4.0)])
def test_yarn_refuses_a_ramp_that_does_not_rise(fast, slow):
    with pytest.raises(ValueError, match="beta_fast must be > beta_slow"):
        rs.YaRNScaling(2.0, 64, beta_fast=fast, beta_slow=slow)
