"""Checkpoints: round trip, atomic writes, and refusal of pickles that would run code."""

import os
import pickle

import pytest
import torch

from attnkit.experiments import checkpoints


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_round_trip_restores_model_optimizer_and_rng(tmp_path):
    m = _model()
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(4, 3)).sum().backward()
    opt.step()
    torch.manual_seed(5)
    checkpoints.save(tmp_path, m, opt, {"epoch": 3})
    expected = torch.rand(3)
    m2 = torch.nn.Linear(3, 2)
    opt2 = torch.optim.Adam(m2.parameters())
    state = checkpoints.load(tmp_path, m2, opt2)
    assert state == {"epoch": 3}
    torch.testing.assert_close(m2.weight, m.weight)
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    torch.testing.assert_close(torch.rand(3), expected)  # RNG restored


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_a_pickle_that_would_run_code_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    m = _model()
    opt = torch.optim.Adam(m.parameters())
    checkpoints.save(tmp_path, m, opt, {"epoch": 1})
    (tmp_path / "optimizer.pt").write_bytes(pickle.dumps({"state": Evil()}, protocol=2))
    with pytest.raises(checkpoints.CheckpointError, match="refusing to load"):
        checkpoints.load(tmp_path, _model(), torch.optim.Adam(_model().parameters()))
    assert not (tmp_path / "pwned.txt").exists()


def test_missing_checkpoint(tmp_path):
    with pytest.raises(checkpoints.CheckpointError, match=r"state\.json missing"):
        checkpoints.load(tmp_path, _model())


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
