"""The keys of a run configuration: what a task's defaults are written in, the same keys as
the runner's configuration, each with the types its value may have."""

import dataclasses

import pytest

from attnkit import tasks
from attnkit.experiments import RunConfig
from attnkit.tasks.run_keys import RunKeys


def test_the_runner_configuration_has_exactly_these_keys_and_defaults():
    assert RunConfig.names() == RunKeys.names()
    assert {f.name: f.default for f in dataclasses.fields(RunConfig)} == {
        f.name: f.default for f in dataclasses.fields(RunKeys)
    }
    assert RunConfig.types() == RunKeys.types()


@pytest.mark.parametrize(
    ("key", "allowed"),
    [
        ("task", (str,)),
        ("lr", (float, type(None))),
        ("epochs", (int, type(None))),
        ("quick", (bool,)),
        ("imports", (list, type(None))),
    ],
)
def test_a_key_names_the_types_its_value_may_have(key, allowed):
    assert RunKeys.types()[key] == allowed


def test_every_built_in_task_states_its_defaults_in_these_keys():
    keys = set(RunKeys.names())
    for name in tasks.available():
        for mode in ("full", "quick"):
            assert set(tasks.get(name).defaults[mode]) <= keys, (name, mode)
