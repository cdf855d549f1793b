"""The ``attnkit`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attnkit", description="Attention mechanisms of the survey taxonomy, runnable."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compare attention variants on one query and print their weights")
    runp = sub.add_parser("run", help="train an attention model on an embedded task and report")
    runp.add_argument("task", nargs="?", default="dates", help="dates (default) or digits")
    runp.add_argument("--score", default="additive", help="score function name")
    runp.add_argument("--align", default="softmax", help="alignment function name")
    runp.add_argument(
        "--compare",
        metavar="KEY=V1,V2,...",
        help="one run per value of score or align; prints one row per variant",
    )
    runp.add_argument("--epochs", type=int)
    runp.add_argument("--batch-size", type=int, default=64)
    runp.add_argument("--lr", type=float, default=3e-3)
    runp.add_argument("--seed", type=int, default=0)
    runp.add_argument("--n-train", type=int)
    runp.add_argument("--n-test", type=int)
    runp.add_argument(
        "--supervise-attention",
        type=float,
        default=0.0,
        metavar="LAMBDA",
        help="add LAMBDA × KL(gold ‖ weights) to the loss (dates only)",
    )
    runp.add_argument("--quick", action="store_true", help="small data, few epochs (< 1 min)")
    runp.add_argument("--out", type=Path, help="run directory (default runs/<name>-<time>)")
    runp.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run")
    runp.add_argument("--no-progress", action="store_true", help="no progress bar")
    sub.add_parser(
        "taxonomy", help="rebuild Brauwers Table III from attnkit's models and check each row"
    )
    bench = sub.add_parser("bench", help="quick benchmarks: ratios against baselines, one run")
    bench.add_argument("--full", action="store_true", help="the full sizes (slow: many minutes)")
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(args, parser)
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
        progress("multi-head attention and score functions")
        print(core.main(quick=not args.full), flush=True)
        print()
        print(kernels.main(quick=not args.full, progress=progress))
    return 0


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from attnkit.experiments.config import ConfigError, RunConfig
    from attnkit.experiments.runner import run

    base = RunConfig(
        task=args.task,
        score=args.score,
        align=args.align,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        quick=args.quick,
        supervise_attention=args.supervise_attention,
        n_train=args.n_train,
        n_test=args.n_test,
    )
    try:
        variants = [base]
        if args.compare:
            key, _, values = args.compare.partition("=")
            if key not in ("score", "align") or not values:
                raise ConfigError(
                    f"--compare must be score=A,B,... or align=A,B,..., got {args.compare!r}"
                )
            variants = [RunConfig(**{**base.__dict__, key: v}) for v in values.split(",")]
        for v in variants:  # validate every variant before running any
            v.resolved()
        rows = []
        for v in variants:
            out = args.out / v.run_name() if (args.out and args.compare) else args.out
            run_dir, metrics = run(v, out, resume=args.resume, progress=not args.no_progress)
            rows.append((v, run_dir, metrics))
    except ConfigError as err:
        print(f"attnkit run: error: {err}", file=sys.stderr)
        return 2
    if rows and rows[0][2]:
        _summary(rows)
    return 0


def _summary(rows) -> None:
    keys = [k for k in rows[0][2] if not k.startswith("uniform_ablation_exact")]
    print("\n| task | score | align | " + " | ".join(keys) + " | report |")
    print("|---" * (len(keys) + 4) + "|")
    for config, run_dir, metrics in rows:
        cells = " | ".join(f"{metrics[k]:.3f}" for k in keys)
        print(
            f"| {config.task} | {config.score} | {config.align} | {cells} | "
            f"{run_dir / 'report.html'} |"
        )


if __name__ == "__main__":
    sys.exit(main())
