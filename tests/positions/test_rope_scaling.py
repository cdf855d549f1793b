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


def _longrope(fraction=1.0, original=512, max_len=4096, seed=0, **extra):
    """A Phi-3-style config with random rescale factors (r/2 of them for r = fraction·64) and
    the same LongRoPEScaling."""
    g = torch.Generator().manual_seed(seed)
    half = int(64 * fraction) // 2
    short = (1 + torch.rand(half, generator=g, dtype=torch.float64)).tolist()
    long = (1 + 20 * torch.rand(half, generator=g, dtype=torch.float64)).tolist()
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": fraction,
              "short_factor": short, "long_factor": long,
              "original_max_position_embeddings": original, **extra}  # fmt: skip
    config = transformers.Phi3Config(
        hidden_size=128, num_attention_heads=2, max_position_embeddings=max_len,
        original_max_position_embeddings=original, rope_parameters=params,
    )  # fmt: skip
    scaling = rs.LongRoPEScaling(
        short, long, original, extra.get("factor", max_len / original),
        attention_factor=extra.get("attention_factor"),
    )  # fmt: skip
    return config, scaling, short, long


@pytest.mark.parametrize(
    "fraction, extra, seq_len",
    [(1.0, {}, None), (1.0, {}, 512), (1.0, {}, 513), (0.5, {}, 9000),
     (1.0, {"factor": 16.0}, 600), (0.5, {"attention_factor": 1.3}, 100)],
)  # fmt: skip
def test_longrope_matches_transformers_on_both_sides_of_the_trained_length(
    fraction, extra, seq_len
):
    config, scaling, short, long = _longrope(fraction, **extra)
    kw = {} if seq_len is None else {"seq_len": seq_len}
    want, want_factor = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", **kw)
    scheme = ak.positions.ScaledRotary(10000.0, fraction=fraction, scaling=scaling)
    got, factor = scheme.frequencies(64, 0 if seq_len is None else seq_len)
    print(f"longrope at {seq_len}: max relative diff "
          f"{float((got - want.double()).abs().div(want.double()).max()):.1e}")  # fmt: skip
    torch.testing.assert_close(got, want.double(), rtol=2e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    # written out (Ding et al.: θ_i / λ_i, λ long past L0), and the factor √(1 + ln s / ln L0)
    lam = long if (seq_len or 0) > 512 else short
    r = int(64 * fraction)
    theta = [10000.0 ** (-2 * i / r) / lam[i] for i in range(r // 2)]
    torch.testing.assert_close(got, torch.tensor(theta, dtype=torch.float64), rtol=1e-14, atol=0)
    s = extra.get("factor", 4096 / 512)
    assert factor == pytest.approx(
        extra.get("attention_factor", math.sqrt(1 + math.log(s) / math.log(512)))
    )


@pytest.mark.parametrize("length", [300, 700])
def test_longrope_rotation_equals_phi3s_rotary_embedding(length):
    """Phi-3's rotary embedding (halves layout, partial) picks the short or the long list from
    the largest position id; the scheme reads the same length from the sequence it places."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rotary

    config, scaling, _, _ = _longrope(0.5)
    config.head_dim = 64
    rotary = Phi3RotaryEmbedding(config)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, length, 64, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = rotary(q, torch.arange(length)[None])
    want_q, want_k = phi3_rotary(q, k, cos.double(), sin.double())
    scheme = ak.positions.ScaledRotary(10000.0, fraction=0.5, layout="halves", scaling=scaling)
    out = scheme(q, k)
    # Phi-3 forms its angles in float32: position · θ is rounded to ~1e-7 relative
    torch.testing.assert_close(out.q, want_q, rtol=0, atol=2e-4)
    torch.testing.assert_close(out.k, want_k, rtol=0, atol=2e-4)
    other = _longrope(0.5, original=length + 1 if length > 512 else length - 1)[1]
    wrong = ak.positions.ScaledRotary(10000.0, fraction=0.5, layout="halves", scaling=other)(q, k)
    assert (wrong.q - want_q).abs().max() > 0.1  # the other list is far off
    assert scheme.reads_total_length and not scheme.translation_invariant


def test_longrope_declares_reading_the_length_exactly_when_its_lists_differ():
    """Scores among the first positions change once the sequence passes L0 (the long list)
    iff the lists differ; the declaration follows, and a KV cache refuses the first only."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(2))
    for short, long in (((1.0, 2.0), (3.0, 8.0)), ((1.5, 2.0), (1.5, 2.0))):
        scheme = rs.ScaledRotary(scaling=rs.LongRoPEScaling(short, long, 4, 3.0))
        prefix = scheme(q[..., :3, :], k[..., :3, :])
        whole = scheme(q, k)
        changes = not torch.allclose(
            prefix.q @ prefix.k.transpose(-1, -2),
            (whole.q @ whole.k.transpose(-1, -2))[..., :3, :3],
        )
        assert scheme.reads_total_length == changes == (short != long)
        mha = ak.MultiHeadAttention(8, 2, position=scheme, dtype=torch.float64)
        x = torch.randn(1, 3, 8, dtype=torch.float64)
        if changes:
            with pytest.raises(ValueError, match="reads the length"):
                mha(x, mask=ak.masks.causal(3), cache=ak.kv_cache.LayerCache())
        else:
            mha(x, mask=ak.masks.causal(3), cache=ak.kv_cache.LayerCache())


def test_longrope_refusals_name_the_argument():
    with pytest.raises(ValueError, match=r"short_factor\[1\] must be > 0"):
        rs.LongRoPEScaling([1.0, 0.0], [1.0, 2.0], 8, 2.0)
    with pytest.raises(ValueError, match="got 2 and 3"):
        rs.LongRoPEScaling([1.0, 1.0], [1.0, 2.0, 3.0], 8, 2.0)
    with pytest.raises(TypeError, match="long_factor must be a sequence"):
        rs.LongRoPEScaling([1.0], 2.0, 8, 2.0)
    with pytest.raises(ValueError, match="original_max_len must be a positive int"):
        rs.LongRoPEScaling([1.0], [2.0], 0, 2.0)
    with pytest.raises(ValueError, match="factor must be >= 1"):
        rs.LongRoPEScaling([1.0], [2.0], 8, 0.5)
    with pytest.raises(ValueError, match="need r/2 = 4"):
        rs.LongRoPEScaling([1.0], [2.0], 8, 2.0).frequencies(8, 10000.0, 4)


def test_the_kept_angles_equal_angles_formed_per_call(monkeypatch):
    """ScaledRotary keeps a table of its angles; every position it reads from the table (as the
    table grows, one decoding step at a time, and beyond the table's limit) is rotated exactly as
    rotate_partial rotates it."""
    scheme = rs.ScaledRotary(500.0, fraction=0.5, layout="halves")
    monkeypatch.setattr(rs, "_TABLE_LIMIT", 100)
    q, k = (
        torch.randn(2, 3, 1, 8, dtype=torch.float64),
        torch.randn(2, 3, 1, 8, dtype=torch.float64),
    )
    theta, _ = scheme.frequencies(8, 1)
    for offset in (0, 1, 63, 64, 65, 99, 100, 130):  # grows at 64; past the limit from 100
        out = scheme(q, k, q_offset=offset, k_offset=offset)
        pos = torch.tensor([offset])
        assert torch.equal(out.q, rs.rotate_partial(q, pos, theta, layout="halves"))
        assert torch.equal(out.k, rs.rotate_partial(k, pos, theta, layout="halves"))
    # another dtype or head size is a table of its own
    out = scheme(q.float(), k.float(), q_offset=5, k_offset=5)
    want = rs.rotate_partial(q.float(), torch.tensor([5]), theta, layout="halves")
    assert out.q.dtype == torch.float32 and torch.equal(out.q, want)
