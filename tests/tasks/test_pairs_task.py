"""The ``pairs`` task: generated pairs, labels and gold alignments checked token by token; the
metrics of a model that answers by construction; the ``attention`` key."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.pairs_task import PairsModel, make_pairs


def test_pairs_labels_and_gold_alignments():
    data = make_pairs(200, seed=0)
    p, h = data["premise"], data["hypothesis"]
    pm, hm, gold = data["premise_mask"], data["hypothesis_mask"], data["gold"]
    assert p.shape == (200, 8) and h.shape == (200, 3) and gold.shape == (200, 3, 8)
    assert set(pm.sum(-1).tolist()) == set(range(4, 9)) and set(hm.sum(-1).tolist()) == {1, 2, 3}
    assert 60 < int(data["label"].sum()) < 140
    for i in range(200):
        premise = p[i, pm[i]].tolist()
        hypothesis = h[i, hm[i]].tolist()
        assert len(set(premise)) == len(premise)  # distinct premise tokens
        inside = [t in premise for t in hypothesis]
        assert int(data["label"][i]) == all(inside)
        assert sum(inside) >= len(hypothesis) - 1  # at most one token is replaced
        for j, t in enumerate(hypothesis):
            want = [tok == t for tok in p[i].tolist()] if t in premise else [False] * 8
            want = [w and bool(pm[i, k]) for k, w in enumerate(want)]
            assert gold[i, j].tolist() == want
        assert not gold[i, ~hm[i]].any() and (p[i, ~pm[i]] == 0).all()


class _Oracle(torch.nn.Module):
    """Answers by looking the hypothesis tokens up; aligns each to its copy."""

    mechanism = "decomposable"

    def forward(self, premise, hypothesis, premise_mask, hypothesis_mask):
        same = (hypothesis[:, :, None] == premise[:, None, :]) & premise_mask[:, None, :]
        found = same.any(-1) | ~hypothesis_mask
        logits = torch.stack([(~found.all(-1)).double(), found.all(-1).double()], -1)
        weights2 = same.double() + 1e-3 * premise_mask[:, None, :]
        return logits, type("Out", (), {"weights2": weights2})()

    alignment = PairsModel.alignment


def test_metrics_of_an_oracle():
    config = RunConfig(task="pairs", n_train=8, n_test=60, epochs=1, batch_size=4).resolved()
    task = tasks.get("pairs")(config)
    assert task.evaluate(_Oracle(), "test") == {"accuracy": 1.0, "alignment_accuracy": 1.0}


@pytest.mark.parametrize("attention", ["default", "decomposable", "parallel", "nested"])
def test_every_offered_mechanism_trains_a_step(attention):
    config = RunConfig(
        task="pairs", attention=attention, n_train=8, n_test=4, epochs=1, batch_size=4,
        d_model=8,
    ).resolved()  # fmt: skip
    task = tasks.get("pairs")(config)
    model = task.build_model()
    assert model.mechanism == ("decomposable" if attention == "default" else attention)
    task.loss(model, torch.arange(4)).backward()
    assert set(task.evaluate(model, "test")) == {"accuracy", "alignment_accuracy"}


def test_attention_values_are_checked():
    with pytest.raises(ConfigError, match="offers: decomposable, parallel, nested"):
        RunConfig(task="pairs", attention="performer").resolved()
    with pytest.raises(ConfigError, match="not offered by task 'dates'"):
        RunConfig(task="dates", attention="decomposable").resolved()
    with pytest.raises(ConfigError, match="deterministic"):
        RunConfig(task="pairs", align="hard").resolved()


def test_parallel_co_attention_takes_the_run_score_as_co_compatibility():
    config = RunConfig(
        task="pairs", attention="parallel", score="hermitian", n_train=8, n_test=4,
        batch_size=4, d_model=8,
    ).resolved()  # fmt: skip
    model = tasks.get("pairs")(config).build_model()
    assert isinstance(model.pair.affinity, ak.scores.Hermitian)


def test_gold_is_each_hypothesis_tokens_copy_and_supervision_moves_alpha_to_it():
    config = RunConfig(task="pairs", n_train=16, n_test=30, batch_size=4, d_model=8).resolved()
    task = tasks.get("pairs")(config)
    d = task.splits["test"]
    gold = task.gold("test", torch.arange(30))
    for i in range(30):
        for j in range(3):
            for p in range(8):
                copy = bool(d["hypothesis_mask"][i, j] and d["premise_mask"][i, p]) and int(
                    d["hypothesis"][i, j]
                ) == int(d["premise"][i, p])
                assert bool(gold[i, j, p]) == copy
    from supervision_runs import kl_to_gold

    start, plain, supervised = kl_to_gold(
        "pairs", steps=25, n_train=256, n_test=64, batch_size=32, d_model=16
    )
    assert supervised < plain and supervised < 0.8 * start
    with pytest.raises(ConfigError, match="supervise the decomposable mechanism"):
        RunConfig(task="pairs", attention="nested", supervise_attention=1.0).resolved()
