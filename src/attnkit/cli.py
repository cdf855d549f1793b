"""The ``attnkit`` command."""

from __future__ import annotations

import argparse
import difflib
import sys

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """Refusals in one line (``attnkit run: error: ...``, exit status 2), no usage dump."""

    def error(self, message: str):
        unknown = message.partition("unrecognized arguments:")[2].split()
        flags = [t.split("=")[0] for t in unknown if t.startswith("--")]
        close = difflib.get_close_matches(flags[0], self._flags(), n=1) if flags else []
        hint = f"; did you mean {close[0]}?" if close and close[0] != flags[0] else ""
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")

    def _flags(self) -> list[str]:
        """The option strings of this parser (not of its subcommands: each subcommand refuses
        its own unknown arguments)."""
        return [s for action in self._actions for s in action.option_strings if s.startswith("--")]


class _SubParser(_Parser):
    """A subcommand's parser: it refuses the arguments it does not know itself, under its own
    name and with the closest of its own options (argparse leaves them to the top parser,
    which would name ``attnkit`` and suggest options of other subcommands)."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("attnkit")
    except PackageNotFoundError:  # run from a source tree that is not installed
        from attnkit import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    """Run the ``attnkit`` command line ``argv``; the exit status. Every failure ends in one
    line on stderr: status 2 for bad input or the machine's state (a full disk, a damaged run),
    1 for a diverged run or an internal error (the line names a log file with the traceback),
    130 for Ctrl-C (:mod:`attnkit.experiments.failures`)."""
    parser = _Parser(
        prog="attnkit", description="Attention mechanisms of the survey taxonomy, runnable."
    )
    parser.add_argument("--version", action="version", version=f"attnkit {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubParser)
    sub.add_parser("demo", help="compare attention variants on one query and print their weights")
    from attnkit.experiments.command import add_parser

    run_parser = add_parser(sub)
    from attnkit.experiments import explain

    explain.add_parser(sub)
    from attnkit.experiments import predict

    predict.add_parser(sub)
    sub.add_parser(
        "taxonomy", help="rebuild Brauwers Table III from attnkit's models and check each row"
    )
    bench = sub.add_parser("bench", help="quick benchmarks: ratios against baselines, one run")
    bench.add_argument(
        "which",
        nargs="?",
        choices=("core", "efficient", "sparse", "decode-memory"),
        default="core",
        help="core: multi-head attention, scores and kernels (default); efficient: efficient "
        "attention against exact attention as N grows; sparse: block-sparse patterns, does the "
        "cost follow the density; decode-memory: cache bytes per token and decoding tokens/s of "
        "MHA, GQA, MLA, sinks + window and the linear family",
    )
    bench.add_argument("--full", action="store_true", help="the full sizes (slow: many minutes)")
    args = parser.parse_args(argv)
    try:
        return _dispatch(args, run_parser)
    except KeyboardInterrupt:
        print(f"\nattnkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one line and an exit status, never a traceback
        from attnkit.experiments.failures import report

        return report(err, f"attnkit {args.command}")


def _dispatch(args: argparse.Namespace, run_parser: argparse.ArgumentParser) -> int:
    if args.command == "run":
        from attnkit.experiments.command import execute

        return execute(args, run_parser)
    if args.command == "explain":
        from attnkit.experiments import explain

        return explain.execute(args)
    if args.command == "predict":
        from attnkit.experiments import predict

        return predict.execute(args)
    if args.command == "demo":
        from attnkit import demo

        demo.main()
    elif args.command == "taxonomy":
        from attnkit.models import table3
        from attnkit.taxonomy import table_markdown

        rows, marks = table3.reproduce()
        print(table_markdown(rows, marks))
        print(f"\n{sum(marks.values())} of {len(marks)} rows match the survey's Table III")
        for name, ok in marks.items():
            if not ok:
                print(f"  {name}: survey has {' | '.join(table3.SURVEY[name])}")
        return 0 if all(marks.values()) else 1
    elif args.command == "bench":
        from attnkit.benchmarking import core, kernels
        from attnkit.benchmarking.timing import machine

        def progress(msg: str) -> None:
            print(f"... {msg}", file=sys.stderr, flush=True)

        print(f"Machine: {machine()}\n")
        if args.which == "efficient":
            from attnkit.benchmarking import efficient

            print(efficient.main(quick=not args.full, progress=progress))
            return 0
        if args.which == "decode-memory":
            from attnkit.benchmarking import decode_memory

            print(decode_memory.main(quick=not args.full, progress=progress))
            return 0
        if args.which == "sparse":
            from attnkit.benchmarking import sparse

            print(sparse.main(quick=not args.full, progress=progress))
            return 0
        progress("multi-head attention and score functions")
        print(core.main(quick=not args.full), flush=True)
        print()
        print(kernels.main(quick=not args.full, progress=progress))
    return 0


if __name__ == "__main__":
    sys.exit(main())
