"""Multi-head latent attention (DeepSeek-V2 Sec. 2.1): equal to transformers' DeepSeek-V3
attention with the same weights, rotary embedding and mask; the absorbed decoding form equals the
expanded one; cached decoding equals the whole causal pass; the cache holds c^KV and k^R only."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.modern import LatentCache, MultiHeadLatentAttention, cache_bytes_per_token
from attnkit.modern import latent as latent_module

D = torch.float64
ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
masking_utils = pytest.importorskip("transformers.masking_utils")

# transformers' parameter names -> ours (the same layouts: per head [nope, rope] and [k, v] rows)
NAMES = {
    "kv_a_proj_with_mqa.weight": "w_dkv.weight",
    "kv_a_layernorm.weight": "kv_norm.weight",
    "kv_b_proj.weight": "w_ukv.weight",
    "o_proj.weight": "w_o.weight",
    "q_proj.weight": "w_q.weight",
    "q_a_proj.weight": "w_dq.weight",
    "q_a_layernorm.weight": "q_norm.weight",
    "q_b_proj.weight": "w_uq.weight",
}


def _pair(q_rank):
    cfg = ds.DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_rank,
        kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        rope_interleave=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False, max_position_embeddings=64, rms_norm_eps=1e-6,
        num_hidden_layers=1, vocab_size=10,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = ds.DeepseekV3Attention(cfg, 0).to(D).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ours = MultiHeadLatentAttention(
        32, 4, 8, head_dim=6, rope_dim=4, v_head_dim=5, q_rank=q_rank, eps=1e-6, dtype=D
    )
    ours.load_state_dict({NAMES[k]: v for k, v in ref.state_dict().items()})
    return cfg, ref, ours


def _float64_rms_norm(self, x):
    """transformers' RMSNorm without its float32 step (it rounds float64 inputs to float32)."""
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


@pytest.mark.parametrize("q_rank", [None, 12])
def test_matches_transformers_deepseek_v3_attention(q_rank, monkeypatch):
    cfg, ref, ours = _pair(q_rank)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 32, generator=g, dtype=D)
    pos = torch.arange(9)[None].expand(2, 9)
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, 6:] = 0  # item 1: 6 tokens and 3 of padding
    hf_mask = masking_utils.create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=pad, cache=None, position_ids=pos
    )
    rotary = ds.DeepseekV3RotaryEmbedding(cfg)
    keep = ak.masks.causal(9) & ak.masks.from_lengths(pad.sum(1), 9)
    real = pad.bool()
    got = ours(x, keep).output[real]
    # As shipped: transformers computes the RMSNorm, the rotary angles and softmax in float32.
    expected = ref(x, rotary(x, pos), hf_mask)[0][real]
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    # With those steps in float64 (and torch's SDPA for its float32 eager softmax) the two agree
    # to rounding.
    monkeypatch.setattr(ds.DeepseekV3RMSNorm, "forward", _float64_rms_norm)
    monkeypatch.setattr(cfg, "_attn_implementation", "sdpa")
    hf_mask = masking_utils.create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=pad, cache=None, position_ids=pos
    )
    inv_freq = 10000.0 ** -(torch.arange(0, 4, 2, dtype=D) / 4)
    angles = pos[..., None].to(D) * inv_freq
    emb = torch.cat([angles, angles], -1)
    exact = ref(x, (emb.cos(), emb.sin()), hf_mask)[0][real]
    torch.testing.assert_close(got, exact, atol=1e-13, rtol=1e-12)


def _example(seed=0, q_rank=5):
    torch.manual_seed(seed)
    mla = MultiHeadLatentAttention(16, 4, 6, head_dim=4, rope_dim=2, v_head_dim=3, q_rank=q_rank)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(seed + 1))
    return mla.to(D), x.to(D)


@pytest.mark.parametrize("q_rank", [None, 5])
def test_absorbed_form_equals_the_expanded_form(q_rank):
    mla, x = _example(q_rank=q_rank)
    mask = ak.masks.causal(8) & ak.masks.from_lengths(torch.tensor([8, 5]), 8)
    expanded = mla(x, mask, need_weights=True)
    absorbed = mla(x, mask, need_weights=True, absorbed=True)
    torch.testing.assert_close(absorbed.output, expanded.output, atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(absorbed.weights, expanded.weights, atol=1e-13, rtol=1e-12)


@pytest.mark.parametrize("absorbed", [False, True])
def test_cached_decoding_equals_the_whole_causal_pass(absorbed):
    mla, x = _example(2)
    whole = mla(x, ak.masks.causal(8)).output
    cache = LatentCache()
    parts = [mla(x[:, :3], ak.masks.causal(3), cache=cache, absorbed=absorbed).output]
    for t in range(3, 8):  # one token at a time, attending over every cached latent
        parts.append(mla(x[:, t : t + 1], cache=cache, absorbed=absorbed).output)
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-13, rtol=1e-12)
    assert len(cache) == 8


@pytest.mark.parametrize("table_limit", [None, 8])
def test_rotary_keys_and_queries_far_along_equal_rope_at_their_positions(table_limit, monkeypatch):
    """The angles come from a table kept per dtype and grown past its first 64 positions (or,
    past its limit, are formed per call): the rotated k^R and q^R at positions 100 … 104 (and
    3 … 7 after) equal RoPE's there, in the layer's dtype after a conversion too."""
    if table_limit is not None:
        monkeypatch.setattr(latent_module, "_TABLE_LIMIT", table_limit)
    mla, x = _example(5)
    x = x[:, :5]
    for dtype in (D, torch.float32):
        layer, inputs = mla.to(dtype), x.to(dtype)  # (the same layer, converted)
        for offset in (100, 3):
            positions = torch.arange(offset, offset + 5)
            c, k_r = layer.latents(inputs, offset)
            raw_c, raw_k = layer.w_dkv(inputs).split((6, 2), dim=-1)
            torch.testing.assert_close(c, layer.kv_norm(raw_c), atol=0, rtol=0)
            expected = ak.positions.rope.rotate(raw_k, positions, 10000.0)
            torch.testing.assert_close(k_r, expected, atol=0, rtol=0)
            assert k_r.dtype == inputs.dtype
            q = layer.w_uq(layer.q_norm(layer.w_dq(inputs))).unflatten(-1, (4, 6)).transpose(1, 2)
            _, q_r = layer._queries(inputs, None, cos_sin=layer._angles(offset, 5, inputs))
            rope_q = ak.positions.rope.rotate(q[..., 4:], positions, 10000.0)
            torch.testing.assert_close(q_r, rope_q, atol=0, rtol=0)


def test_cached_decoding_past_the_first_angles_equals_the_whole_causal_pass():
    mla, x = _example(6)
    x = x[:, :1].repeat(1, 70, 1) + 0.1 * torch.randn(2, 70, 16, dtype=D)
    whole = mla(x, ak.masks.causal(70)).output
    cache = LatentCache()
    parts = [mla(x[:, :60], ak.masks.causal(60), cache=cache).output]
    for t in range(60, 70):
        parts.append(mla(x[:, t : t + 1], cache=cache).output)
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-13, rtol=1e-12)


def test_the_cache_holds_the_latent_and_the_rotary_key_only():
    mla, x = _example(3)
    cache = LatentCache()
    mla(x, ak.masks.causal(8), cache=cache)
    assert cache.latent.shape == (2, 8, 6) and cache.rope_key.shape == (2, 8, 2)
    c, k_r = mla.latents(x)
    torch.testing.assert_close(cache.latent, c)
    torch.testing.assert_close(cache.rope_key, k_r)
    per_token = cache_bytes_per_token(num_heads=4, head_dim=4, kv_rank=6, rope_dim=2, dtype=D)
    assert cache.nbytes == 2 * 8 * per_token["mla"]  # B · N tokens
    # multi-head and grouped-query attention's caches, measured, against the formula
    for kind, kv_heads in (("mha", 4), ("gqa", 2), ("mqa", 1)):
        layer = ak.kv_cache.LayerCache()
        mha = ak.MultiHeadAttention(16, 4, num_kv_heads=kv_heads, dtype=D)
        mha(x, cache=layer, mask=ak.masks.causal(8))
        expected = cache_bytes_per_token(
            num_heads=4, head_dim=4, kv_rank=6, rope_dim=2, num_kv_heads=kv_heads, dtype=D
        )
        assert layer.nbytes == 2 * 8 * expected[kind], kind


def test_bytes_per_token_of_deepseek_v2():
    """DeepSeek-V2 (H = 128, d_h = 128, d_c = 4 d_h, d_h^R = d_h / 2, 60 layers): MLA's cache
    equals GQA's with 2.25 groups (paper Table 1), 1/56.9 of MHA's."""
    got = cache_bytes_per_token(
        num_heads=128, head_dim=128, kv_rank=512, rope_dim=64, num_kv_heads=8, layers=60
    )
    assert got["mla"] == 576 * 2 * 60  # bfloat16
    assert got["mha"] == 2 * 128 * 128 * 2 * 60
    assert got["mla"] / got["mqa"] == 2.25
    assert got["gqa"] == 8 * got["mqa"]


def test_a_cache_belongs_to_one_layer_and_bad_arguments_name_themselves():
    mla, x = _example()
    other, _ = _example(1)
    cache = LatentCache()
    mla(x, ak.masks.causal(8), cache=cache)
    with pytest.raises(ValueError, match="belongs to another layer"):
        other(x[:, :1], cache=cache)
    with pytest.raises(TypeError, match="cache must be"):
        mla(x, cache=ak.kv_cache.LayerCache())
    with pytest.raises(ValueError, match="x must be"):
        mla(x[..., :5])
    with pytest.raises(ValueError, match="mask"):
        mla(x, torch.ones(3, 8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="rope_dim"):
        MultiHeadLatentAttention(16, 4, 6, rope_dim=3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cache_bytes_per_token(num_heads=4, head_dim=4, kv_rank=6, rope_dim=2, num_kv_heads=3)
