"""Checkpoints: round trip, atomic as a set, damaged files named, pickles that run code refused."""

import hashlib
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnkit.experiments import checkpoints


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _trained():
    m = _model()
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    return m, opt


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    m, opt = _trained()
    torch.manual_seed(5)
    checkpoints.save(tmp_path, m, opt, {"epoch": 3})
    expected = torch.rand(3)
    m2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(m2.parameters())
    assert checkpoints.load(tmp_path, m2, opt2) == {"epoch": 3}
    torch.testing.assert_close(m2.weight, m.weight)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    torch.testing.assert_close(torch.rand(3), expected)  # RNG restored


def test_no_checkpoint_yet_gives_none(tmp_path):
    assert checkpoints.load(tmp_path, _model()) is None


def test_a_checkpoint_in_the_older_layout_is_refused_not_ignored(tmp_path):
    (tmp_path / "state.json").write_text('{"epoch": 2, "history": []}')
    with pytest.raises(checkpoints.CheckpointError, match="older layout"):
        checkpoints.load(tmp_path, _model())


def test_a_new_checkpoint_replaces_the_old_one_and_nothing_else_is_left(tmp_path):
    m, opt = _trained()
    first = checkpoints.save(tmp_path, m, opt, {"epoch": 1})
    second = checkpoints.save(tmp_path, m, opt, {"epoch": 2})
    assert checkpoints.latest(tmp_path) == second and not first.exists()
    assert [p.name for p in (tmp_path / checkpoints.FOLDER).iterdir()] == [second.name]
    assert sorted(p.name for p in second.iterdir()) == sorted(
        [*checkpoints.FILES, checkpoints.MANIFEST]
    )


class Killed(BaseException):
    """Stands for the process dying: nothing catches it."""


@pytest.mark.parametrize("boundary", range(5))
def test_a_save_stopped_at_any_boundary_leaves_one_complete_checkpoint(
    tmp_path, monkeypatch, boundary
):
    """Boundaries: after each of the three data files, after the manifest, after the switch."""
    m, opt = _trained()
    checkpoints.save(tmp_path, m, opt, {"epoch": 1})
    with torch.no_grad():
        m.weight.add_(1.0)
    calls = []

    def written(path):
        calls.append(path)
        if len(calls) == boundary + 1:
            raise Killed

    monkeypatch.setattr(checkpoints, "_written", written)
    with pytest.raises(Killed):
        checkpoints.save(tmp_path, m, opt, {"epoch": 2})
    monkeypatch.undo()
    restored = _model()
    state = checkpoints.load(tmp_path, restored, torch.optim.Adam(restored.parameters()))
    switched = boundary == 4
    assert state == {"epoch": 2 if switched else 1}
    assert torch.equal(restored.weight, m.weight) == switched
    left = [p.name for p in (tmp_path / checkpoints.FOLDER).iterdir()]
    assert not [name for name in left if name.startswith(checkpoints.PARTIAL)]
    # The next save cleans up whatever the stopped one left.
    checkpoints.save(tmp_path, m, opt, {"epoch": 2})
    assert len(list((tmp_path / checkpoints.FOLDER).iterdir())) == 1


def _rehash(directory, name):
    manifest = directory / checkpoints.MANIFEST
    data = json.loads(manifest.read_text())
    data["sha256"][name] = hashlib.sha256((directory / name).read_bytes()).hexdigest()
    manifest.write_text(json.dumps(data))


def _truncate(directory, name):
    path = directory / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _random_bytes(directory, name):
    (directory / name).write_bytes(os.urandom(300))


def _remove(directory, name):
    (directory / name).unlink()


DAMAGE = [
    ("model.safetensors", _truncate, "checksum"),
    ("model.safetensors", _random_bytes, "checksum"),
    ("optimizer.pt", _truncate, "checksum"),
    ("optimizer.pt", _remove, "file missing"),
    ("rng.safetensors", _remove, "file missing"),
    ("rng.safetensors", _random_bytes, "checksum"),
    ("state.json", lambda d, n: (d / n).write_text("{not json"), "not valid JSON"),
    ("state.json", lambda d, n: (d / n).write_text('{"epoch": 1}'), "not a checkpoint manifest"),
    ("state.json", _remove, "file missing"),
]


@pytest.mark.parametrize(
    ("name", "damage", "message"), DAMAGE, ids=[f"{n}-{d.__name__}" for n, d, _ in DAMAGE]
)
def test_a_damaged_checkpoint_names_the_file_and_the_fault(tmp_path, name, damage, message):
    m, opt = _trained()
    directory = checkpoints.save(tmp_path, m, opt, {"epoch": 1})
    damage(directory, name)
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.load(tmp_path, _model(), torch.optim.Adam(_model().parameters()))
    text = str(err.value)
    assert str(directory / name) in text and message in text and "\n" not in text


@pytest.mark.parametrize("name", checkpoints.FILES)
def test_random_bytes_with_a_matching_checksum_are_still_refused(tmp_path, name):
    m, opt = _trained()
    directory = checkpoints.save(tmp_path, m, opt, {"epoch": 1})
    _random_bytes(directory, name)
    _rehash(directory, name)
    with pytest.raises(checkpoints.CheckpointError, match=name) as err:
        checkpoints.load(tmp_path, _model(), torch.optim.Adam(_model().parameters()))
    assert "could run code" not in str(err.value)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m, opt = _trained()
    directory = checkpoints.save(tmp_path, m, opt, {"epoch": 1})
    torch.save({"state": Evil()}, directory / "optimizer.pt")
    _rehash(directory, "optimizer.pt")
    with pytest.raises(checkpoints.CheckpointError, match="refusing to load"):
        checkpoints.load(tmp_path, _model(), torch.optim.Adam(_model().parameters()))
    assert not (tmp_path / "pwned.txt").exists()


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    target = tmp_path / "f.txt"
    target.write_text("old")

    def fail(p):
        p.write_text("half")
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        checkpoints.atomic_write(target, fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)
manifests = (
    st.fixed_dictionaries({}, optional={"state": json_values, "sha256": json_values | st.just({})})
    | json_values
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=manifests | st.binary(max_size=40))
def test_any_manifest_is_loaded_or_refused_with_a_checkpoint_error(tmp_path, content):
    m, opt = _trained()
    directory = checkpoints.save(tmp_path, m, opt, {"epoch": 1})
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    (directory / checkpoints.MANIFEST).write_bytes(raw)
    try:
        checkpoints.load(tmp_path, _model(), torch.optim.Adam(_model().parameters()))
    except checkpoints.CheckpointError as err:
        assert str(directory / checkpoints.MANIFEST) in str(err) and "\n" not in str(err)
