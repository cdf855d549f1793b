"""Kimi Linear's full-attention layer (transformers' KimiLinearAttention) is multi-head latent
attention without positions: ``MultiHeadLatentAttention(rotary=False)`` with the same weights
equals it in float64 (prefill, a padded batch, gradients), and its cached decoding equals the
causal pass of transformers' layer and transformers' own cached decoding."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.modern import LatentCache, MultiHeadLatentAttention

D = torch.float64
kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
masking_utils = pytest.importorskip("transformers.masking_utils")
cache_utils = pytest.importorskip("transformers.cache_utils")

# transformers' parameter names -> ours (per head [nope, rope] query rows and [k, v] rows)
NAMES = {
    "kv_a_proj_with_mqa.weight": "w_dkv.weight",
    "kv_a_proj_with_mqa.bias": "w_dkv.bias",
    "kv_a_layernorm.weight": "kv_norm.weight",
    "kv_b_proj.weight": "w_ukv.weight",
    "o_proj.weight": "w_o.weight",
    "o_proj.bias": "w_o.bias",
    "q_proj.weight": "w_q.weight",
    "q_a_proj.weight": "w_dq.weight",
    "q_a_proj.bias": "w_dq.bias",
    "q_a_layernorm.weight": "q_norm.weight",
    "q_b_proj.weight": "w_uq.weight",
}


def _float64_rms_norm(self, x):
    """transformers' RMSNorm without its float32 step (it rounds float64 inputs to float32)."""
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def _pair(q_rank, bias=False):
    cfg = kimi.KimiLinearConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_rank,
        kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        attention_bias=bias, max_position_embeddings=64, num_hidden_layers=1, vocab_size=10,
        layer_types=["full_attention"], pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = kimi.KimiLinearAttention(cfg, 0).to(D).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    ours = MultiHeadLatentAttention(
        32, 4, 8, head_dim=6, rope_dim=4, v_head_dim=5, q_rank=q_rank, bias=bias,
        rotary=False, eps=1e-6, dtype=D,
    )  # fmt: skip
    ours.load_state_dict({NAMES[k]: v for k, v in ref.state_dict().items()})
    return cfg, ref, ours


def _inputs(cfg):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 9, 32, generator=g, dtype=D)
    pad = torch.ones(2, 9, dtype=torch.long)
    pad[1, 6:] = 0  # item 1: 6 tokens and 3 of padding
    pos = torch.arange(9)[None].expand(2, 9)
    hf_mask = masking_utils.create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=pad, cache=None, position_ids=pos
    )
    keep = ak.masks.causal(9) & ak.masks.from_lengths(pad.sum(1), 9)
    return x, pad.bool(), hf_mask, keep


@pytest.mark.parametrize(("q_rank", "bias"), [(None, False), (12, True)])
def test_matches_transformers_kimi_linear_attention(q_rank, bias, monkeypatch):
    cfg, ref, ours = _pair(q_rank, bias)
    x, real, hf_mask, keep = _inputs(cfg)
    got = ours(x, keep).output
    # As shipped: transformers computes the RMSNorms and the eager softmax in float32.
    torch.testing.assert_close(got[real], ref(x, hf_mask)[0][real], atol=1e-6, rtol=1e-6)
    # With those steps in float64 the two agree to rounding.
    monkeypatch.setattr(kimi.KimiLinearRMSNorm, "forward", _float64_rms_norm)
    monkeypatch.setattr(cfg, "_attn_implementation", "sdpa")
    hf_mask = masking_utils.create_causal_mask(
        config=cfg,
        inputs_embeds=x,
        attention_mask=real.long(),
        cache=None,
        position_ids=torch.arange(9)[None].expand(2, 9),
    )
    exact = ref(x, hf_mask)[0]
    assert (got[real] - exact[real]).abs().max() < 1e-12
    # padding equals truncation: item 1 alone, cut to its 6 tokens
    alone = ours(x[1:, :6], ak.masks.causal(6)).output
    torch.testing.assert_close(alone[0], got[1, :6], atol=1e-13, rtol=1e-12)
    # and the layer is really position-free: the same keys in another order, the same output
    # for the last query once it sees them all (a rotary layer would change)
    perm = torch.tensor([3, 0, 2, 1, 4, 5, 7, 6, 8])
    shuffled = ours(x[:1, perm]).output[0, -1]
    torch.testing.assert_close(shuffled, ours(x[:1]).output[0, -1], atol=1e-13, rtol=1e-12)


def test_gradients_match(monkeypatch):
    cfg, ref, ours = _pair(12, bias=True)
    monkeypatch.setattr(kimi.KimiLinearRMSNorm, "forward", _float64_rms_norm)
    monkeypatch.setattr(cfg, "_attn_implementation", "sdpa")
    x, real, _, keep = _inputs(cfg)
    hf_mask = masking_utils.create_causal_mask(
        config=cfg,
        inputs_embeds=x,
        attention_mask=real.long(),
        cache=None,
        position_ids=torch.arange(9)[None].expand(2, 9),
    )
    w = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(5), dtype=D) * real[..., None]
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ours(xa, keep).output * w).sum().backward()
    (ref(xb, hf_mask)[0] * w).sum().backward()
    worst = (xa.grad - xb.grad).abs().max()
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        hf = next(k for k, v in NAMES.items() if v == name)
        worst = max(worst, (p.grad - theirs[hf].grad).abs().max())
    assert worst < 1e-11, worst
    assert xa.grad.abs().max() > 1e-3  # the comparison is not between zeros


@pytest.mark.parametrize("absorbed", [False, True])
def test_cached_decoding_equals_transformers_causal_pass(absorbed, monkeypatch):
    cfg, ref, ours = _pair(12)
    monkeypatch.setattr(kimi.KimiLinearRMSNorm, "forward", _float64_rms_norm)
    monkeypatch.setattr(cfg, "_attn_implementation", "sdpa")
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3), dtype=D)
    hf_mask = masking_utils.create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
        position_ids=torch.arange(9)[None].expand(2, 9),
    )  # fmt: skip
    whole = ref(x, hf_mask)[0]
    cache = LatentCache()
    parts = [ours(x[:, :4], ak.masks.causal(4), cache=cache, absorbed=absorbed).output]
    for t in range(4, 9):  # one token at a time over the cached latents
        parts.append(ours(x[:, t : t + 1], cache=cache, absorbed=absorbed).output)
    stepped = torch.cat(parts, 1)
    assert (stepped - whole).abs().max() < 1e-12
    assert len(cache) == 9
    # transformers' own cache over the same steps
    hf_cache = cache_utils.DynamicCache(config=cfg)
    ones = torch.ones(2, 9, dtype=torch.long)
    pos = torch.arange(9)[None].expand(2, 9)
    theirs = []
    for a, b in [(0, 4)] + [(t, t + 1) for t in range(4, 9)]:
        step_mask = masking_utils.create_causal_mask(
            config=cfg, inputs_embeds=x[:, a:b], attention_mask=ones[:, :b], cache=hf_cache,
            position_ids=pos[:, a:b],
        )  # fmt: skip
        theirs.append(ref(x[:, a:b], step_mask, cache=hf_cache)[0])
    assert (stepped - torch.cat(theirs, 1)).abs().max() < 1e-12


def test_rotary_must_be_a_bool():
    with pytest.raises(TypeError, match="rotary"):
        MultiHeadLatentAttention(16, 2, 4, rotary="no")
