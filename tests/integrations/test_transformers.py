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
