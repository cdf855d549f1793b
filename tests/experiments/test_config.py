"""Bad configurations: one clear error line, exit status 2, nothing written."""

import pytest

from attnkit import cli
from attnkit.experiments.config import ConfigError, RunConfig

BAD = [
    (["run", "nosuchtask"], "unknown task 'nosuchtask'"),
    (["run", "dates", "--score", "additve"], "unknown score 'additve'"),
    (["run", "dates", "--align", "softmx"], "unknown alignment 'softmx'"),
    (["run", "dates", "--epochs", "-1"], "epochs must be a non-negative int"),
    (["run", "dates", "--batch-size", "0"], "batch_size must be a positive int"),
    (["run", "dates", "--lr", "0"], "lr must be > 0"),
    (["run", "digits", "--supervise-attention", "1"], "needs gold alignments"),
    (["run", "dates", "--compare", "depth=1,2"], "--compare must be"),
    (["run", "dates", "--compare", "score=dot,nope"], "unknown score 'nope'"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_configuration_exits_2_with_one_line(argv, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnkit run: error:") and message in err[0]
    assert not out.exists()


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert cli.main(["run", "dates", "--quick", "--out", str(blocker / "sub")]) == 2
    assert "not writable" in capsys.readouterr().err


def test_resume_of_a_non_run(tmp_path, capsys):
    assert cli.main(["run", "dates", "--resume", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_defaults_and_round_trip():
    c = RunConfig(quick=True).resolved()
    assert c.epochs and c.n_train and c.n_test
    assert RunConfig.from_json(c.to_json()) == c
    with pytest.raises(ConfigError):
        RunConfig(score="location").resolved()
