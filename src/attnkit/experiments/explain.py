"""``attnkit explain RUN_DIR``: the "is attention explanation?" suite on a finished run.

Rebuilds the run's task and model from ``config.json``, loads the newest checkpoint, takes the
task's explanation probe (held-out examples run from their embeddings), runs
:func:`attnkit.evaluation.suite.explanation_suite`, writes ``explanation.json`` and adds an
"Is it explanation?" section to ``report.html`` (replacing one from an earlier call).

With ``--other-seeds RUN_DIR ...`` (runs of the same configuration with other seeds) it also
measures Wiegreffe & Pinter's variance across seeds (3.2): the other models' attention and
predictions on this run's probe examples, against this run's, beside the adversary's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from attnkit import tasks
from attnkit.evaluation.diagnostics import seed_variance
from attnkit.evaluation.suite import explanation_suite
from attnkit.experiments import checkpoints, metrics_file
from attnkit.experiments.config import ConfigError
from attnkit.experiments.report import add_section, explanation_section
from attnkit.experiments.runner import load_config, plural, resume_command
from attnkit.experiments.threads import choose_threads, count_flops

__all__ = ["add_parser", "execute", "explain", "explainable_tasks"]


def explainable_tasks() -> list[str]:
    """Registered tasks that provide ``explanation_probe(model, n)``."""
    return [n for n in tasks.available() if hasattr(tasks.get(n), "explanation_probe")]


def explain(
    run_dir: Path,
    *,
    examples: int = 200,
    epsilon: float = 0.01,
    seed: int = 0,
    other_seeds: Sequence[Path] = (),
    echo: Callable[[str], None] | None = None,
    threads: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Run the suite on the run in ``run_dir``; write explanation.json and the report section.
    Returns the results. Raises ConfigError for a directory that is not a finished run of a
    task with an explanation probe, CheckpointError for a damaged checkpoint.

    ``threads``: intra-op threads while the suite runs, chosen as ``attnkit run`` chooses them
    when None (:func:`attnkit.experiments.threads.choose_threads`: ``OMP_NUM_THREADS``, else by
    the size of the model's training step); the caller's count is restored afterwards.
    ``progress`` is called with a few words before each stage of the suite."""
    say = echo or (lambda text: print(text, flush=True))
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise ConfigError(f"--examples must be a positive int, got {examples!r}")
    if not (isinstance(epsilon, (int, float)) and 0 < epsilon < 1):
        raise ConfigError(f"--epsilon must be a number in (0, 1), got {epsilon!r}")
    if not (run_dir / "config.json").is_file():
        raise ConfigError(f"{str(run_dir)!r} is not a run directory (no config.json)")
    config = load_config(run_dir).resolved()
    cls = tasks.get(config.task)
    if not hasattr(cls, "explanation_probe"):
        raise ConfigError(
            f"task {config.task!r} has no explanation probe; tasks with one: "
            f"{', '.join(explainable_tasks())}"
        )
    _check_finished(run_dir)
    task = cls(config)
    torch.manual_seed(config.seed)
    model = task.build_model()
    if checkpoints.load(run_dir, model) is None:
        raise ConfigError(f"{str(run_dir)!r} has no checkpoint yet: train it first")
    model.eval()
    say(
        f"attnkit explain {run_dir}: task {config.task}, "
        f"{plural(examples, 'held-out example')}, ε {epsilon}"
    )
    first = torch.arange(min(config.batch_size, task.n_train()))  # a training step, as run's
    flops = count_flops(lambda: task.loss(model, first)) if threads is None else 0
    n_threads, why = choose_threads(threads, flops)
    say(f"threads: {n_threads} ({why})")
    before = torch.get_num_threads()
    torch.set_num_threads(n_threads)
    try:
        probe = task.explanation_probe(model, examples)
        results = explanation_suite(probe, epsilon=epsilon, seed=seed, progress=progress)
        results = {"run": run_dir.name, "task": config.task, **results}
        if other_seeds:
            if progress is not None:
                progress(f"the runs of the other seeds ({len(other_seeds)})")
            results["seed_variance"] = _seed_variance(task, config, probe, other_seeds, examples)
    finally:
        torch.set_num_threads(before)
    checkpoints.atomic_write(
        run_dir / "explanation.json", lambda p: p.write_text(json.dumps(results, indent=2))
    )
    report = add_section(
        run_dir / "report.html", explanation_section(results), f"attnkit explain: {run_dir.name}"
    )
    for name, v in results["agreement"].items():
        say(f"  Kendall τ(attention, {name}) = {_fmt(v['kendall_tau'])}")
    for name, v in results.get("rationale", {}).items():
        say(f"  gold rationale recall, {name}: {_fmt(v)}")
    c = results["counterfactual"]
    say(
        f"  adversarial JSD {_fmt(c['adversarial_jsd'])} at output change < {epsilon}; "
        f"permuted median change {_fmt(c['permuted_median_output_change'])}"
    )
    if "wiegreffe_pinter" in results:
        wp = results["wiegreffe_pinter"]
        pooled = ", ".join(f"{k} {_fmt(v)}" for k, v in wp["frozen_mlp_accuracy"].items())
        say(
            f"  trained adversary: JSD {_fmt(wp['adversary_jsd'])}, output change "
            f"{_fmt(wp['adversary_output_change'])}; frozen-weights MLP accuracy: {pooled}"
        )
    if "seed_variance" in results:
        sv = results["seed_variance"]
        say(
            f"  other seeds ({len(sv['runs'])}): attention JSD {_fmt(sv['jsd'])} from this run's, "
            f"output change {_fmt(sv['output_change'])}"
        )
    say(f"explanation: {run_dir / 'explanation.json'}\nreport: {report}")
    return results


def _check_finished(run_dir: Path) -> None:
    """Raise ConfigError unless the run in ``run_dir`` finished training (its held-out metrics,
    metrics.json, are written last): the suite explains a trained model, not one mid-way.
    A metrics.json that is not the metrics of a run is refused naming the file."""
    if metrics_file.read(run_dir) is not None:
        return
    if checkpoints.latest(run_dir) is None:
        raise ConfigError(f"{str(run_dir)!r} has no checkpoint yet: train it first")
    raise ConfigError(
        f"{str(run_dir)!r} is not a finished run (no metrics.json: training stopped before the "
        f"end); finish it first with: {resume_command(run_dir)}"
    )


def _seed_variance(task, config, probe, others: Sequence[Path], examples: int) -> dict:
    """This run's probe against the same probe run by models trained with other seeds."""

    def run(p) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return p.attention.detach(), p.logits(p.inputs, p.keep).softmax(-1)

    mine = asdict(config)
    weights, probabilities = zip(run(probe), strict=True)
    weights, probabilities = list(weights), list(probabilities)
    for other in others:
        if not (other / "config.json").is_file():
            raise ConfigError(f"{str(other)!r} is not a run directory (no config.json)")
        theirs = asdict(load_config(other).resolved())
        differ = sorted(k for k in mine if k not in ("seed", "out") and mine[k] != theirs.get(k))
        if differ:
            raise ConfigError(
                f"{str(other)!r} is not the same configuration with another seed: "
                f"{', '.join(f'{k} {theirs.get(k)!r} vs {mine[k]!r}' for k in differ)}"
            )
        _check_finished(other)
        model = task.build_model()
        if checkpoints.load(other, model) is None:
            raise ConfigError(f"{str(other)!r} has no checkpoint yet: train it first")
        w, p = run(task.explanation_probe(model.eval(), examples))
        weights.append(w)
        probabilities.append(p)
    variance = seed_variance(weights, probabilities)
    return {
        "runs": [o.name for o in others],
        "jsd": float(variance.divergence.mean()),
        "jsd_per_run": variance.divergence.mean(-1).tolist(),
        "output_change": float(variance.output_change.mean()),
    }


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def add_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "explain",
        help="is the attention of a finished run an explanation? (adds to its report)",
        description="Run the explanation suite on a finished `attnkit run`: agreement of "
        "attention with gradient, integrated-gradient and leave-one-out importance, recall of "
        "the gold rationale, permuted / uniform / adversarial weights, erasure, attention as "
        "confidence. Writes RUN_DIR/explanation.json and an 'Is it explanation?' section in "
        f"RUN_DIR/report.html. Tasks: {', '.join(explainable_tasks())}.",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a finished run directory")
    parser.add_argument(
        "--examples", type=int, default=200, metavar="N", help="held-out examples (default: 200)"
    )
    parser.add_argument(
        "--epsilon",
        type=float,
        default=0.01,
        metavar="E",
        help="output change (TVD) the adversarial weights must stay below (default: 0.01)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random parts")
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="intra-op threads (default: as attnkit run chooses them: OMP_NUM_THREADS if set, "
        "else by the model's size: 1 for the embedded tasks)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--other-seeds",
        type=Path,
        nargs="+",
        default=[],
        metavar="RUN_DIR",
        help="finished runs of the same configuration with other seeds: how far their attention "
        "lies from this run's on the same examples (Wiegreffe & Pinter's variance across seeds)",
    )
    return parser


def execute(args: argparse.Namespace) -> int:
    """Run ``attnkit explain``; exit status 0, or one line on stderr and 2 when refused (1 for
    an internal error, 130 for Ctrl-C)."""
    from attnkit.experiments import failures

    def progress(text: str) -> None:
        print(f"... {text}", file=sys.stderr, flush=True)

    try:
        if args.threads is not None and args.threads < 1:
            raise ConfigError(f"--threads must be a positive int, got {args.threads}")
        explain(
            args.run_dir,
            examples=args.examples,
            epsilon=args.epsilon,
            seed=args.seed,
            other_seeds=args.other_seeds,
            threads=args.threads,
            progress=None if args.no_progress else progress,
        )
    except KeyboardInterrupt:
        print("\nattnkit explain: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one line (failures.report)
        return failures.report(err, "attnkit explain")
    return 0
