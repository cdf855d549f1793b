"""The ``attnkit`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attnkit", description="Attention mechanisms of the survey taxonomy, runnable."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compare attention variants on one query and print their weights")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from attnkit import demo

        demo.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
