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


@pytest.mark.parametrize(
    ("argv", "prog", "unknown", "hint"),
    [
        (["bench", "core", "--out", "x.md"], "attnkit bench", "--out x.md", None),
        (["bench", "efficient", "--fulll"], "attnkit bench", "--fulll", "--full"),
        (["run", "dates", "--epochz", "3"], "attnkit run", "--epochz 3", "--epochs"),
        (["explain", "somewhere", "--exmples", "3"], "attnkit explain", "--exmples 3",
         "--examples"),
    ],
)  # fmt: skip
def test_a_subcommand_refuses_its_own_unknown_options(capsys, argv, prog, unknown, hint):
    """Each subcommand names itself and suggests only its own options (never the unknown
    option itself, nor another subcommand's)."""
    with pytest.raises(SystemExit) as err:
        cli.main(argv)
    assert err.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"{prog}: error: unrecognized arguments: {unknown}"), line
    assert (f"did you mean {hint}?" in line) if hint else ("did you mean" not in line), line
    assert line.endswith(f"(see {prog} --help)")
