"""A learned sink logit per head (GPT-OSS): softmax with an extra value-less column, equal to
transformers' GPT-OSS attention (eager) with the same weights, rotary embedding and masks, full
and sliding-window layers; rows sum to σ(logsumexp − s); a row with no key gives zeros."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.modern import SinkAttention, SinkSoftmax, sink_softmax

D = torch.float64
go = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
masking_utils = pytest.importorskip("transformers.masking_utils")

E, H, KV, HD, WINDOW = 32, 4, 2, 8, 3


def test_sink_softmax_is_softmax_over_an_extra_column_dropped():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 4, 5, generator=g, dtype=D) * 3
    sink = torch.randn(3, generator=g, dtype=D)
    column = sink[:, None, None].expand(2, 3, 4, 1)
    expected = torch.softmax(torch.cat([scores, column], -1), -1)[..., :-1]
    got = SinkSoftmax(3, dtype=D).requires_grad_(False)
    got.sinks.copy_(sink)
    torch.testing.assert_close(got(scores).weights, expected)
    lse = torch.logsumexp(scores, -1)
    torch.testing.assert_close(expected.sum(-1), torch.sigmoid(lse - sink[:, None]))
    keep = torch.rand(2, 3, 4, 5, generator=g) > 0.4
    keep[0, 0, 0] = False  # a row with no key: all mass on the sink
    masked = sink_softmax(scores, sink[:, None, None], keep)
    ref = torch.softmax(torch.cat([scores.masked_fill(~keep, -torch.inf), column], -1), -1)
    torch.testing.assert_close(masked, ref[..., :-1])
    assert (masked[0, 0, 0] == 0).all()
    big = sink_softmax(scores + 1e4, sink[:, None, None] + 1e4)  # shift-invariant, finite
    torch.testing.assert_close(big, expected)


def _reference(layer_type):
    cfg = go.GptOssConfig(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=KV, head_dim=HD,
        attention_bias=True, sliding_window=WINDOW, layer_types=[layer_type],
        num_hidden_layers=1, vocab_size=10, intermediate_size=16, num_local_experts=2,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = go.GptOssAttention(cfg, 0).to(D).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.4)
    return cfg, ref


def _ours(ref):
    """Our MultiHeadAttention with GPT-OSS's weights. transformers rotates the feature pairs
    (i, i + d/2), attnkit's RoPE the pairs (2i, 2i + 1): permuting each head's query and key
    features maps one onto the other and leaves every qᵀk unchanged."""
    mha = ak.MultiHeadAttention(
        E, H, num_kv_heads=KV, head_dim=HD, bias=True, position="rope",
        attention=SinkAttention(H, dtype=D), dtype=D,
    )  # fmt: skip
    half = torch.arange(HD // 2)
    within = torch.stack([half, half + HD // 2], -1).flatten()

    def rows(heads):
        return torch.cat([h * HD + within for h in range(heads)])

    q, k = rows(H), rows(KV)
    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([ref.q_proj.weight[q], ref.k_proj.weight[k], ref.v_proj.weight])
        )
        mha.in_proj_bias.copy_(torch.cat([ref.q_proj.bias[q], ref.k_proj.bias[k], ref.v_proj.bias]))
        mha.out_proj.load_state_dict(ref.o_proj.state_dict())
        mha.attention.sinks.copy_(ref.sinks)
    return mha.eval()


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_matches_transformers_gpt_oss_attention(layer_type):
    cfg, ref = _reference(layer_type)
    mha = _ours(ref)
    x = torch.randn(2, 8, E, generator=torch.Generator().manual_seed(1), dtype=D)
    pos = torch.arange(8)[None].expand(2, 8)
    pad = torch.ones(2, 8, dtype=torch.long)
    pad[1, 5:] = 0
    make = {
        "full_attention": masking_utils.create_causal_mask,
        "sliding_attention": masking_utils.create_sliding_window_causal_mask,
    }[layer_type]
    hf_mask = make(config=cfg, inputs_embeds=x, attention_mask=pad, cache=None, position_ids=pos)
    expected, hf_weights = ref(x, go.GptOssRotaryEmbedding(cfg)(x, pos), hf_mask)
    keep = ak.masks.causal(8) & ak.masks.from_lengths(pad.sum(1), 8)
    if layer_type == "sliding_attention":  # transformers: key j with i − j < sliding_window
        keep = keep & ak.masks.window(8, 8, WINDOW - 1)
    out = mha(x, mask=keep, need_weights=True)
    real = pad.bool()
    # transformers computes the rotary angles in float32
    torch.testing.assert_close(out.context[real], expected[real], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        out.weights.transpose(1, 2)[real], hf_weights.transpose(1, 2)[real], atol=1e-6, rtol=1e-6
    )
    # with the angles in float64 the two agree to rounding
    angles = pos[..., None].to(D) * 10000.0 ** -(torch.arange(0, HD, 2, dtype=D) / HD)
    exact, exact_weights = ref(x, (angles.cos(), angles.sin()), hf_mask)
    torch.testing.assert_close(out.context[real], exact[real], atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(
        out.weights.transpose(1, 2)[real], exact_weights.transpose(1, 2)[real], atol=1e-14, rtol=0
    )


def test_decodes_with_a_kv_cache():
    torch.manual_seed(2)
    mha = ak.MultiHeadAttention(16, 2, attention=SinkAttention(2, init=1.0), position="rope")
    mha = mha.to(D).eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3), dtype=D)
    whole = mha(x, mask=ak.masks.causal(6)).context
    cache = ak.kv_cache.LayerCache()
    steps = [mha(x[:, :2], mask=ak.masks.causal(2), cache=cache).context]
    steps += [mha(x[:, t : t + 1], cache=cache).context for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), whole)


def test_a_large_sink_lets_a_head_attend_to_nothing():
    part = SinkAttention(1).to(D)
    with torch.no_grad():
        part.sinks.fill_(30.0)
    q, k, v = (torch.randn(1, 1, 4, 3, dtype=D) for _ in range(3))
    assert part(q, k, v).context.abs().max() < 1e-10


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="num_heads"):
        SinkSoftmax(0)
    with pytest.raises(ValueError, match=r"H = 3"):
        SinkSoftmax(3)(torch.randn(2, 2, 4, 5))
    with pytest.raises(TypeError, match="need_weights"):
        SinkAttention(2)(*(torch.randn(1, 2, 3, 4) for _ in range(3)), need_weights=1)


@pytest.mark.parametrize("init", [float("nan"), float("inf"), "0"])
def test_a_sink_init_that_is_not_a_finite_number_is_refused(init):
    with pytest.raises((ValueError, TypeError), match="init must be"):
        SinkAttention(2, init=init)
