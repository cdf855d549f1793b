"""The dates-lm task: lines, prompts, KV-cached generation, gold placement, validation."""

import math

import pytest
import torch

from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.dates import Vocab
from attnkit.tasks.dates_lm_task import DatesLMTask

SMALL = {"n_train": 8, "n_test": 6, "batch_size": 4, "d_model": 16, "epochs": 1}


@pytest.fixture(scope="module")
def task():
    return DatesLMTask(RunConfig(task="dates-lm", score="scaled_dot", **SMALL).resolved())


def test_lines_are_start_written_date_equals_iso_end(task):
    e = task.splits["test"][0]
    ids = task.encoded["test"][0].tolist()
    assert ids[0] == Vocab.BOS
    assert task.vocab.decode(ids) == f"{e.text}={e.target}\n"
    assert all(i == Vocab.PAD for i in ids[len(e.text) + len(e.target) + 3 :])


def test_untrained_perplexity_is_near_the_vocabulary_size(task):
    # Small initial weights: every next character is about equally likely, perplexity ≈ |V|.
    torch.manual_seed(0)
    ppl = task.evaluate(task.build_model(), "test")["perplexity"]
    assert abs(math.log(ppl) - math.log(len(task.vocab))) < 0.1


def test_generation_uses_the_cache_and_matches_recomputation(task):
    torch.manual_seed(0)
    model = task.build_model().eval()
    examples = task.splits["test"]
    written = task._generate(model, examples)
    for e, w in zip(examples, written, strict=True):
        prompt = torch.tensor([[Vocab.BOS, *task.vocab.encode(e.text + "=")]])
        full = model.generate(prompt, 10, use_cache=False)[0, prompt.shape[1] :].tolist()
        assert w == task.vocab.decode(full)


def test_gold_links_copied_digits_to_the_characters_they_copy(task):
    torch.manual_seed(0)
    maps = task.heatmaps(task.build_model(), n=4)
    checked = 0
    for item in maps:
        rows, cols = item["gold"].nonzero()
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            # Position r predicts character r + 1. A link to one written character is a copy,
            # except the "0" padding an unpadded one-digit day or month, read from its field.
            assert item["y_labels"][r][1:] in "0123456789-"
            if item["gold"][r].sum() == 1 and item["y_labels"][r] != "→0":
                assert item["y_labels"][r] == "→" + item["x_labels"][c]
                checked += 1
        assert item["weights"].shape == item["gold"].shape
    assert checked > 0


def test_causal_scores_only():
    with pytest.raises(ConfigError, match=r"convolutional.*causal"):
        RunConfig(task="dates-lm", score="convolutional", **SMALL).resolved()


def test_position_key_is_checked():
    with pytest.raises(ConfigError, match=r"task 'dates' takes no position scheme.*dates-lm"):
        RunConfig(task="dates", position="none", **SMALL).resolved()
    with pytest.raises(ConfigError, match="position scheme"):
        RunConfig(task="dates-lm", score="scaled_dot", position="nonsense", **SMALL).resolved()
    config = RunConfig(task="dates-lm", score="scaled_dot", position="none", **SMALL).resolved()
    model = DatesLMTask(config).build_model()
    assert model.positions is None  # the scheme replaces the learned table
    assert type(model.decoder.layers[0].self_attention.module.position).__name__ == "NoPosition"
