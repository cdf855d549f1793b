"""Saving and loading a swapped Hugging Face model: parts given as specs are described in the
config, built per attention layer, written by ``save_pretrained`` and loaded back by
``attnkit.integrations.transformers.from_pretrained`` with identical outputs; parts that cannot
be described make saving raise."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
)

import attnkit as ak
from attnkit.integrations import transformers as hf

transformers.logging.set_verbosity_error()

HEADS, HEAD_DIM = 4, 4
ADDITIVE = {"name": "additive", "d_q": HEAD_DIM, "d_k": HEAD_DIM, "d_w": 6, "num_heads": HEADS}
LEARNED_T = {"name": "softmax", "temperature": 0.7, "learnable": True}


def _bert(cls=BertModel):
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=40,
        hidden_size=HEADS * HEAD_DIM,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return cls(config)


def _gpt2():
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0
    )
    config.embd_pdrop = config.attn_pdrop = 0.0
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    return GPT2LMHeadModel(config)


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


def _part_params(model):
    return {n: p for n, p in model.named_parameters() if ".attnkit_" in n}


def _train_parts(model, loss_fn):
    """One Adam step on the attnkit parameters only, so that they leave their initial values."""
    params = _part_params(model)
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = torch.optim.Adam(params.values(), lr=0.05)
    model.train()
    loss_fn(model).backward()
    opt.step()
    model.eval()
    for n, p in params.items():
        assert not torch.equal(p, before[n]), n  # every part parameter got a gradient and moved


def test_bert_additive_score_and_learned_temperature_round_trip(tmp_path):
    model = _bert()
    ids, mask = _inputs()
    hf.swap_attention(model, score=ADDITIVE, align=LEARNED_T)
    params = _part_params(model)
    # One score and one temperature per attention layer, trainable, in model.parameters().
    layers = [f"encoder.layer.{i}.attention.self" for i in range(2)]
    expected = {f"{layer}.attnkit_align.log_temperature" for layer in layers}
    assert expected <= set(params)
    assert {n for n in params if ".attnkit_score." in n} == {
        f"{layer}.attnkit_score.{n}"
        for layer in layers
        for n, _ in ak.scores.build(**ADDITIVE).named_parameters()
    }
    all_params = {id(p) for p in model.parameters()}
    assert all(p.requires_grad and id(p) in all_params for p in params.values())
    score0 = model.encoder.layer[0].attention.self.attnkit_score
    assert score0 is not model.encoder.layer[1].attention.self.attnkit_score

    _train_parts(model, lambda m: m(ids, attention_mask=mask).last_hidden_state.pow(2).mean())
    ref = model(ids, attention_mask=mask).last_hidden_state
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())["attnkit_swap"]
    assert saved == {"score": ADDITIVE, "align": LEARNED_T, "kernel": None}

    loaded, info = hf.from_pretrained(BertModel, tmp_path, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert loaded.config._attn_implementation.startswith("attnkit-")
    got = loaded.state_dict()
    assert set(got) == set(model.state_dict())
    for name, value in model.state_dict().items():
        assert torch.equal(got[name], value), name
    assert torch.equal(loaded(ids, attention_mask=mask).last_hidden_state, ref)

    # transformers' own loader builds the model without the parts: the outputs differ, so the
    # comparison above depends on the parts' weights being loaded.
    plain = BertModel.from_pretrained(tmp_path)
    assert not any(".attnkit_" in n for n in plain.state_dict())
    assert not torch.allclose(plain(ids, attention_mask=mask).last_hidden_state, ref)


def test_gpt2_learned_entmax_round_trip_logits_and_generation(tmp_path):
    model = _gpt2()
    ids, mask = _inputs()
    align = {"name": "entmax", "alpha": 1.3, "learnable": True, "n_iter": 30}
    hf.swap_attention(model, score={"name": "scaled_dot"}, align=align)
    rhos = _part_params(model)
    assert set(rhos) == {f"transformer.h.{i}.attn.attnkit_align.rho" for i in range(2)}

    _train_parts(model, lambda m: m(ids, attention_mask=mask, labels=ids).loss)
    ref = model(ids, attention_mask=mask).logits
    ref_tokens = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
    model.save_pretrained(tmp_path)

    loaded = hf.from_pretrained(GPT2LMHeadModel, tmp_path)
    for name, p in _part_params(loaded).items():
        assert torch.equal(p, rhos[name]), name
    assert torch.equal(loaded(ids, attention_mask=mask).logits, ref)
    assert torch.equal(loaded.generate(ids[:1], max_new_tokens=3, do_sample=False), ref_tokens)


def test_parameter_free_parts_are_described_and_shared(tmp_path):
    model = _bert().eval()
    ids, mask = _inputs()
    hf.swap_attention(model, score="cosine", align="sparsemax")
    assert not _part_params(model)  # nothing to learn: one part serves every layer
    ref = model(ids, attention_mask=mask).last_hidden_state
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(BertModel, tmp_path)
    assert loaded.config.attnkit_swap["align"] == {"name": "sparsemax"}
    assert torch.equal(loaded(ids, attention_mask=mask).last_hidden_state, ref)


def test_a_sharded_base_checkpoint_loads_into_a_model_with_a_head(tmp_path):
    model = _bert()
    hf.swap_attention(model, align=LEARNED_T)
    with torch.no_grad():
        model.encoder.layer[1].attention.self.attnkit_align.log_temperature.fill_(0.25)
    model.save_pretrained(tmp_path, max_shard_size="2KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").exists()
    head = hf.from_pretrained(BertForSequenceClassification, tmp_path)
    t = head.bert.encoder.layer[1].attention.self.attnkit_align.log_temperature
    assert t.item() == 0.25


def test_a_second_swap_replaces_the_parts_of_the_first():
    model = _bert()
    hf.swap_attention(model, score=ADDITIVE, align=LEARNED_T)
    hf.swap_attention(model, align={"name": "entmax", "learnable": True})
    names = set(_part_params(model))
    assert names == {f"encoder.layer.{i}.attention.self.attnkit_align.rho" for i in range(2)}
    assert model.config.attnkit_swap["score"] is None


def test_parts_that_cannot_be_described_refuse_to_save(tmp_path):
    model = _bert()
    # A module: trains with the model, but the config cannot describe it.
    hf.swap_attention(model, align=ak.alignments.Softmax(0.5, learnable=True))
    assert any(n.startswith("attnkit_attention.") for n, _ in model.named_parameters())
    assert not hasattr(model.config, "attnkit_swap")
    with pytest.raises(ValueError, match=r"align= was given as a module \(Softmax\)"):
        model.save_pretrained(tmp_path / "module")
    assert not (tmp_path / "module").exists()

    # A spec whose argument JSON cannot hold (a callable activation).
    spec = {**ADDITIVE, "activation": torch.tanh}
    hf.swap_attention(model, score=spec)
    with pytest.raises(ValueError, match=r"score spec .* JSON cannot hold"):
        model.save_pretrained(tmp_path / "callable")
    assert not (tmp_path / "callable").exists()

    # Switched back to eager with the parts still attached.
    hf.swap_attention(model, align=LEARNED_T)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="switched to 'eager' after swap_attention"):
        model.save_pretrained(tmp_path / "eager")


def test_bad_specs_and_a_checkpoint_without_a_swap(tmp_path):
    model = _bert().eval()
    ids, mask = _inputs()
    hf.swap_attention(model, align=LEARNED_T)
    before = model(ids, attention_mask=mask).last_hidden_state
    with pytest.raises(ValueError, match="leave it out"):
        hf.swap_attention(model, align={**LEARNED_T, "dtype": "float64"})
    with pytest.raises(TypeError, match="must hold 'name'"):
        hf.swap_attention(model, align={"temperature": 2.0})
    with pytest.raises(ValueError, match="unknown alignment 'softmx'"):
        hf.swap_attention(model, align={"name": "softmx"})
    with pytest.raises(TypeError, match="unexpected argument 'd_hidden'"):
        hf.swap_attention(model, score={**ADDITIVE, "d_hidden": 3})
    with pytest.raises(TypeError, match="spec dict"):
        hf.swap_attention(model, align=3)
    # A refused swap leaves the earlier one in place.
    assert torch.equal(model(ids, attention_mask=mask).last_hidden_state, before)
    assert model.config.attnkit_swap["align"] == LEARNED_T

    plain = _bert()  # never swapped
    plain.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has no 'attnkit_swap'"):
        hf.from_pretrained(BertModel, tmp_path)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _transformers_warnings(load):
    """The warnings transformers logs while ``load()`` runs (its verbosity set to warning)."""
    handler = _Records()
    logger = logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        result = load()
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)
    return result, "\n".join(handler.messages)


@pytest.mark.parametrize("align", ["sparsemax", {"name": "entmax", "learnable": True}])
def test_plain_transformers_loading_a_swapped_checkpoint_warns_naming_attnkits_loader(
    tmp_path, align
):
    # Even a swap without weights of its own (sparsemax): transformers' loader would give the
    # softmax model silently, so the checkpoint carries a marker whose key names the loader.
    model = _bert(BertForSequenceClassification).eval()
    ids, mask = _inputs()
    hf.swap_attention(model, align=align)
    ref = model(ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path)
    plain, said = _transformers_warnings(
        lambda: BertForSequenceClassification.from_pretrained(tmp_path)
    )
    assert "attnkit_swap_load_with.attnkit.integrations.transformers.from_pretrained" in said
    assert "UNEXPECTED" in said
    assert not torch.allclose(plain(ids, attention_mask=mask).logits, ref)
    note = (tmp_path / "README.md").read_text()
    assert "from_pretrained(BertForSequenceClassification" in note
    # attnkit's loader: no warning, the same logits.
    loaded, said = _transformers_warnings(
        lambda: hf.from_pretrained(BertForSequenceClassification, tmp_path)
    )
    assert "UNEXPECTED" not in said
    assert torch.equal(loaded(ids, attention_mask=mask).logits, ref)


def test_a_spec_built_at_the_models_sizes_round_trips(tmp_path):
    model = _bert().eval()
    ids, mask = _inputs()
    sizes = {"head_dim": HEAD_DIM, "num_heads": HEADS, "max_len": 32}
    hf.swap_attention(model, score={"name": "additive", "for_heads": sizes})
    score = model.encoder.layer[0].attention.self.attnkit_score
    expected = ak.scores.REGISTRY.get("additive").for_heads(**sizes)
    assert {n: p.shape for n, p in score.named_parameters()} == {
        n: p.shape for n, p in expected.named_parameters()
    }
    ref = model(ids, attention_mask=mask).last_hidden_state
    model.save_pretrained(tmp_path)
    loaded = hf.from_pretrained(BertModel, tmp_path)
    assert torch.equal(loaded(ids, attention_mask=mask).last_hidden_state, ref)
    with pytest.raises(TypeError, match="'for_heads' must be a dict of sizes"):
        hf.swap_attention(model, score={"name": "additive", "for_heads": 4})


def test_a_shared_part_replaced_on_the_model_is_the_one_used():
    # uniform_weights replaces the model's shared alignment: the swap reads it at each call.
    model = _bert().eval()
    ids, mask = _inputs()
    hf.swap_attention(model, align="sparsemax")
    with ak.evaluation.capture(model) as records, ak.evaluation.uniform_weights(model):
        model(ids, attention_mask=mask)
    keep = mask.bool()[:, None, None, :].expand(3, HEADS, 9, 9)
    for weights in records.values():
        w = weights[0]
        expected = keep.double() / keep.sum(-1, keepdim=True)
        torch.testing.assert_close(w.double(), expected, rtol=0, atol=1e-6)
    with ak.evaluation.capture(model) as records:
        model(ids, attention_mask=mask)
    uniform = keep.double() / keep.sum(-1, keepdim=True)
    for weights in records.values():  # sparsemax again
        assert not torch.allclose(weights[0].double(), uniform, atol=1e-3)
