"""The ``attnkit run`` subcommand: its flags (with help and defaults), and how a command line
becomes one run or a comparison. Every refusal is one line on stderr and exit status 2."""

from __future__ import annotations

import argparse
import itertools
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

from attnkit import tasks
from attnkit.tasks import parts

__all__ = ["add_parser", "execute"]

# Flags that set a configuration key: flag -> (key, type, metavar, help). Their defaults are
# the task's (or RunConfig's), so a flag left out is not in the parsed arguments at all: that
# is how --resume tells a contradicting flag from an unset one.
_CONFIG_FLAGS: dict[str, tuple[str, type, str, str]] = {
    "--score": ("score", str, "NAME", "score function (default: the task's)"),
    "--align": ("align", str, "NAME", "alignment function (default: softmax)"),
    "--attention": ("attention", str, "NAME", "attention mechanism, for tasks with several"),
    "--position": ("position", str, "NAME", "position scheme, for tasks that take one"),
    "--epochs": ("epochs", int, "N", "training epochs"),
    "--batch-size": ("batch_size", int, "N", "examples per step"),
    "--lr": ("lr", float, "LR", "Adam learning rate"),
    "--seed": ("seed", int, "N", "seed of data, initialisation and order (default: 0)"),
    "--d-model": ("d_model", int, "N", "model width, even"),
    "--n-train": ("n_train", int, "N", "training examples"),
    "--n-test": ("n_test", int, "N", "test examples (validation: half as many)"),
    "--seq-len": ("seq_len", int, "N", "sequence length, for tasks with one"),
    "--data": ("data", str, "FILE", "your data file, for tasks that read one"),
    "--pretrained": ("pretrained", str, "NAME|DIR", "fine-tune a pretrained encoder: "
                     "minilm or a checkpoint folder"),
    "--supervise-attention": ("supervise_attention", float, "LAMBDA",
                              "add LAMBDA × KL(gold ‖ weights) to the loss (default: 0)"),
    "--best-metric": ("best_metric", str, "NAME", "keep the epoch best by this validation "
                      "metric"),
    "--patience": ("patience", int, "N", "stop after N epochs without a better --best-metric"),
    "--schedule": ("schedule", str, "NAME", "constant, linear or cosine learning rate "
                   "(default: constant)"),
    "--warmup-steps": ("warmup_steps", int, "N", "steps of linear warm-up (default: 0)"),
    "--clip-norm": ("clip_norm", float, "MAX", "clip the gradient norm; 0: never (default: 5)"),
    "--kernel": ("kernel", str, "NAME", "the attention kernel (dense, sdpa, chunked, flex; "
                 "default: chosen per call)"),
    "--context-parallel": ("context_parallel", int, "P", "split each sequence over P "
                           "processes (ring attention)"),
    "--task-module": ("task_module", str, "MODULE:CLASS", "your own task class "
                      "(pkg.mod:Class or file.py:Class)"),
}  # fmt: skip

_TASK_KEYS = ("epochs", "batch_size", "lr", "d_model", "n_train", "n_test", "seq_len", "score")


def _task_classes() -> dict:
    """Name -> class of every task that loads (a broken installed entry point is left out of
    the help; naming it gives its error)."""
    found = {}
    for name in tasks.available():
        try:
            found[name] = tasks.get(name)
        except ValueError:
            continue
    return found


def _wrapped(title: str, text: str) -> list[str]:
    """``title: text`` wrapped to the terminal, the lines after the first indented."""
    import shutil
    import textwrap

    width = max(60, min(100, shutil.get_terminal_size().columns) - 2)
    return textwrap.wrap(f"{title}: {text}", width, subsequent_indent="    ") or [title]


def _defaults_line(cls: type, pretrained: str | None) -> str:
    """``key full (quick q), ...`` of the run-configuration keys the task gives defaults for
    (read from an unresolved configuration with every key at its default, as a task sees it)."""
    from attnkit.experiments.config import RunConfig

    full = cls.run_defaults(RunConfig(quick=False, pretrained=pretrained))
    quick = cls.run_defaults(RunConfig(quick=True, pretrained=pretrained))
    full = {"score": "additive", **full, "align": full.get("align", "softmax")}
    quick = {"score": "additive", **quick, "align": quick.get("align", "softmax")}
    unused = cls.unused(RunConfig(pretrained=pretrained)) if pretrained else {}
    out = []
    for key in (*_TASK_KEYS, "align"):
        if key in full and key not in unused:
            text = f"{key} {full[key]}"
            if quick.get(key) != full[key]:
                text += f" (quick {quick.get(key)})"
            out.append(text)
    return ", ".join(out)


def task_help(name: str, cls: type) -> list[str]:
    """What ``attnkit run TASK --help`` prints after the usage line: the task's description,
    its defaults (full and ``--quick``), what it takes, its metrics and its settings."""
    import attnkit as ak

    lines = _wrapped(f"task {name!r}", cls.description)
    lines += _wrapped("defaults", _defaults_line(cls, None))
    if cls.takes_pretrained:
        lines += _wrapped("defaults with --pretrained", _defaults_line(cls, "pretrained"))
    takes = [
        "--data FILE" if cls.reads_data else "",
        "--pretrained NAME|DIR" if cls.takes_pretrained else "",
        "--position" if cls.takes_position else "",
        "--supervise-attention (gold attention)" if cls.gold_alignment else "",
        "--context-parallel" if cls.context_parallel else "",
    ]
    if any(takes):
        lines += _wrapped("takes", ", ".join(t for t in takes if t))
    if cls.attentions:
        lines += _wrapped("--attention", ", ".join(cls.attentions))
    if cls.takes_position:
        lines += _wrapped("--position", ", ".join(ak.positions.available()))
    lines += _wrapped("--score", ", ".join(parts.usable_scores()))
    lines += _wrapped("--align", ", ".join(ak.alignments.available()))
    lines.append("metrics (held-out):")
    lines += [f"  {m}: {info.description} ({info.reading})" for m, info in cls.metrics.items()]
    settings = cls.settings_help()
    lines.append(f"settings of task {name!r} (--set NAME=VALUE):" if settings
                 else f"task {name!r} has no settings")  # fmt: skip
    lines += [f"  {line}" for line in settings]
    lines.append("every flag: attnkit run --help")
    return lines


class _Help(argparse.Action):
    """``-h``/``--help``: the flags; after a task (``attnkit run kv-recall --help``), that
    task's description, defaults, settings and metrics instead."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help=None) -> None:  # fmt: skip
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        name = getattr(namespace, "task", None)
        cls = _task_classes().get(name) if isinstance(name, str) else None
        if cls is None:
            parser.print_help()
        else:
            print(f"usage: attnkit run {name} [options]   (options: attnkit run --help)\n")
            print("\n".join(task_help(name, cls)))
        parser.exit()


def add_parser(sub) -> argparse.ArgumentParser:
    known = _task_classes()
    runp = sub.add_parser(
        "run",
        add_help=False,
        usage="attnkit run [TASK] [options]",
        help="train an attention model on an embedded task and report",
        description="Train an attention model on a task, checkpoint every epoch, evaluate its "
        "attention and write an HTML report. Unset flags take the task's defaults: "
        "`attnkit run TASK --help` lists them, with the task's settings, metrics and the names "
        "--score, --align and --attention take.",
        epilog="examples: attnkit run dates --quick; attnkit run dates --compare "
        "align=softmax,sparsemax --compare seed=0,1; attnkit run text --data FILE --pretrained "
        "minilm; attnkit run --resume runs/<dir>",
    )
    runp.add_argument("-h", "--help", action=_Help,
                      help="this help; after a task: the task's defaults and settings")  # fmt: skip
    runp.add_argument(
        "task",
        nargs="?",
        default=argparse.SUPPRESS,
        metavar="TASK",
        help=f"one of: {', '.join(known)}",
    )
    for flag, (key, kind, metavar, text) in _CONFIG_FLAGS.items():
        runp.add_argument(
            flag, dest=key, type=kind, metavar=metavar, default=argparse.SUPPRESS, help=text
        )  # fmt: skip
    runp.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                      default=argparse.SUPPRESS,
                      help="import your module (e.g. one registering a part) first")  # fmt: skip
    runp.add_argument("--set", dest="set_values", action="append", metavar="NAME=VALUE",
                      help="a setting of the task (attnkit run TASK --help)")  # fmt: skip
    runp.add_argument("--quick", action="store_true", default=argparse.SUPPRESS,
                      help="the task's small quick defaults")  # fmt: skip
    runp.add_argument("--config", type=Path, metavar="FILE",
                      help="configuration keys from a TOML or JSON file")  # fmt: skip
    runp.add_argument("--compare", action="append", metavar="KEY=V1,V2,...",
                      help="one run per value (per combination, given again); a table")  # fmt: skip
    runp.add_argument("--out", type=Path, metavar="DIR",
                      help="new run directory (default: runs/<name>-<time>)")  # fmt: skip
    runp.add_argument("--resume", type=Path, metavar="RUN_DIR",
                      help="continue a stopped run as it was configured")  # fmt: skip
    runp.add_argument("--threads", type=int, metavar="N",
                      help="intra-op threads (default: chosen by the model's size)")  # fmt: skip
    runp.add_argument("--timeout", type=float, metavar="SECONDS",
                      help="wait for the other processes (torchrun; default: 300)")  # fmt: skip
    runp.add_argument("--no-progress", action="store_true", help="no progress bar")
    return runp


def _say(message: str) -> None:
    print(f"attnkit run: error: {message}", file=sys.stderr)


def execute(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run what ``args`` asks; the exit status (0; 1 diverged or an internal error; 2 refused,
    a damaged run, a full disk, a failing task of the user's own; 130 interrupted): every
    failure is one line on stderr (:func:`attnkit.experiments.failures.report`).

    Without a task (and without ``--resume``) nothing runs: ``parser``'s help goes to stderr,
    then the refusal, and the status is 2 (a required argument is missing)."""
    from attnkit.experiments import failures
    from attnkit.experiments.runner import Interrupted

    if (
        "task" not in vars(args)
        and "task_module" not in vars(args)
        and args.resume is None
        and args.config is None
    ):
        if parser is not None:
            parser.print_help(sys.stderr)
            print(file=sys.stderr)
        _say(
            f"a task is required (one of: {', '.join(tasks.available())}), or --resume RUN_DIR; "
            "e.g. attnkit run dates --quick"
        )
        return 2
    try:
        return _execute(args)
    except Interrupted as err:
        print(f"\nattnkit run: {err}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("\nattnkit run: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # every other failure: one line (failures.report)
        return failures.report(err, "attnkit run")


def _execute(args: argparse.Namespace) -> int:
    from attnkit.experiments.config import ConfigError, RunConfig
    from attnkit.experiments.runner import run

    flags = {k: v for k, v in vars(args).items() if k in RunConfig.names()}
    given, in_file = dict(flags), {}
    if args.config is not None:
        if args.resume is not None:
            raise ConfigError("--config cannot be combined with --resume: a run continues as it "
                              "was configured")  # fmt: skip
        in_file = RunConfig.from_file(args.config)
        given = {**in_file, **flags}
    if isinstance(given.get("pretrained"), str) and Path(given["pretrained"]).is_dir():
        given["pretrained"] = str(Path(given["pretrained"]).resolve())  # resumable from anywhere
    if given.get("imports") is not None:
        given["imports"] = [_load_import(spec) for spec in given["imports"]]
    if given.get("task_module") is not None:
        name, given["task_module"] = _load_task_module(given["task_module"])
        given.setdefault("task", name)
    if args.config is not None and "task" not in given:
        raise ConfigError(f"--config {str(args.config)!r} names no task: add task = \"...\" "
                          "to it or give the task on the command line")  # fmt: skip
    set_values = getattr(args, "set_values", None)
    if set_values:
        task = given.get("task")
        if task is None and args.resume is not None:
            from attnkit.experiments.runner import load_config

            task = load_config(args.resume).task
        parsed = _parse_sets(set_values, task or RunConfig.task)
        given["settings"] = {**(given.get("settings") or {}), **parsed}
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be a positive int, got {args.threads}")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    options = {"progress": not args.no_progress, "threads": args.threads}
    if args.timeout is not None:
        options["timeout"] = args.timeout
    if args.resume is not None:
        _resume(args, given, options)
    elif args.compare:
        _compare(args, given, set(flags), options)
    else:
        config = RunConfig(**given).resolved()
        _check_contract([config])
        run(config, args.out, **options)
    return 0


def _task_of(name: str, what: str) -> type:
    """The class of task ``name``; ConfigError naming ``what`` otherwise."""
    from attnkit.experiments.config import ConfigError

    try:
        return tasks.get(name)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{what}: {err}") from None


def _parse_sets(specs: list[str], task: str) -> dict:
    """``--set NAME=VALUE`` flags -> {name: value}, each parsed by the type of ``task``'s
    setting; refuses a malformed flag, an unknown name and a name set twice."""
    from attnkit.experiments.config import ConfigError

    cls = _task_of(task, "--set")
    out: dict = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        if not sep or not name:
            raise ConfigError(f"--set must be NAME=VALUE, got {spec!r}")
        if name in out:
            raise ConfigError(f"--set {name}=... is given twice; give each setting once")
        try:
            out[name] = cls.parse_setting(name, text)
        except (ValueError, TypeError) as err:
            raise ConfigError(str(err)) from None
    return out


def _load_task_module(spec: str) -> tuple[str, str]:
    """Import and register the user's task (its class-level contract checked); (its name, the
    spec as config.json records it)."""
    from attnkit.experiments.config import ConfigError
    from attnkit.tasks.user import load_task_module

    try:
        return load_task_module(spec)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def _load_import(spec: str) -> str:
    """Import the user's module (``--import``); the spec as config.json records it."""
    from attnkit.experiments.config import ConfigError
    from attnkit.tasks.user import load_import

    try:
        return load_import(spec)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None


def _check_contract(configs: list) -> None:
    """Hold a task that is not attnkit's own (--task-module, an installed entry point) to the
    task contract before anything trains: a tiny run of every configuration (its class was
    checked when it was registered). Says what was checked."""
    from attnkit.experiments.config import ConfigError
    from attnkit.tasks.user import CHECKED, check_task_run, is_builtin

    outside = [c for c in configs if not is_builtin(tasks.get(c.task))]
    for config in outside:
        try:
            check_task_run(tasks.get(config.task), config)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if outside:
        cls = tasks.get(outside[0].task)
        where = outside[0].task_module or f"{cls.__module__}.{cls.__qualname__}"
        runs = "" if len(outside) == 1 else f", for each of the {len(outside)} runs"
        print(
            f"task {outside[0].task!r} ({where}) passed the task contract checks{runs}: {CHECKED}",
            flush=True,
        )


def _resume(args: argparse.Namespace, given: dict, options: dict) -> None:
    """Continue a run as it was configured; flags may repeat its values, not change them,
    except ``--context-parallel`` (the number of processes that split each sequence)."""
    from attnkit.experiments.config import ConfigError
    from attnkit.experiments.runner import load_config, run

    if args.compare:
        raise ConfigError(
            "--compare cannot be combined with --resume: resume each variant's run directory "
            "on its own"
        )
    if args.out is not None:
        raise ConfigError(
            "--out cannot be combined with --resume: a run continues in its own directory"
        )
    parallel = given.pop("context_parallel", None)
    saved = load_config(args.resume)
    if parallel is not None:
        saved = replace(saved, context_parallel=parallel)
    saved = saved.resolved()
    for name, value in (given.pop("settings", None) or {}).items():
        its = (saved.settings or {}).get(name, "not a setting of its task")
        if its != value:
            raise ConfigError(
                f"--resume {str(args.resume)!r} continues the run as it was configured: "
                f"setting {name} = {value!r} contradicts its {name} = {its!r} (start a new run "
                "with --out to change it)"
            )
    for key, value in given.items():
        if getattr(saved, key) != value:
            its = getattr(saved, key)
            its = "unset (not used by its model)" if its is None else repr(its)
            raise ConfigError(
                f"--resume {str(args.resume)!r} continues the run as it was configured: "
                f"{key} = {value!r} contradicts its {key} = {its} (start a new run with --out "
                "to change it)"
            )
    run(saved, resume=args.resume, context_parallel=parallel, **options)


def _cost(run_dir: Path) -> dict:
    """The training time and peak memory the runner recorded (cost.json), as table columns."""
    import json

    from attnkit.experiments.cost import METRICS

    try:
        spent = json.loads((run_dir / "cost.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(spent[k]) for k in METRICS if isinstance(spent.get(k), int | float)}


def _axes(specs: list[str], given: dict, flags: set[str], config_file) -> list[tuple]:
    """The compared keys, in order: (key, values as given, parsed values). Refuses a malformed
    spec, a key compared twice or also set otherwise (a flag, the --config file), and a value
    listed twice."""
    from attnkit.experiments.config import ConfigError, RunConfig, parse_value

    seen: dict[str, str] = {}
    axes: list[tuple[str, list[str], list]] = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--compare must be KEY=V1,V2,..., got {spec!r}")
        if key in seen:
            raise ConfigError(
                f"--compare {key}=... is given twice ({seen[key]!r} and {spec!r}); list all "
                f"its values in one: --compare {key}=V1,V2,..."
            )
        seen[key] = spec
        if key.startswith("set."):
            axes.append(_setting_axis(spec, given, config_file))
            continue
        if key not in RunConfig.names():
            task = given.get("task", RunConfig.task)
            if key in _task_of(task, f"--compare {key}").setting_fields():
                raise ConfigError(
                    f"--compare {key}=...: {key} is a setting of task {task!r}, not a "
                    f"configuration key; compare it as --compare set.{spec}"
                )
        if key in flags:
            raise ConfigError(
                f"--compare {key}=... and the flag for {key} both set {key}; give one"
            )
        if key in given:
            by = f"--config {str(config_file)!r}" if config_file is not None else "--task-module"
            raise ConfigError(f"--compare {key}=... and {by} both set {key}; give one")
        listed = values.split(",")
        if "" in listed:
            raise ConfigError(f"--compare {spec!r} has an empty value")
        twice = sorted({v for v in listed if listed.count(v) > 1})
        if twice:
            raise ConfigError(f"--compare {key}=... lists {twice[0]!r} twice")
        parsed = [parse_value(key, v) for v in listed]
        for i, value in enumerate(parsed):
            if value in parsed[:i]:
                first = listed[parsed.index(value)]
                raise ConfigError(
                    f"--compare {key}=... lists {first!r} and {listed[i]!r}, the same value"
                )
        axes.append((key, listed, parsed))
    return axes


def _listed(spec: str) -> list[str]:
    """The values of ``KEY=V1,V2,...``; refuses an empty one and one listed twice."""
    from attnkit.experiments.config import ConfigError

    key, _, values = spec.partition("=")
    listed = values.split(",")
    if "" in listed:
        raise ConfigError(f"--compare {spec!r} has an empty value")
    twice = sorted({v for v in listed if listed.count(v) > 1})
    if twice:
        raise ConfigError(f"--compare {key}=... lists {twice[0]!r} twice")
    return listed


def _setting_axis(spec: str, given: dict, config_file) -> tuple[str, list[str], list]:
    """``--compare set.NAME=V1,V2,...``: a grid over the task's setting NAME, each value parsed
    by the setting's type; refused when --set or the --config file also sets it."""
    from attnkit.experiments.config import ConfigError, RunConfig

    key, _, _ = spec.partition("=")
    name = key.removeprefix("set.")
    if name in (given.get("settings") or {}):
        by = f"--config {str(config_file)!r} or --set" if config_file is not None else "--set"
        raise ConfigError(f"--compare {key}=... and {by} both set {name}; give one")
    cls = _task_of(given.get("task", RunConfig.task), f"--compare {key}")
    listed = _listed(spec)
    try:
        parsed = [cls.parse_setting(name, v) for v in listed]
    except (ValueError, TypeError) as err:
        raise ConfigError(f"--compare {key}: {err}") from None
    for i, value in enumerate(parsed):
        if value in parsed[:i]:
            raise ConfigError(
                f"--compare {key}=... lists {listed[parsed.index(value)]!r} and {listed[i]!r}, "
                "the same value"
            )
    return key, listed, parsed


def _dir_name(keys: tuple[str, ...], values: tuple[str, ...]) -> str:
    """``<key1>-<v1>_<key2>-<v2>...``, characters other than letters, digits, ``.+-`` in a
    value (a path's ``/``) replaced by ``_``."""
    safe = [re.sub(r"[^\w.+-]", "_", v) for v in values]
    return "_".join(f"{k}-{v}" for k, v in zip(keys, safe, strict=True))


def _compare(args: argparse.Namespace, given: dict, flags: set[str], options: dict) -> None:
    """One run per combination of the compared keys' values (their Cartesian product, the
    first key outermost), each in ``<out>/<key1>-<v1>_<key2>-<v2>...``, then the combined
    table (printed, compare.md, compare.html with learning curves and heatmaps) in ``<out>``.
    Every combination is validated before any runs."""
    from attnkit.experiments import cost
    from attnkit.experiments.compare import markdown, write_comparison
    from attnkit.experiments.config import ConfigError, RunConfig, check_output_dir
    from attnkit.experiments.runner import run

    axes = _axes(args.compare, given, flags, args.config)
    keys = tuple(key for key, _, _ in axes)
    variants = []
    for combination in itertools.product(*(zip(listed, parsed, strict=True)
                                           for _, listed, parsed in axes)):  # fmt: skip
        values = tuple(text for text, _ in combination)
        setting = {key: value for key, (_, value) in zip(keys, combination, strict=True)
                   if not key.startswith("set.")}  # fmt: skip
        chosen = {key.removeprefix("set."): value
                  for key, (_, value) in zip(keys, combination, strict=True)
                  if key.startswith("set.")}  # fmt: skip
        if chosen:
            setting["settings"] = {**(given.get("settings") or {}), **chosen}
        variants.append((values, RunConfig(**{**given, **setting})))
    resolved = [config.resolved() for _, config in variants]  # every variant, before any runs
    names = [_dir_name(keys, values) for values, _ in variants]
    clash = [n for n in names if names.count(n) > 1]
    if clash:
        raise ConfigError(f"--compare: two runs would share the directory name {clash[0]!r}")
    _check_contract(resolved)
    task = variants[0][1].task
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or Path("runs") / f"compare-{task}-{'-'.join(keys)}-{stamp}"
    check_output_dir(out)
    rows = []
    for (values, _), config, name in zip(variants, resolved, names, strict=True):
        run_dir, metrics = run(config, out / name, **options)
        rows.append((values, run_dir, {**metrics, **_cost(run_dir)}))
    info = {}
    for config in resolved:
        info.update({k: v for k, v in tasks.get(config.task).metrics.items() if k not in info})
    info.update(cost.METRICS)
    page = write_comparison(out, keys, rows, info)
    print("\n" + markdown(keys, rows, info))
    print(f"\ncomparison: {page}")
