"""The run configuration: task defaults from the registry, every bad value named, strict JSON."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig, check_output_dir, parse_value


@pytest.mark.parametrize("task", tasks.available())
@pytest.mark.parametrize("quick", [False, True])
def test_unset_keys_take_the_task_defaults(task, quick):
    c = RunConfig(task=task, quick=quick).resolved()
    for key, value in tasks.get(task).defaults["quick" if quick else "full"].items():
        assert getattr(c, key) == value
    assert RunConfig(task=task, quick=quick, epochs=1).resolved().epochs == 1


BAD = [
    ({"task": "datse"}, "did you mean 'dates'"),
    ({"score": "additve"}, "did you mean 'additive'"),
    ({"align": "softmx"}, "did you mean 'softmax'"),
    ({"epochs": 0}, "epochs must be a positive int, got 0"),
    ({"batch_size": 0}, "batch_size must be a positive int"),
    ({"n_train": 10, "batch_size": 32}, "no training step would run"),
    ({"d_model": 7}, "d_model must be an even int"),
    ({"seed": 2**64}, "seed must be an int in [0, 2**32)"),
    ({"seed": -1}, "seed must be an int in [0, 2**32)"),
    ({"lr": math.inf}, "lr must be a finite number > 0, got inf"),
    ({"lr": math.nan}, "lr must be a finite number > 0, got nan"),
    ({"lr": 0.0}, "lr must be a finite number > 0"),
    ({"supervise_attention": math.nan}, "supervise_attention must be a finite number >= 0"),
    ({"supervise_attention": -1.0}, "supervise_attention must be a finite number >= 0"),
    ({"task": "digits", "supervise_attention": 1.0}, "needs gold alignments"),
    ({"n_train": 36000, "n_test": 1000}, "exceeds the 36525 distinct dates"),
    ({"epochs": "3"}, "epochs must be int or null, got str '3'"),
    ({"quick": 1}, "quick must be bool, got int 1"),
    ({"epochs": True}, "epochs must be int or null, got bool True"),
]


@pytest.mark.parametrize(("values", "message"), BAD, ids=[str(v) for v, _ in BAD])
def test_a_bad_value_is_named(values, message):
    with pytest.raises(ConfigError) as err:
        RunConfig(**values).resolved()
    assert message in str(err.value)


def test_every_usable_score_and_alignment_resolves():
    import attnkit as ak
    from attnkit.tasks import parts

    for score in parts.usable_scores():
        assert RunConfig(score=score).resolved().score == score
    for align in ak.alignments.available():
        assert RunConfig(align=align).resolved().align == align


def test_json_round_trip():
    c = RunConfig(quick=True, lr=0.01).resolved()
    assert RunConfig.from_json(c.to_json()) == c


JSON = [
    ('{"task": "dates", "depth": 3}', "unknown key 'depth'"),
    ('{"tsak": "dates"}', "did you mean 'task'"),
    ('{"quick": "yes"}', "quick must be bool, got str 'yes'"),
    ('{"lr": "fast"}', "lr must be float or null"),
    ('{"seed": 1.5}', "seed must be int, got float 1.5"),
    ("[1, 2]", "expected a JSON object, got list"),
    ("{oops", "not valid JSON"),
]


@pytest.mark.parametrize(("text", "message"), JSON, ids=[t for t, _ in JSON])
def test_from_json_refuses_unknown_keys_and_wrong_types(text, message):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_json(text, source="run/config.json")
    assert str(err.value).startswith("run/config.json: ") and message in str(err.value)


def test_parse_value_by_the_key_type():
    assert parse_value("lr", "0.5") == 0.5
    assert parse_value("epochs", "3") == 3
    assert parse_value("quick", "true") is True
    assert parse_value("score", "dot") == "dot"
    with pytest.raises(ConfigError, match=r"epochs must be int, got '1\.5'"):
        parse_value("epochs", "1.5")
    with pytest.raises(ConfigError, match="did you mean 'score'"):
        parse_value("scor", "dot")


def test_output_dir_must_be_new_or_empty(tmp_path):
    check_output_dir(tmp_path / "new" / "deeper")
    check_output_dir(tmp_path)  # empty
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"is not empty .*'notes\.txt'.*--resume"):
        check_output_dir(tmp_path)
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        check_output_dir(tmp_path / "notes.txt")
    with pytest.raises(ConfigError, match="not writable"):
        check_output_dir(tmp_path / "notes.txt" / "sub")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=5,
)


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([*RunConfig.names(), "extra"]) | st.text(max_size=6), json_values
    )
)
def test_any_json_object_is_accepted_or_refused_with_a_config_error(data):
    """Whatever a config.json holds, loading and resolving it ends in a RunConfig or a
    ConfigError (which the CLI prints as one line), never another exception."""
    try:
        text = json.dumps(data)
    except ValueError:  # NaN and inf are not JSON
        return
    try:
        RunConfig.from_json(text, source="config.json").resolved()
    except ConfigError as err:
        assert "\n" not in str(err)
