"""The task registry and the contract every registered task keeps."""

import pytest
import torch

from attnkit import tasks
from attnkit.experiments.config import RunConfig
from attnkit.tasks.base import Metric, Task

SMALL = {"n_train": 8, "n_test": 4, "batch_size": 4, "d_model": 8, "epochs": 1}


def test_available_and_unknown_names():
    assert {"dates", "digits"} <= set(tasks.available())
    with pytest.raises(ValueError, match="did you mean 'digits'"):
        tasks.get("digit")


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        tasks.REGISTRY.register("dates")(type("Other", (Task,), {}))


def test_metric_direction_is_checked():
    assert Metric("m").reading == "higher is better"
    assert Metric("m", "lower").reading == "lower is better"
    assert Metric("m", None).reading == "descriptive"
    with pytest.raises(ValueError, match="better must be"):
        Metric("m", "up")


@pytest.mark.parametrize("name", tasks.available())
def test_every_task_keeps_the_contract(name, tmp_path):
    cls = tasks.get(name)
    assert cls.description
    assert set(cls.defaults) == {"full", "quick"}
    for defaults in cls.defaults.values():
        assert set(defaults) <= set(RunConfig.names())
    config = RunConfig(task=name, **SMALL, **cls.example_settings(tmp_path)).resolved()
    task = cls(config)
    torch.manual_seed(0)
    model = task.build_model()
    assert task.n_train() == SMALL["n_train"]
    loss = task.loss(model, torch.arange(4))
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert task.has_split("validation") and task.has_split("test")
    assert set(task.evaluate(model, "validation")) <= set(cls.metrics)
    final = task.final_metrics(model)
    assert set(final) == set(cls.metrics)
    maps = task.heatmaps(model, n=2)
    assert len(maps) == 2
    for item in maps:
        assert item["weights"].ndim == 2 and item["gold"].shape == item["weights"].shape
        assert item["title"] and item["x_title"] and item["y_title"]
        assert ("image" in item) != ("x_labels" in item)


REFUSED = {("babi-counting", "memory_network")}  # a varying number of supporting facts


def _configs():
    for name in tasks.available():
        for attention in ("default", *tasks.get(name).attentions):
            if (name, attention) not in REFUSED:
                yield name, attention


@pytest.mark.parametrize(("name", "attention"), list(_configs()))
def test_unused_keys_are_run_keys_with_reasons_and_are_recorded_unset(name, attention, tmp_path):
    from attnkit.tasks.base import Unused

    example = tasks.get(name).example_settings(tmp_path)
    config = RunConfig(task=name, attention=attention, quick=True, **example).resolved()
    filled = RunConfig(**{**config.__dict__, "score": config.score or "additive",
                          "align": config.align or "softmax"})  # fmt: skip
    unused = tasks.get(name).unused(filled)
    assert set(unused) <= set(RunConfig.names())
    for key, reason in unused.items():
        assert isinstance(reason, Unused) and reason.by and reason.why
        assert getattr(config, key) is None
    for key in {"score", "align"} - set(unused):
        assert getattr(config, key) is not None
