"""swap_attention on Hugging Face transformers models: with the defaults the swapped model is
the same model (BERT, GPT-2 with generation through the KV cache, ViT, T5 with its relative
position bias); other alignments change it as they should and train."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers import (
    BartConfig,
    BartModel,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    T5Config,
    T5Model,
    ViTConfig,
    ViTModel,
)
from transformers_gpt2 import TIGHT, gpt2_eager, ids_and_padding

import attnkit as ak
from attnkit.integrations.transformers import swap_attention

transformers.logging.set_verbosity_error()


def _bert():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=32,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    return BertModel(config).double().eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids, mask


def test_bert_with_the_defaults_is_the_same_model():
    model = _bert()
    ids, mask = _inputs()
    ref = model(ids, attention_mask=mask).last_hidden_state
    name = swap_attention(model)
    assert model.config._attn_implementation == name
    out = model(ids, attention_mask=mask, output_attentions=True)
    torch.testing.assert_close(out.last_hidden_state, ref, atol=1e-12, rtol=1e-12)
    w = out.attentions[0]  # attnkit's weights: (B, H, M, N), zero on padding
    assert w.shape == (3, 4, 9, 9) and (w[2, ..., 3:] == 0).all()
    model.set_attn_implementation("eager")
    torch.testing.assert_close(model(ids, attention_mask=mask).last_hidden_state, ref)


def test_gpt2_generation_through_the_cache_is_unchanged():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    model = GPT2LMHeadModel(config).double().eval()
    model.set_attn_implementation("eager")
    ids, mask = _inputs()
    ref_logits = model(ids, attention_mask=mask).logits
    ref_tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
    swap_attention(model)
    torch.testing.assert_close(model(ids, attention_mask=mask).logits, ref_logits)
    assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False), ref_tokens)


def test_vit_and_t5_are_unchanged():
    torch.manual_seed(0)
    vit = (
        ViTModel(
            ViTConfig(
                image_size=8,
                patch_size=4,
                num_channels=3,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
                attn_implementation="eager",
            )
        )
        .double()
        .eval()
    )
    pixels = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ref = vit(pixels).last_hidden_state
    swap_attention(vit)
    torch.testing.assert_close(vit(pixels).last_hidden_state, ref)

    t5 = (
        T5Model(
            T5Config(
                vocab_size=40,
                d_model=16,
                d_kv=8,
                d_ff=32,
                num_layers=2,
                num_heads=2,
                decoder_start_token_id=0,
                attn_implementation="eager",
            )
        )
        .double()
        .eval()
    )
    ids, mask = _inputs()
    ref = t5(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5]).last_hidden_state
    swap_attention(t5)  # T5's relative position bias becomes attnkit's bias
    out = t5(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5]).last_hidden_state
    torch.testing.assert_close(out, ref)


def test_bart_is_unchanged():
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=40,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    bart = BartModel(config).double().eval()
    ids, mask = _inputs()
    ref = bart(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5]).last_hidden_state
    swap_attention(bart)  # the decoder's self-attention is causal without a mask: kept causal
    out = bart(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5]).last_hidden_state
    torch.testing.assert_close(out, ref)


def test_sparsemax_changes_the_model_and_fine_tunes():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertForSequenceClassification(config)
    swap_attention(model, align="sparsemax")
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 40, (64, 8), generator=g)
    labels = torch.randint(0, 2, (64,), generator=g)
    ids[labels == 1, 3] = 1  # class 1 carries token 1 at position 3
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss = model(ids, labels=labels).loss
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
    weights = model(ids, output_attentions=True).attentions[0]
    assert (weights == 0).any()  # sparsemax's exact zeros once the scores have spread
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


def test_a_learned_part_trains_with_the_model_and_capture_sees_the_weights():
    model = _bert()
    swap_attention(model, align=ak.alignments.Softmax(1.0, learnable=True, dtype=torch.float64))
    assert any(n.startswith("attnkit_attention.") for n, _ in model.named_parameters())
    ids, mask = _inputs()
    with ak.evaluation.capture(model) as records:
        model(ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert model.attnkit_attention["align"].log_temperature.grad is not None
    assert set(records) == {"encoder.layer.0.attention.self", "encoder.layer.1.attention.self"}


def test_refusals():
    with pytest.raises(TypeError, match="transformers PreTrainedModel"):
        swap_attention(torch.nn.Linear(2, 2))

    class Own(transformers.PreTrainedModel):
        config_class = BertConfig
        _supports_attention_backend = False

        def __init__(self, config):
            super().__init__(config)
            self.layer = torch.nn.Linear(2, 2)

    with pytest.raises(ValueError, match="Own computes its attention in its own code"):
        swap_attention(Own(BertConfig(vocab_size=4, hidden_size=4, num_attention_heads=1)))


def test_scaled_dot_softmax_by_name_is_the_same_model_in_float32():
    torch.manual_seed(0)
    model = _bert().float()
    ids, mask = _inputs()
    ref = model(ids, attention_mask=mask).last_hidden_state
    swap_attention(model, score="scaled_dot", align="softmax")
    out = model(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_viz_draws_the_captured_heads_of_a_swapped_model():
    from attnkit import viz

    model = _bert()
    swap_attention(model, align="sparsemax")
    ids, mask = _inputs()
    with ak.evaluation.capture(model) as records:
        model(ids, attention_mask=mask)
    weights = records["encoder.layer.1.attention.self"][0]  # (B, H, M, N)
    fig = viz.head_grid(weights[1])
    shown = [ax for ax in fig.axes if ax.get_visible() and ax.images]
    assert len(shown) == weights.shape[1] == model.config.num_attention_heads
    drawn = shown[0].images[0].get_array()
    np.testing.assert_allclose(drawn, weights[1, 0].detach().numpy())


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        max_position_embeddings=32,
        rope_scaling=None,
        attn_implementation="eager",
    )
    config._experts_implementation = "eager"
    model = GptOssForCausalLM(config).double().eval()
    with torch.no_grad():  # sinks far from 0, so that dropping them shows
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([3.0, -2.0, 0.5, 4.0]))
    return model


def test_attention_sinks_are_kept_logits_weights_and_generation():
    model = _gpt_oss()
    ids, mask = _inputs()
    ref = model(ids, attention_mask=mask, output_attentions=True)
    ref_tokens = model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    swap_attention(model)
    out = model(ids, attention_mask=mask, output_attentions=True)
    keep = mask.bool()
    torch.testing.assert_close(out.logits[keep], ref.logits[keep], atol=1e-6, rtol=1e-6)
    w, w_ref = out.attentions[1], ref.attentions[1]  # (B, H, M, N) without the sink column
    assert w.shape == w_ref.shape == (3, 4, 9, 9)
    torch.testing.assert_close(w[0], w_ref[0], atol=1e-6, rtol=1e-6)
    assert (w[0].sum(-1) < 1).all()  # the sink takes its share of every row
    got = model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, ref_tokens)


def test_attention_sinks_with_sparsemax_are_an_extra_zero_value_key():
    from entmax import sparsemax

    from attnkit.integrations.transformers import _attention_function

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 5, 3, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64)  # 2 key/value heads
    v = torch.randn(2, 2, 5, 3, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, 5, 5, dtype=torch.float64).masked_fill(~allowed, -1e300)
    module = torch.nn.Module().eval()
    fn = _attention_function(None, ak.alignments.build("sparsemax"), None)
    context, weights = fn(module, q, k, v, additive, 0.5, s_aux=sinks, output_attentions=True)
    # Reference: sparsemax over [scores, sink] per row, sink column dropped.
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    e = (q @ kk.transpose(-1, -2) * 0.5).masked_fill(~allowed, -1e300)
    e = torch.cat([e, sinks.view(1, 4, 1, 1).expand(2, 4, 5, 1)], dim=-1)
    p = sparsemax(e, dim=-1)[..., :-1]
    torch.testing.assert_close(weights, p)
    torch.testing.assert_close(context, (p @ vv).transpose(1, 2))


def test_a_model_known_not_to_be_reproduced_is_refused_by_name(monkeypatch):
    import attnkit.integrations.transformers as tf

    monkeypatch.setitem(tf.NOT_EXACT, "BertModel", "its pooler reads something else")
    with pytest.raises(ValueError, match="BertModel: its pooler reads something else"):
        swap_attention(_bert())


def test_an_encoder_without_is_causal_stays_bidirectional_and_a_decoder_stays_causal():
    # With no padding the mask builder hands no mask: the swapped encoder must still see
    # every key (a future token changes an earlier output) and the decoder none ahead.
    model = _bert()
    for m in model.modules():
        if hasattr(m, "is_causal"):
            del m.is_causal  # as Splinter's, ALIGN's or CLAP's attention
    swap_attention(model)
    ids = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(5))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 40
    a, b = model(ids).last_hidden_state, model(changed).last_hidden_state
    assert (a[0, 0] - b[0, 0]).abs().max() > 1e-6


# The per-call route: the kernels' direct entry, as a layer's plan takes it.


def _no_general_path(monkeypatch):
    """Make attnkit.attention (the validated general call) fail, so that a call that still
    works went through the kernel's direct entry."""
    import attnkit.integrations.transformers as tf

    def refuse(*args, **kwargs):
        raise AssertionError("the general path was taken")

    monkeypatch.setattr(tf, "attention", refuse)


def _seen_by_sdpa(monkeypatch) -> list[dict]:
    """The keyword arguments of each torch SDPA call attnkit's SDPA kernel makes."""
    from attnkit.kernels import sdpa

    seen: list[dict] = []
    real = sdpa.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append({"k": k, **kwargs})
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", spy)
    return seen


def test_the_swapped_model_takes_the_direct_entry_and_is_exact(monkeypatch):
    model = gpt2_eager()
    ids, mask = ids_and_padding()
    keep = mask.bool()
    ref = model(ids, attention_mask=mask).logits
    ref_plain = model(ids).logits
    ref_tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    swap_attention(model)
    _no_general_path(monkeypatch)
    out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[keep], ref[keep], **TIGHT)
    torch.testing.assert_close(model(ids).logits, ref_plain, **TIGHT)
    tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)


def test_per_layer_scaling_is_the_models(monkeypatch):
    # GPT-2 can divide each layer's scores by its index + 1: a scale per layer.
    model = gpt2_eager(scale_attn_by_inverse_layer_idx=True)
    ids, _ = ids_and_padding()
    ref = model(ids).logits
    swap_attention(model)
    _no_general_path(monkeypatch)
    torch.testing.assert_close(model(ids).logits, ref, **TIGHT)


@pytest.mark.parametrize("side", ["none", "right", "left"])
def test_each_mask_route_is_exact(monkeypatch, side):
    # No padding: the exactly causal mask runs in SDPA's causal mode. Right padding leaves every
    # query row a key: the model's additive mask goes to SDPA as it is. Left padding gives the
    # padded rows none: the boolean mask, and those rows are 0.
    model = gpt2_eager()
    ids, mask = ids_and_padding()
    if side == "none":
        mask = torch.ones_like(mask)
    elif side == "left":
        mask = mask.flip(-1)
    keep = mask.bool()
    ref = model(ids, attention_mask=mask).logits
    swap_attention(model)
    _no_general_path(monkeypatch)
    seen = _seen_by_sdpa(monkeypatch)
    out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[keep], ref[keep], **TIGHT)
    assert len(seen) == 2  # one call per layer
    for call in seen:
        got = call.get("attn_mask")
        if side == "none":
            assert call.get("is_causal") is True and got is None
        elif side == "right":
            assert got.dtype == torch.float64 and bool((got == torch.finfo(got.dtype).min).any())
        else:
            assert got.dtype == torch.bool


def test_grouped_query_heads_reach_sdpa_ungrouped_and_stay_exact(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",  # (Llama's eager attention takes its softmax in float32)
    )
    model = LlamaForCausalLM(config).double().eval()
    ids, mask = ids_and_padding()
    keep = mask.bool()
    ref = model(ids, attention_mask=mask).logits
    ref_tokens = model.generate(ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
    swap_attention(model)
    _no_general_path(monkeypatch)
    seen = _seen_by_sdpa(monkeypatch)
    out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[keep], ref[keep], **TIGHT)
    assert [call["k"].shape[1] for call in seen] == [2, 2]  # k and v were not repeated
    assert all(call.get("enable_gqa") for call in seen)
    tokens = model.generate(ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)


def test_a_call_the_direct_entry_leaves_goes_through_attnkit_attention(monkeypatch):
    # sparsemax is no softmax: the direct entry declines and the general call evaluates it.
    import attnkit.integrations.transformers as tf

    model = gpt2_eager()
    ids, mask = ids_and_padding()
    swap_attention(model, align="sparsemax")
    calls = []
    real = tf.attention
    monkeypatch.setattr(tf, "attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = model(ids, attention_mask=mask).logits
    assert len(calls) == 2 and bool(torch.isfinite(out).all())
