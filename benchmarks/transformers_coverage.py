"""Which transformers architectures swap_attention reproduces exactly: the table of
docs/integrations.md.

    python benchmarks/transformers_coverage.py              # every model type (about 10 min)
    python benchmarks/transformers_coverage.py llama t5     # some
    python benchmarks/transformers_coverage.py --rows a.jsonl --rows b.jsonl  # table of saved rows

Each model type is built small (random weights, float64) from its default configuration and
compared with its own eager attention (see attnkit.integrations.transformers_sweep); the script
prints a markdown table, one row per model type, and the count per status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from attnkit.integrations import transformers_sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="model types (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model type")
    parser.add_argument("--save", help="append each row to this JSON-lines file as it is done")
    parser.add_argument(
        "--rows", action="append", help="print the table of rows saved with --save (no checks)"
    )
    args = parser.parse_args(argv)
    rows = []
    if args.rows:
        for path in args.rows:
            with open(path, encoding="utf-8") as f:
                rows += [transformers_sweep.Row(**json.loads(line)) for line in f if line.strip()]
        rows.sort(key=lambda r: r.model_type)
    else:
        for t in args.model_types or transformers_sweep.model_types():
            row = transformers_sweep.check_isolated(t, args.timeout)
            print(f"{row.model_type}: {row.status} ({row.detail})", file=sys.stderr, flush=True)
            if args.save:
                with open(args.save, "a", encoding="utf-8") as f:
                    f.write(json.dumps(dataclasses.asdict(row)) + "\n")
            rows.append(row)
    print(transformers_sweep.to_markdown(rows))
    return 1 if any(r.status == "differs" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
