"""Which transformers architectures swap_attention reproduces exactly: the table of
docs/integrations.md.

    python benchmarks/transformers_coverage.py              # every model type (about 10 min)
    python benchmarks/transformers_coverage.py llama t5     # some

Each model type is built small (random weights, float64) from its default configuration and
compared with its own eager attention (see attnkit.integrations.transformers_sweep); the script
prints a markdown table, one row per model type, and the count per status.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

from attnkit.integrations import transformers_sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="model types (default: all)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model type")
    args = parser.parse_args(argv)
    types = args.model_types or transformers_sweep.model_types()
    rows = []
    for t in types:
        row = transformers_sweep.check_isolated(t, args.timeout)
        print(f"{row.model_type}: {row.status} ({row.detail})", file=sys.stderr, flush=True)
        rows.append(row)
    print(transformers_sweep.to_markdown(rows))
    return 1 if any(r.status == "differs" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
