"""load_run: a finished run read back gives the trained model (same held-out metrics as the run
reported), its config and task, and leaves the caller's random state and threads alone."""

import json

import pytest
import torch

import attnkit as ak
from attnkit.experiments import checkpoints
from attnkit.experiments.checkpoints import CheckpointError
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.runner import run

TINY = {"n_train": 96, "n_test": 16, "batch_size": 32, "d_model": 8, "epochs": 1}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    run_dir, metrics = run(
        RunConfig(**TINY),
        tmp_path_factory.mktemp("reload") / "run",
        progress=False,
        echo=lambda line: None,
        threads=1,
    )
    return run_dir, metrics


def test_the_reloaded_model_reproduces_the_runs_metrics(finished):
    run_dir, metrics = finished
    loaded = ak.load_run(run_dir)
    assert loaded.metrics == json.loads((run_dir / "metrics.json").read_text())
    assert loaded.config.task == "dates" and loaded.epoch == 1
    assert not loaded.model.training
    again = loaded.task.final_metrics(loaded.model)
    for name, value in metrics.items():
        assert again[name] == pytest.approx(value, abs=1e-9), name


def test_loading_has_no_side_effect_on_the_random_state_or_threads(finished):
    torch.manual_seed(1234)
    threads = torch.get_num_threads()
    before = torch.get_rng_state()
    ak.load_run(finished[0])
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.get_num_threads() == threads


def test_bad_directories_are_refused_by_name(tmp_path, finished):
    with pytest.raises(ConfigError, match="not a run directory"):
        ak.load_run(tmp_path)
    with pytest.raises(TypeError, match="run_dir"):
        ak.load_run(3)
    empty = tmp_path / "fresh"
    empty.mkdir()
    (empty / "config.json").write_text((finished[0] / "config.json").read_text())
    with pytest.raises(ConfigError, match="no checkpoint"):
        ak.load_run(empty)
    with pytest.raises(ConfigError, match="has not finished"):
        ak.load_run(empty, require_finished=True)


def test_a_damaged_checkpoint_names_the_file(tmp_path, finished):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(finished[0], copy)
    weights = checkpoints.latest(copy) / "model.safetensors"
    weights.write_bytes(b"not weights")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        ak.load_run(copy)


def _copy(finished, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(finished[0], copy)
    return copy


def test_an_edited_saved_position_config_or_metrics_file_is_refused_naming_the_file(
    tmp_path, finished
):
    """Every file load_run reads is under a checksum or validated: state.json's position
    (epoch 99), config.json changed to other valid values, a metrics.json of garbage."""
    copy = _copy(finished, tmp_path)
    manifest = checkpoints.latest(copy) / checkpoints.MANIFEST
    data = json.loads(manifest.read_text())
    data["state"]["epoch"] = 99
    manifest.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="saved position differs from the checksum") as err:
        ak.load_run(copy)
    assert str(manifest) in str(err.value)

    copy = _copy(finished, tmp_path / "b")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "lr": 0.5}))
    with pytest.raises(CheckpointError, match=r"config\.json differs from the configuration"):
        ak.load_run(copy)

    copy = _copy(finished, tmp_path / "c")
    for garbage, message in (("{", "cannot be read as JSON"), ("[1, 2]", "got list"),
                             ('{"accuracy": "high"}', "metric 'accuracy' is 'high'")):  # fmt: skip
        (copy / "metrics.json").write_text(garbage)
        with pytest.raises(ConfigError, match="metrics.json: .*" + message):
            ak.load_run(copy)
