"""The run configuration: task defaults from the registry, every bad value named, strict JSON."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig, check_output_dir, parse_value
from attnkit.tasks import parts


@pytest.mark.parametrize("task", tasks.available())
@pytest.mark.parametrize("quick", [False, True])
def test_unset_keys_take_the_task_defaults(task, quick, tmp_path):
    example = tasks.get(task).example_settings(tmp_path)
    c = RunConfig(task=task, quick=quick, **example).resolved()
    for key, value in tasks.get(task).defaults["quick" if quick else "full"].items():
        assert getattr(c, key) == value
    assert RunConfig(task=task, quick=quick, epochs=1, **example).resolved().epochs == 1


BAD = [
    ({"task": "datse"}, "did you mean 'dates'"),
    ({"score": "additve"}, "did you mean 'additive'"),
    ({"align": "softmx"}, "did you mean 'softmax'"),
    ({"score": "zzz"}, "of your own is known once the module that registers it is imported"),
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
    ({"task": "listops", "supervise_attention": 1.0}, "needs gold alignments"),
    ({"n_train": 36000, "n_test": 1000}, "exceeds the 36525 distinct dates"),
    ({"epochs": "3"}, "epochs must be int or null, got str '3'"),
    ({"quick": 1}, "quick must be bool, got int 1"),
    ({"epochs": True}, "epochs must be int or null, got bool True"),
    # absurd sizes: refused, never trained until killed or failing to allocate
    ({"epochs": 10**22}, "epochs must be at most 100_000 (far above any run that finishes), "
     "got 10000000000000000000000"),
    ({"epochs": 1e22}, "epochs must be int or null, got float 1e+22"),
    ({"d_model": 2**30}, "d_model must be at most 65_536"),
    ({"n_train": 10**12}, "n_train must be at most 1_000_000_000"),
    ({"batch_size": 2**21}, "batch_size must be at most 1_048_576"),
]  # fmt: skip


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


IGNORED = [
    ({"task": "kv-recall", "attention": "performer", "score": "additive"},
     "--score additive contradicts --attention performer"),
    ({"task": "kv-recall", "attention": "linear", "align": "sparsemax"},
     "--align sparsemax contradicts --attention linear"),
    ({"task": "listops", "attention": "nystrom", "score": "scaled_dot"},
     "--score scaled_dot contradicts --attention nystrom"),
    ({"task": "babi", "attention": "memory_network", "score": "dot"},
     "--score dot contradicts --attention memory_network"),
    ({"task": "digits", "attention": "ram", "align": "hard"},
     "--align hard contradicts --attention ram"),
    ({"task": "pairs", "attention": "nested", "score": "dot"},
     "--score dot contradicts --attention nested"),
    ({"task": "pairs", "score": "dot"}, "--score dot contradicts task 'pairs'"),
    ({"task": "copy", "score": "dot"}, "--score dot contradicts task 'copy'"),
    ({"task": "copy", "attention": "lstm", "align": "sparsemax"},
     "--align sparsemax contradicts --attention lstm"),
]  # fmt: skip


@pytest.mark.parametrize(("values", "message"), IGNORED, ids=[str(v) for v, _ in IGNORED])
def test_a_key_the_model_does_not_read_is_refused_naming_both_flags(values, message):
    with pytest.raises(ConfigError) as err:
        RunConfig(**values).resolved()
    assert message in str(err.value)
    flag = message.split()[0]
    assert str(err.value).endswith(f"leave {flag} out")


@pytest.mark.parametrize(
    ("values", "unused"),
    [
        ({"task": "kv-recall", "attention": "performer"}, ("score", "align")),
        ({"task": "babi", "attention": "memory_network"}, ("score", "align")),
        ({"task": "digits", "attention": "ram_centre"}, ("score", "align")),
        ({"task": "copy", "attention": "lstm"}, ("score", "align")),
        ({"task": "copy"}, ("score",)),
        ({"task": "pairs"}, ("score",)),
        ({"task": "pairs", "attention": "parallel"}, ()),
        ({"task": "kv-recall", "attention": "full"}, ()),
        ({"task": "dates"}, ()),
    ],
)
def test_keys_the_model_does_not_read_are_recorded_as_unset(values, unused):
    c = RunConfig(**values).resolved()
    for key in ("score", "align"):
        assert (getattr(c, key) is None) == (key in unused), key
    assert c.resolved() == c  # and resolving again keeps them unset
    assert RunConfig.from_json(c.to_json()).resolved() == c


def test_the_run_name_says_what_runs():
    assert RunConfig(task="dates").resolved().run_name() == "dates-additive-softmax-s0"
    c = RunConfig(task="kv-recall", attention="performer", seed=3).resolved()
    assert c.run_name() == "kv-recall-performer-s3"
    assert RunConfig(task="babi", attention="memory_network").resolved().run_name() == (
        "babi-memory_network-s0"
    )
    c = RunConfig(task="pairs", attention="parallel", score="dot").resolved()
    assert c.run_name() == "pairs-parallel-dot-softmax-s0"


@pytest.mark.parametrize(
    ("align", "reason"),
    [("hard", "samples one-hot weights"), ("reinforced", "samples one-hot weights"),
     ("uniform", "do not depend differentiably on the scores")],
)  # fmt: skip
def test_supervision_is_refused_for_alignments_it_cannot_train(align, reason):
    for task in ("dates", "rationale"):
        with pytest.raises(ConfigError) as err:
            RunConfig(task=task, align=align, supervise_attention=1.0).resolved()
        text = str(err.value)
        assert text.startswith(f"--supervise-attention 1.0 contradicts --align {align}: ")
        assert reason in text
        assert RunConfig(task=task, align=align).resolved().align == align  # unsupervised: fine


def test_supervision_is_accepted_for_differentiable_alignments():
    for align in ("softmax", "sparsemax", "entmax15", "sigmoid", "local"):
        c = RunConfig(align=align, supervise_attention=0.5).resolved()
        assert c.supervise_attention == 0.5


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


def test_the_upper_bounds_admit_every_tasks_own_sizes():
    """No task's defaults (full or quick) reach a bound: the bounds refuse typos only."""
    from attnkit import tasks
    from attnkit.experiments.config import LIMITS

    for name in tasks.available():
        for mode in ("full", "quick"):
            for key, value in tasks.get(name).defaults[mode].items():
                assert key not in LIMITS or value <= LIMITS[key], (name, mode, key, value)


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


def test_the_task_settings_are_resolved_recorded_and_read_back():
    c = RunConfig(task="kv-recall", quick=True, settings={"num_pairs": 8}).resolved()
    assert c.settings == {  # every setting recorded
        "num_pairs": 8, "keys": None, "values": 10, "layers": None, "num_layers": 2
    }  # fmt: skip
    saved = json.loads(c.to_json())
    assert saved["settings"] == c.settings
    assert RunConfig.from_json(c.to_json()).resolved() == c
    old = {k: v for k, v in saved.items() if k != "settings"}  # written before settings existed
    assert RunConfig.from_json(json.dumps(old)).resolved().settings["num_pairs"] is None
    assert RunConfig(task="dates", quick=True).resolved().settings is None  # a task without


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_pairs": "8"}, "setting num_pairs of task 'kv-recall' must be int or None, got str"),
        ({"depth": 2}, "task 'kv-recall' has no setting 'depth' (its settings: num_pairs, keys"),
    ],
)
def test_bad_task_settings_are_a_config_error_naming_the_setting(settings, message):
    with pytest.raises(ConfigError) as err:
        RunConfig(task="kv-recall", quick=True, settings=settings).resolved()
    assert message in str(err.value)


def test_settings_for_a_task_without_any_are_refused_naming_the_tasks_with_settings():
    with pytest.raises(ConfigError) as err:
        RunConfig(task="dates", settings={"num_pairs": 8}).resolved()
    assert "task 'dates' has no settings to set (tasks with settings: " in str(err.value)
    assert "kv-recall" in str(err.value) and "mqar" in str(err.value)


def test_a_config_file_sets_the_task_settings_in_a_settings_table(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('task = "mqar"\nquick = true\n\n[settings]\nnum_pairs = 4\nvalues = 8\n')
    data = RunConfig.from_file(path)
    assert data["settings"] == {"num_pairs": 4, "values": 8}
    assert RunConfig(**data).resolved().settings == {
        "num_pairs": 4, "keys": None, "values": 8, "layers": None, "num_layers": 2
    }  # fmt: skip
    path.write_text('task = "mqar"\nsettings = 4\n')
    with pytest.raises(ConfigError, match="settings must be dict or null, got int 4"):
        RunConfig.from_file(path)


def test_a_resolved_configuration_is_resolved_once_until_it_changes(monkeypatch):
    calls = []
    build = parts.build_score
    monkeypatch.setattr(parts, "build_score", lambda *a, **kw: calls.append(1) or build(*a, **kw))
    config = RunConfig(task="dates", quick=True).resolved()
    assert len(calls) == 1
    assert config.resolved() is config and len(calls) == 1  # (the run asks again)
    config.epochs = 0  # changed after resolving: validated again
    with pytest.raises(ConfigError, match="epochs must be a positive int"):
        config.resolved()
    assert len(calls) == 1  # (refused before the parts are built)
    again = RunConfig(task="dates", quick=True, score="general").resolved()
    assert again.score == "general" and len(calls) == 2
