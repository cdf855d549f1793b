"""``attnkit predict RUN INPUT...``: a finished run's model on new inputs (texts for the ``text``
task, source sentences for ``seq2seq``), read from the command line or, one per line, from a
file (``--file FILE``, ``-`` for standard input).

Each input gives one line: the prediction, a tab, the input; with ``--json`` one JSON object per
input (``input``, ``prediction`` and what the task adds: the probability of every label, the
attention weights over the input's tokens). The same as :meth:`attnkit.experiments.reload.
LoadedRun.predict`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["add_parser", "execute", "read_inputs"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "predict",
        help="a trained run's model on new inputs (texts, source sentences)",
        description="Load a run written by attnkit run (the best epoch's weights when it kept "
        "them) and print its prediction for each input: the prediction, a tab, the input.",
        epilog="examples: attnkit predict runs/text-run 'a new sentence' 'another one'; "
        "attnkit predict runs/seq2seq-run --file sentences.txt --json",
    )
    p.add_argument("run_dir", type=Path, metavar="RUN", help="a run directory of attnkit run")
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="inputs to predict on")
    p.add_argument(
        "--file",
        type=Path,
        metavar="FILE",
        help="also read inputs from FILE, one per non-empty line (UTF-8; - for standard input)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per input, with what the task gives beside the prediction",
    )
    return p


def read_inputs(path: Path) -> list[str]:
    """The non-empty lines of ``path`` (``-``: standard input), without their line ends;
    ValueError naming the file when it cannot be read as UTF-8 text."""
    if str(path) == "-":
        return [line.rstrip("\r\n") for line in sys.stdin if line.strip()]
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--file {str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--file {str(path)!r}: cannot be read as UTF-8 text ({err})") from None
    return [line for line in text.splitlines() if line.strip()]


def execute(args: argparse.Namespace) -> int:
    """Print the predictions; exit status 0, or 2 with one line on stderr for bad input."""
    from attnkit.experiments.config import ConfigError
    from attnkit.experiments.reload import load_run

    inputs = list(args.inputs)
    if args.file is not None:
        try:
            inputs += read_inputs(args.file)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if not inputs:
        raise ConfigError("no inputs: give them after the run directory, or --file FILE")
    run = load_run(args.run_dir, require_finished=False)
    try:
        predictions = run.predict(inputs)
    except NotImplementedError as err:
        raise ConfigError(f"{args.run_dir}: {err}") from None
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for item in predictions:
        if args.json:
            print(json.dumps(item, ensure_ascii=False))
        else:
            print(f"{item['prediction']}\t{item['input']}")
    return 0
