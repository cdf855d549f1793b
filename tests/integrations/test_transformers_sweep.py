"""The sweep over transformers' architectures: every model type it builds is either exact
(swapped == the model's own eager path in float64, with and without padding, and greedy cached
generation for decoders) or refused by swap_attention; none differs.

The default run covers a representative subset (encoder, decoder, grouped-query decoder,
encoder-decoders, soft-capping with sliding windows, attention sinks, vision) and the models
whose causality or sinks were once lost; the full sweep is marked slow."""

from __future__ import annotations

import pytest
import transformers

from attnkit.integrations import transformers_sweep as sweep

transformers.logging.set_verbosity_error()

SUBSET = {
    "bert": "encoder",
    "vit": "encoder",
    "mistral": "decoder",  # grouped-query heads (4 query heads, 2 key/value heads)
    "gemma2": "decoder",  # soft-capping, sliding windows
    "gpt_oss": "decoder",  # attention sinks, sliding windows, grouped-query heads
    "t5": "encoder-decoder",  # relative position bias
    "bart": "encoder-decoder",
    "splinter": "encoder",  # no is_causal attribute: bidirectional
    "align": "text tower",  # likewise
    "clap": "text tower",  # likewise
    "pegasus_x": "encoder-decoder",  # decoder self-attention with is_causal=False: causal mask
    "nllb-moe": "encoder-decoder",  # its router reads the eager padding mask
}


@pytest.mark.parametrize("model_type", sorted(SUBSET))
def test_representative_models_are_exact(model_type):
    row = sweep.check(model_type)
    assert (row.status, row.kind) == ("exact", SUBSET[model_type]), row


def test_the_small_configs_exercise_what_they_should():
    mistral = sweep.small_config("mistral")
    assert (mistral.num_attention_heads, mistral.num_key_value_heads) == (4, 2)
    gpt_oss = sweep.small_config("gpt_oss")
    assert gpt_oss.sliding_window < 7 and "sliding_attention" in gpt_oss.layer_types
    assert gpt_oss.num_hidden_layers == len(gpt_oss.layer_types) == 2


def test_a_model_whose_attention_is_not_swapped_exactly_is_reported_as_differing(monkeypatch):
    # The check must be able to fail: a swap that drops the sinks is caught.
    import attnkit.integrations.transformers as tf

    real = tf._with_sink

    def without_sink(heads, key, value, mask, bias, sinks):
        return real(heads, key, value, mask, bias, sinks.detach() * 0 - 1e4)

    monkeypatch.setattr(tf, "_with_sink", without_sink)
    row = sweep.check("gpt_oss")
    assert row.status == "differs", row


def test_refused_and_unbuildable_models_are_rows_not_errors(monkeypatch):
    import attnkit.integrations.transformers as tf

    monkeypatch.setitem(tf.NOT_EXACT, "BertModel", "a reason")
    row = sweep.check("bert")
    assert row.status == "refused" and "BertModel" in row.detail and "a reason" in row.detail
    row = sweep.check("no-such-model-type")
    assert row.status == "not built"


def test_an_isolated_check_gives_the_same_row_and_survives_its_process():
    assert sweep.check_isolated("bert") == sweep.check("bert")
    row = sweep.check_isolated("bert", timeout=1e-3)
    assert row.status == "not built" and "not done in" in row.detail


def test_to_markdown_counts_the_statuses():
    rows = [
        sweep.Row("a", "A", "encoder", "exact", "x"),
        sweep.Row("b", "B", "decoder", "refused", "y|z"),
        sweep.Row("c", "C", "?", "not built", "w"),
    ]
    text = sweep.to_markdown(rows)
    assert "| b | B | decoder | refused | y\\|z |" in text
    assert "3 model types: 1 exact, 1 not built, 1 refused." in text


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sweep.model_types())
def test_every_architecture_is_exact_refused_or_not_built(model_type):
    row = sweep.check_isolated(model_type)
    assert row.status in {"exact", "refused", "not built"}, row
