"""The attnkit command."""

import pytest

from attnkit import cli


def test_demo_command(capsys):
    assert cli.main(["demo"]) == 0
    assert "scaled_dot + softmax" in capsys.readouterr().out


def test_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["nope"])
    assert err.value.code == 2


def test_taxonomy_command_prints_seventeen_matching_rows(capsys):
    assert cli.main(["taxonomy"]) == 0
    out = capsys.readouterr().out
    assert "17 of 17 rows match" in out
    assert out.count("| ✓ |") == 17


def test_version(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["--version"])
    assert err.value.code == 0
    from attnkit import __version__

    assert capsys.readouterr().out.strip() == f"attnkit {__version__}"


def test_a_refusal_is_one_line(capsys):
    with pytest.raises(SystemExit) as err:
        cli.main(["nope"])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnkit: error: argument command")
