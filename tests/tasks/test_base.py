"""The task registry and the contract every registered task keeps."""

import dataclasses
import math

import pytest
import torch

from attnkit import tasks
from attnkit.experiments.config import RunConfig
from attnkit.tasks.base import Metric, Task, setting

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


def test_gold_alignment_is_derived_from_the_gold_method():
    for name in tasks.available():
        cls = tasks.get(name)
        assert cls.gold_alignment == (cls.gold is not Task.gold), name
        if cls.gold_alignment:
            assert cls.supervised_weights is not Task.supervised_weights, name
    with pytest.raises(TypeError, match="declares gold_alignment = True but does not implement"):
        type("Flagged", (Task,), {"gold_alignment": True})
    with pytest.raises(TypeError, match=r"implements gold.*but not supervised_weights"):
        type("Half", (Task,), {"gold": lambda self, split, index: None})


def _kl_by_rows(weights, gold):
    """KL(gold ‖ weights) from its definition, one row at a time (float64): the gold row
    normalised, Σ g log(g / a) over its support, averaged over the rows with gold."""
    w = weights.detach().double().reshape(-1, weights.shape[-1])
    g = gold.double().expand(weights.shape).reshape(-1, weights.shape[-1])
    total, rows = 0.0, 0
    for a, r in zip(w.tolist(), g.tolist(), strict=True):
        mass = sum(r)
        if mass > 0:
            pairs = zip(r, a, strict=True)
            total += sum(x / mass * math.log(x / mass / y) for x, y in pairs if x > 0)
            rows += 1
    return total / rows


SUPERVISED = {"babi", "babi-counting", "babi-yes-no", "copy", "dates", "digits", "kv-recall",
              "mqar", "pairs", "rationale"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SUPERVISED))
def test_the_base_adds_the_supervision_once(name):
    """loss(λ) − loss(0) = λ · KL(gold ‖ weights), the KL computed here from its definition."""
    torch.manual_seed(0)
    plain = tasks.get(name)(RunConfig(task=name, **SMALL).resolved())
    supervised = tasks.get(name)(RunConfig(task=name, supervise_attention=0.5, **SMALL).resolved())
    model = plain.build_model()
    index = torch.tensor([2, 0, 3])
    weights = supervised.supervised_weights(model, "train", index)
    gold = supervised.gold("train", index)
    assert gold.dtype == torch.bool or not bool((gold < 0).any())
    assert torch.broadcast_shapes(gold.shape, weights.shape) == weights.shape
    expected = plain.loss(model, index).detach() + 0.5 * _kl_by_rows(weights, gold)
    torch.testing.assert_close(
        supervised.loss(model, index).detach(), expected, rtol=1e-5, atol=1e-6
    )


def test_the_supervised_tasks_are_the_tasks_with_gold():
    from attnkit.experiments.config import supervision_support

    support = supervision_support()
    assert {n for n, accepted in support.items() if accepted} == SUPERVISED
    assert set(support) == {n for n in tasks.available() if tasks.get(n).gold_alignment}


def test_the_experiments_guide_lists_the_supervision_of_every_task_with_gold():
    import re
    from pathlib import Path

    from attnkit.experiments.config import supervision_support

    text = (Path(__file__).parents[2] / "docs" / "experiments.md").read_text(encoding="utf-8")
    section = text.split("### Attention supervision", 1)[1].split("\n### ", 1)[0]
    listed = {}
    for task, accepted in re.findall(r"^\| `([^`]+)` \| ([^|]*) \|", section, re.M):
        listed[task] = tuple(re.findall(r"`([^`]+)`", accepted))
    assert listed == supervision_support()


@dataclasses.dataclass(frozen=True)
class _Sizes:
    pairs: int = setting(4, "pairs in a sequence")
    keys: int | None = setting(None, "key tokens; None: twice the pairs")
    scale: float = setting(1.0, "range of the numbers")
    flag: bool = setting(False, "a switch")

    def __post_init__(self):
        if self.pairs < 2:
            raise ValueError(f"setting pairs must be >= 2, got {self.pairs}")


class _SizedTask(Task):
    settings = _Sizes


def test_settings_resolve_defaults_and_values_by_name():
    assert _SizedTask.resolve_settings(None) == _Sizes()
    got = _SizedTask.resolve_settings({"pairs": 7, "scale": 2, "keys": None})
    assert (got.pairs, got.keys, got.flag) == (7, None, False)
    assert got.scale == 2.0 and isinstance(got.scale, float)  # an int is a number
    config = RunConfig(task="dates", settings={"pairs": 3})
    assert _SizedTask(config).settings == _Sizes(pairs=3)  # the instance holds the dataclass
    assert Task.resolve_settings({}) is None  # a task without settings


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"pair": 3}, "has no setting 'pair'; did you mean 'pairs'? (its settings: pairs, keys"),
        ({"pairs": "3"}, "setting pairs of task '_SizedTask' must be int, got str '3'"),
        ({"pairs": True}, "setting pairs of task '_SizedTask' must be int, got bool"),
        ({"keys": 2.5}, "setting keys of task '_SizedTask' must be int or None, got float"),
        ({"pairs": 1}, "setting pairs must be >= 2, got 1"),  # the dataclass's own check
    ],
)
def test_unknown_settings_and_bad_values_are_refused_naming_them(values, message):
    with pytest.raises(ValueError) as err:
        _SizedTask.resolve_settings(values)
    assert message in str(err.value)


def test_a_setting_is_parsed_from_text_by_its_type():
    assert _SizedTask.parse_setting("pairs", "12") == 12
    assert _SizedTask.parse_setting("keys", "none") is None
    assert _SizedTask.parse_setting("scale", "0.5") == 0.5
    assert _SizedTask.parse_setting("flag", "true") is True
    with pytest.raises(ValueError, match="setting pairs of task '_SizedTask' must be int"):
        _SizedTask.parse_setting("pairs", "x")
    with pytest.raises(ValueError, match="has no setting 'size'"):
        _SizedTask.parse_setting("size", "1")
    assert _SizedTask.settings_help()[0] == "pairs = 4: pairs in a sequence"


@pytest.mark.parametrize(
    ("decorator", "annotation", "body", "message"),
    [
        (dataclasses.dataclass, "int", {"n": 1}, "must be frozen"),
        (dataclasses.dataclass(frozen=True), "int", {}, "has no default"),
        (dataclasses.dataclass(frozen=True), "bytes", {"n": b""}, "must be annotated bool, int"),
        (lambda c: c, "int", {"n": 1}, "must be a frozen dataclass or None"),
    ],
)
def test_a_settings_class_outside_the_contract_is_refused_when_the_task_is_defined(
    decorator, annotation, body, message
):
    cls = decorator(type("S", (), {"__annotations__": {"n": annotation}, **body}))
    with pytest.raises(TypeError, match=message):
        type("Bad", (Task,), {"settings": cls})


@pytest.mark.parametrize("name", [n for n in tasks.available() if tasks.get(n).settings])
def test_every_task_setting_has_a_default_its_checks_accept_and_a_help_line(name):
    cls = tasks.get(name)
    defaults = cls.resolve_settings({})
    assert dataclasses.is_dataclass(defaults)
    for _, (_, _, text) in cls.setting_fields().items():
        assert text
