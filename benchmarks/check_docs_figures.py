"""Release check: the figures README.md and docs/*.md state, re-measured.

Every documented figure is one row of ``FIGURES`` below: the command that produces it (an
``attnkit run ... --quick``, an ``attnkit explain``, a Python snippet), where it is documented (a
file and a template: the exact text of the sentence or table row, with each figure replaced by a
placeholder), and how it is measured. The documented values are read from the documents
themselves through the template, so the table never holds a second copy that could drift.

Placeholders:

- ``{metric}`` a held-out metric, read from the run's ``metrics.json`` (``--compare`` runs: the
  ``run`` sub-directory of the row), or, for ``attnkit explain``, a dotted path into
  ``explanation.json`` (``{wiegreffe_pinter.adversary_jsd}``; the row's ``keys`` may map a
  placeholder to another path). Runs are seeded and deterministic on a given machine with one
  thread: the measured value, printed with the documented number of decimals, must be the
  documented text exactly.
- ``{_}``: a number of another row (another column of the same table line), matched only so
  that the template finds its line.
- ``{time}`` (seconds) or ``{time_min}`` (minutes): the wall time of the command in a fresh
  process (or, for a snippet, the time its body reports). It must be within ``--tolerance``
  (1.5x) of the documented value, either way; only meaningful on a quiet machine, so a time
  mismatch on a loaded one (the table prints the load average) says little.
- ``{mib}`` (and any placeholder ending in ``mib``, such as ``{added_mib}``): a peak resident
  memory in MiB (the process's ``ru_maxrss``, or what the snippet reports), within the same
  tolerance.

A row may also state a figure the text words rather than writes (``fixed``: "about a second" is
``{"time": 1.0}``), and a bound instead of a value (``bound``: measured must not exceed it).

Every command runs in a fresh subprocess with ``OMP_NUM_THREADS=1`` and ``--threads 1`` (unless
the command says otherwise) and ``--out`` into a temporary directory. ``--runs DIR`` keeps the
run directories and each measurement (``DIR/<command>.json``); a later call with the same DIR
reuses a finished measurement instead of running it again (delete the file to re-measure), so an
interrupted check continues where it stopped. Usage::

    python benchmarks/check_docs_figures.py --list            # the rows and their commands
    python benchmarks/check_docs_figures.py --check           # every quick row (about half an hour on 2 quiet cores)
    python benchmarks/check_docs_figures.py --check --only copy-quick
    python benchmarks/check_docs_figures.py --check --slow    # also the full-budget rows (hours)
    python benchmarks/check_docs_figures.py --check --metrics-only   # skip time/memory figures
    python benchmarks/check_docs_figures.py --check --update  # write measured values into the docs
    python benchmarks/check_docs_figures.py --quotes          # figures quoted from RESULTS.md only

Figures the docs quote from the tables of ``benchmarks/RESULTS.md`` (the peer comparisons:
FlexAttention, the reference packages, ring attention's memory) are rows of ``QUOTES``: the
quoted text and the RESULTS.md heading, table and column it comes from. They are compared with
the table, not re-measured (``--quotes`` alone; every other mode prints them first).

``--check`` prints one table (row, figure, documented, measured, verdict) and exits with
status 1 on any mismatch (2 when a template no longer matches its document). ``--update``
rewrites the documented figures that differ, in place, at the documented precision: metrics
always, times and memory only when the load average stayed below the core count during the
measurement (so run it on a quiet machine to refresh them). Figures the text words instead of
writing ("about a second") are reported, never rewritten. This is a release check, not part of
the test suite.
"""

# ruff: noqa: E501  (the templates are document text, verbatim; splitting them hides what they match)

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.:-]+)\}")
NUMBER = r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)"


@dataclass(frozen=True)
class Site:
    """Where a figure is documented: a file and the text around it, figures as placeholders."""

    file: str
    template: str


@dataclass(frozen=True)
class Figure:
    """One documented measurement.

    Attributes:
        name: a short unique name (``--only``).
        argv: the command: ``("run", task, ...)`` / ``("explain", "<run:NAME>")`` for
            ``attnkit``, or ``("python", CODE)`` for a snippet that prints a JSON line
            ``FIGURE {...}`` with its own ``seconds`` / ``mib``.
        sites: where the figures are documented.
        run: the sub-directory of a ``--compare`` run whose metrics the placeholders name.
        keys: placeholder -> dotted path in the result, where the two differ.
        fixed: figures the text words instead of writing (placeholder -> value).
        bound: placeholders that are upper bounds (measured must not exceed them).
        slow: a full-budget run (minutes to hours): checked only with ``--slow``.
    """

    name: str
    argv: tuple[str, ...]
    sites: tuple[Site, ...]
    run: str = ""
    keys: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, float] = field(default_factory=dict)
    bound: frozenset[str] = frozenset()
    slow: bool = False


def row(cmd: str, *cells: str) -> str:
    """A table row of docs/experiments.md: ``| `cmd` ... | cell | cell |``."""
    return (f"| {cmd} | " if cmd else "| | ") + " | ".join(cells) + " |\n"


EXP = "docs/experiments.md"
README = "README.md"
DATES = ("exact_match", "char_accuracy", "unseen_patterns_exact_match", "aer_argmax")
BABI = ("{accuracy}", "{support_attention}", "{support_argmax}")
COPY = ("{bit_errors}", "{sequence_accuracy}", "{bit_errors_long}")
SORT = ("{sequence_accuracy}", "{position_accuracy}", "{sequence_accuracy_5}")
COVERAGE = (
    "{exact_match}",
    "{unseen_patterns_exact_match}",
    "{aer_argmax}",
    "{aer_threshold}",
    "{argmax_in_gold_field}",
    "{repeated_attention}",
    "{entropy}",
)
ERASURE = "{{erasure.{0}.share_flipped}} / {{erasure.{0}.fraction_removed_when_flipped}}"
RATIONALE_SEED0 = (  # docs/explanation.md, the rationale table's seed-0 column (attnkit explain)
    ("attention on the cues (`attention_correctness`)", "{attention_correctness}"),
    ("most-weighted word is a cue", "{argmax_on_rationale}"),
    ("uniform-weights accuracy drop", "{uniform_ablation_drop}"),
    ("Kendall τ(attention, gradient)", "{agreement.gradient.kendall_tau}"),
    ("Kendall τ(attention, input × gradient)", "{agreement.input_x_gradient.kendall_tau}"),
    ("Kendall τ(attention, integrated gradients)", "{agreement.integrated_gradients.kendall_tau}"),
    ("Kendall τ(attention, leave-one-out)", "{agreement.leave_one_out.kendall_tau}"),
    ("top-3 overlap(attention, gradient)", "{agreement.gradient.top_3_overlap}"),
    ("top-3 overlap(attention, leave-one-out)", "{agreement.leave_one_out.top_3_overlap}"),
    ("gold recall at \\|gold\\|: attention", "{rationale.attention}"),
    ("gold recall: gradient", "{rationale.gradient}"),
    ("gold recall: input × gradient", "{rationale.input_x_gradient}"),
    ("gold recall: integrated gradients", "{rationale.integrated_gradients}"),
    ("gold recall: leave-one-out", "{rationale.leave_one_out}"),
    (
        "permuted weights: median output change (TVD)",
        "{counterfactual.permuted_median_output_change}",
    ),
    ("uniform weights: output change (TVD)", "{counterfactual.uniform_output_change}"),
    (
        "adversarial weights: JSD at output change < ε (max ln 2 = 0.693)",
        "{counterfactual.adversarial_jsd}",
    ),
    (
        "share of examples with adversarial JSD > ln 2 / 2",
        "{counterfactual.share_adversarial_jsd_above_half_max}",
    ),
    ("erasure by attention: decisions flipped / fraction removed", ERASURE.format("attention")),
    ("erasure by gradient", ERASURE.format("gradient")),
    ("erasure by leave-one-out", ERASURE.format("leave_one_out")),
    ("erasure by random order", ERASURE.format("random")),
)
QUICK_COVERAGE = "`attnkit run dates --quick --threads 1 --compare attention=default,coverage`"
LM_QUICK = (
    ("default", "default (learned table, GPT)"),
    ("learned", "learned"),
    ("sinusoidal", "sinusoidal"),
    ("none", "none (no position information)"),
    ("alibi", "alibi"),
    ("rope", "rope"),
    ("t5", "t5 (relative buckets)"),
    ("shaw", "shaw (relative, keys and values)"),
    ("music", "music (relative, skewing)"),
    ("transformer_xl", "transformer_xl (relative, u and v biases)"),
)
LM = ("{perplexity}", "{date_exact_match}", "{unseen_patterns_exact_match}")

N256 = """
import json, time, torch
import attnkit as ak
torch.manual_seed(0)
start = time.perf_counter()
score = ak.scores.Additive(64, 64, 64)
q, k, v = (torch.randn(1, 256, 64, requires_grad=True) for _ in range(3))
out = ak.attention(q, k, v, score=score, align="entmax15", chunk_size=64)
out.context.sum().backward()
dense = ak.attention(q, k, v, score=score, align="entmax15")
torch.testing.assert_close(out.context, dense.context)
print("FIGURE " + json.dumps({"seconds": time.perf_counter() - start}))
"""

N8192 = """
import json, resource, time, torch
import attnkit as ak
torch.manual_seed(0)
score = ak.scores.Additive(64, 64, 64)
q, k, v = (torch.randn(1, 8192, 64) for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
start = time.perf_counter()
out = ak.attention(q, k, v, score=score, chunk_size=256)
seconds = time.perf_counter() - start
mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the whole process's peak
print("FIGURE " + json.dumps({"seconds": seconds, "mib": mib, "added_mib": mib - before}))
"""

FIGURES: tuple[Figure, ...] = (
    # --- README.md: "(about N s)" next to a command, and the quick rows of experiments.md ---
    Figure(
        "dates-quick",
        ("run", "dates", "--quick"),
        (
            Site(README, "trains `attnkit run dates --quick` (about {time} s on 2 CPU cores)"),
            Site(README, "attnkit run dates --quick # small and fast (about {time} s)"),
            Site(
                EXP,
                row(
                    "`attnkit run dates --quick`",
                    "{exact_match}",
                    "{char_accuracy}",
                    "{unseen_patterns_exact_match}",
                    "{aer_argmax}",
                    "{aer_threshold}",
                    "{argmax_in_gold_field}",
                    "{uniform_ablation_drop}",
                    "{time} s",
                ),
            ),
        ),
    ),
    Figure(
        "digits-ram-30",
        ("run", "digits", "--attention", "ram", "--epochs", "30"),
        (
            Site(
                README,
                "attnkit run digits --attention ram --epochs 30 # recurrent glimpses (Mnih et al.), about {time_min} min",
            ),
        ),
        slow=True,
    ),
    Figure(
        "babi-dot-quick",
        ("run", "babi", "--score", "dot", "--quick"),
        (
            Site(
                README,
                "attnkit run babi --score dot --quick # memory network on bAbI-style stories (about {time} s)",
            ),
            Site(
                EXP, row("`attnkit run babi --score dot --quick`", *BABI, "{entropy}", "{time} s")
            ),
        ),
    ),
    Figure(
        "babi-quick",
        ("run", "babi", "--quick"),
        (Site(EXP, row("`attnkit run babi --quick` (additive)", *BABI, "{entropy}", "{time} s")),),
    ),
    Figure(
        "babi-two-facts-mn-quick",
        ("run", "babi-two-facts", "--attention", "memory_network", "--quick"),
        (
            Site(
                README,
                "attnkit run babi-two-facts --attention memory_network --quick # Weston et al.'s memory network (about {time} s)",
            ),
            Site(
                EXP,
                row(
                    "`attnkit run babi-two-facts --attention memory_network --quick`",
                    *BABI,
                    "{time} s",
                ),
            ),
        ),
    ),
    Figure(
        "babi-two-facts-dot-quick",
        ("run", "babi-two-facts", "--score", "dot", "--quick"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run babi-two-facts --score dot --quick` (MemN2N, linear start)",
                    *BABI,
                    "{time} s",
                ),
            ),
        ),
    ),
    Figure(
        "copy-quick",
        ("run", "copy", "--quick"),
        (
            Site(
                README,
                "attnkit run copy --quick # neural Turing machine copies bit sequences (about {time} s)",
            ),
            Site(EXP, row("`attnkit run copy --quick` (NTM)", *COPY, "{time} s")),
            Site(
                "docs/memory_vision.md",
                "({time} s: no wrong bit on the trained lengths 1-5, {bit_errors_long} wrong bits of 32 on length 8 against",
            ),
        ),
    ),
    Figure(
        "copy-quick-lstm",
        ("run", "copy", "--quick", "--attention", "lstm"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run copy --quick --attention lstm` (LSTM of 64 without memory, same data and steps)",
                    *COPY,
                    "{time} s",
                ),
            ),
            Site(
                "docs/memory_vision.md",
                "wrong bits of 32 on length 8 against {bit_errors_long} for\nan LSTM without memory",
            ),
        ),
    ),
    Figure(
        "associative-recall-quick",
        ("run", "associative-recall", "--quick"),
        (
            Site(
                README,
                "attnkit run associative-recall --quick # NTM associative recall (about {time} s)",
            ),
            Site(
                EXP,
                row(
                    "`attnkit run associative-recall --quick` (NTM, 1,750 steps)", *COPY, "{time} s"
                ),
            ),
            Site(
                "docs/memory_vision.md",
                "is the paper's associative recall ({time} s; at that budget",
            ),
        ),
    ),
    Figure(
        "associative-recall-quick-lstm",
        ("run", "associative-recall", "--quick", "--attention", "lstm"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run associative-recall --quick --attention lstm` (LSTM of 64 without memory, same data and steps)",
                    *COPY,
                    "{time} s",
                ),
            ),
        ),
    ),
    Figure(
        "sort-quick",
        ("run", "sort", "--quick"),
        (
            Site(
                README,
                "attnkit run sort --quick # pointer network sorts 5-20 numbers (about {time} s)",
            ),
            Site(
                EXP, row("`attnkit run sort --quick`", *SORT, "{sequence_accuracy_20}", "{time} s")
            ),
        ),
    ),
    Figure(
        "digits-quick",
        ("run", "digits", "--quick"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run digits --quick` (6 epochs, lr 5e-3)",
                    "{accuracy}",
                    "{attention_correctness}",
                    "{entropy}",
                    "{uniform_ablation_drop}",
                    "{time} s",
                ),
            ),
        ),
    ),
    # --- attnkit explain (README.md, docs/explanation.md) ---
    Figure(
        "rationale",
        ("run", "rationale"),
        (
            Site(
                "docs/explanation.md",
                "attnkit run rationale --out runs/rationale # about {time} s on 2 CPU cores",
            ),
        ),
    ),
    Figure(
        "rationale-explain",
        ("explain", "<run:rationale>"),
        (
            Site(
                "docs/explanation.md",
                "attnkit explain runs/rationale # about {time} s: explanation.json + report.html",
            ),
            *(
                Site("docs/explanation.md", f"| {label} | {cell}" + f" | {other}" * 3 + " |\n")
                for label, cell in RATIONALE_SEED0
                for other in ["{_} / {_}" if " / " in cell else "{_}"]
            ),
        ),
    ),
    Figure(
        "rationale-and-explain",
        ("sum", "rationale", "rationale-explain"),  # the two rows' times added
        (
            Site(
                README,
                "attnkit run rationale --out runs/rationale && attnkit explain runs/rationale # about {time} s",
            ),
            Site(
                "docs/explanation.md",
                "A rationale run and its explanation take about {time} s together",
            ),
        ),
    ),
    *(
        Figure(
            f"rationale-s{seed}",
            ("run", "rationale", "--seed", str(seed)),
            (),
        )
        for seed in (1, 2)
    ),
    Figure(
        "rationale-explain-seeds",
        ("explain", "<run:rationale>", "--other-seeds", "<run:rationale-s1>", "<run:rationale-s2>"),
        (
            Site(
                "docs/explanation.md",
                "| other seeds: attention JSD from this run's / output change (TVD)"
                " | {seed_variance.jsd} / {seed_variance.output_change} |",
            ),
            Site(
                "docs/explanation.md",
                "| trained adversary: attention JSD / output change / same prediction"
                " | {wiegreffe_pinter.adversary_jsd} / {wiegreffe_pinter.adversary_output_change}"
                " / {wiegreffe_pinter.adversary_agreement} |",
            ),
            *(
                Site("docs/explanation.md", f"| {label} | {{{key}}} | {{_}} | {{_}} |\n")
                for label, key in (
                    (
                        "per-example adversarial weights (above): JSD at output change < 0.01",
                        "counterfactual.adversarial_jsd",
                    ),
                    (
                        "item-wise MLP, uniform pooling: accuracy",
                        "wiegreffe_pinter.frozen_mlp_accuracy.uniform",
                    ),
                    (
                        "item-wise MLP, its own attention",
                        "wiegreffe_pinter.frozen_mlp_accuracy.learned",
                    ),
                    (
                        "item-wise MLP, the model's attention frozen",
                        "wiegreffe_pinter.frozen_mlp_accuracy.model",
                    ),
                    (
                        "item-wise MLP, the adversary's attention frozen",
                        "wiegreffe_pinter.frozen_mlp_accuracy.adversary",
                    ),
                )
            ),
        ),
    ),
    # --- --compare tables of experiments.md at the quick budget ---
    *(
        Figure(
            f"sort-quick-compare-{score}",
            ("run", "sort", "--quick", "--compare", "score=additive,general,hermitian"),
            (Site(EXP, row(label, *SORT, "{sequence_accuracy_20}")),),
            run=f"score-{score}",
        )
        for score, label in (
            ("additive", "additive (Vinyals et al.)"),
            ("general", "general"),
            ("hermitian", "hermitian"),
        )
    ),
    *(
        Figure(
            f"pairs-quick-{attention}",
            ("run", "pairs", "--quick", "--compare", "attention=decomposable,parallel,nested"),
            (Site(EXP, row(label, "{accuracy}", "{alignment_accuracy}")),),
            run=f"attention-{attention}",
        )
        for attention, label in (
            ("decomposable", "decomposable (Parikh et al.: attend, compare, aggregate)"),
            ("parallel", "parallel co-attention (additive co-compatibility, eqs. 14-15)"),
            ("nested", "nested, attention-over-attention (Cui et al.)"),
        )
    ),
    *(
        Figure(
            f"dates-quick-coverage-{attention}",
            (
                "run",
                "dates",
                "--quick",
                "--threads",
                "1",
                "--compare",
                "attention=default,coverage",
            ),
            (Site(EXP, template),),
            run=f"attention-{attention}",
        )
        for attention, template in (
            ("default", row(QUICK_COVERAGE, "default", *COVERAGE)),
            (
                "coverage",
                row(QUICK_COVERAGE, "default", *("{_}",) * 7) + row("", "coverage", *COVERAGE),
            ),
        )
    ),
    *(
        Figure(
            f"dates-lm-quick-{position}",
            (
                "run",
                "dates-lm",
                "--quick",
                "--score",
                "scaled_dot",
                "--compare",
                "position=default,learned,sinusoidal,none,alibi,rope,t5,shaw,music,transformer_xl",
            ),
            (Site(EXP, (row(before, "{_}", "{_}", "{_}") if before else "") + row(label, *LM)),),
            run=f"position-{position}",
        )
        for (position, label), (_, before) in zip(LM_QUICK, (("", ""), *LM_QUICK), strict=False)
    ),
    # --- Python snippets (docs/kernels.md, README.md) ---
    Figure(
        "kernels-n256",
        ("python", N256),
        (
            Site(
                "docs/kernels.md",
                "compiles the additive tile with `torch.compile` (inductor), which takes several seconds (about\n{time} s on 2 quiet cores",
            ),
        ),
    ),
    Figure(
        "readme-additive-8192",
        ("python", N8192),
        (
            Site(
                README,
                "while the chunked call adds about {added_mib} MiB (the whole process\npeaks at about {mib} MiB)",
            ),
        ),
        slow=True,
    ),
    # --- full-budget rows (minutes each): --slow ---
    Figure(
        "dates",
        ("run", "dates"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run dates`",
                    "{exact_match}",
                    "{char_accuracy}",
                    "{unseen_patterns_exact_match}",
                    "{aer_argmax}",
                    "{aer_threshold}",
                    "{argmax_in_gold_field}",
                    "{uniform_ablation_drop}",
                    "{time} s",
                ),
            ),
        ),
        slow=True,
    ),
    Figure(
        "dates-supervised",
        ("run", "dates", "--supervise-attention", "1.0"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run dates --supervise-attention 1.0`",
                    "{exact_match}",
                    "{char_accuracy}",
                    "{unseen_patterns_exact_match}",
                    "{aer_argmax}",
                    "{aer_threshold}",
                    "{argmax_in_gold_field}",
                    "{uniform_ablation_drop}",
                    "{time} s",
                ),
            ),
        ),
        slow=True,
    ),
    Figure(
        "digits",
        ("run", "digits"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run digits` (soft)",
                    "{accuracy}",
                    "{attention_correctness}",
                    "{entropy}",
                    "{uniform_ablation_drop}",
                    "{time} s",
                ),
            ),
        ),
        slow=True,
    ),
    Figure(
        "digits-hard",
        ("run", "digits", "--align", "hard"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run digits --align hard` (REINFORCE)",
                    "{accuracy}",
                    "{attention_correctness}",
                    "{entropy}",
                    "{uniform_ablation_drop}",
                    "{time} s",
                ),
            ),
        ),
        slow=True,
    ),
    Figure(
        "babi-dot",
        ("run", "babi", "--score", "dot"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run babi --score dot` (the paper's uᵀm_i)",
                    *BABI,
                    "{entropy}",
                    "{time} s",
                ),
            ),
        ),
        slow=True,
    ),
    Figure(
        "babi",
        ("run", "babi"),
        (Site(EXP, row("`attnkit run babi` (additive score)", *BABI, "{entropy}", "{time} s")),),
        slow=True,
    ),
    Figure(
        "babi-mn",
        ("run", "babi", "--attention", "memory_network"),
        (Site(EXP, row("`attnkit run babi --attention memory_network`", *BABI, "{time} s")),),
        slow=True,
    ),
    Figure(
        "babi-two-facts-dot",
        ("run", "babi-two-facts", "--score", "dot"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run babi-two-facts --score dot` (MemN2N, linear start: softmax back after epoch 5)",
                    *BABI,
                    "{time} s",
                ),
            ),
        ),
        slow=True,
    ),
    Figure(
        "babi-two-facts-mn",
        ("run", "babi-two-facts", "--attention", "memory_network"),
        (
            Site(
                EXP,
                row("`attnkit run babi-two-facts --attention memory_network`", *BABI, "{time} s"),
            ),
        ),
        slow=True,
    ),
    Figure(
        "babi-yes-no-dot",
        ("run", "babi-yes-no", "--score", "dot"),
        (Site(EXP, row("`attnkit run babi-yes-no --score dot` (MemN2N)", *BABI, "{time} s")),),
        slow=True,
    ),
    Figure(
        "babi-yes-no-mn",
        ("run", "babi-yes-no", "--attention", "memory_network"),
        (
            Site(
                EXP, row("`attnkit run babi-yes-no --attention memory_network`", *BABI, "{time} s")
            ),
        ),
        slow=True,
    ),
    Figure(
        "babi-counting-dot",
        ("run", "babi-counting", "--score", "dot"),
        (Site(EXP, row("`attnkit run babi-counting --score dot` (MemN2N)", *BABI, "{time} s")),),
        slow=True,
    ),
    Figure(
        "dates-lm",
        ("run", "dates-lm", "--score", "scaled_dot"),
        (
            Site(
                EXP,
                row(
                    "`attnkit run dates-lm --score scaled_dot` (learned absolute positions, 3,750 steps)",
                    *LM,
                    "{time_min} min",
                ),
            ),
        ),
        slow=True,
    ),
)


# ----------------------------------------------------------------------------------------------
# Documents


def _literal(text: str) -> str:
    # one space in a template stands for any run of spaces (aligned comments in code blocks)
    return " +".join(re.escape(piece) for piece in re.split(" +", text))


def _pattern(template: str) -> tuple[re.Pattern, list[str]]:
    names, parts, at = [], [], 0
    for m in PLACEHOLDER.finditer(template):
        parts.append(_literal(template[at : m.start()]))
        parts.append(NUMBER)
        names.append(m.group(1))
        at = m.end()
    parts.append(_literal(template[at:]))
    return re.compile("".join(parts)), names


def documented(site: Site) -> tuple[dict[str, str], str | None]:
    """The figures a site states (placeholder -> text), or an error saying why not."""
    text = (ROOT / site.file).read_text(encoding="utf-8")
    pattern, names = _pattern(site.template)
    found = list(pattern.finditer(text))
    if len(found) != 1:
        return (
            {},
            f"{site.file}: template found {len(found)} times (expected once): {site.template[:70]!r}",
        )
    values: dict[str, str] = {}
    for name, value in zip(names, found[0].groups(), strict=True):
        if name.startswith("_"):  # a figure of another row, matched only to place this one
            continue
        if values.setdefault(name, value) != value:
            return {}, f"{site.file}: {{{name}}} stated as {values[name]} and {value}"
    return values, None


def update(site: Site, new: dict[str, str]) -> bool:
    """Rewrite the figures of one site in place; True when the file changed."""
    path = ROOT / site.file
    text = path.read_text(encoding="utf-8")
    pattern, names = _pattern(site.template)
    found = list(pattern.finditer(text))
    if len(found) != 1:
        return False
    m = found[0]
    pieces, at = [], m.start()
    for i, name in enumerate(names, start=1):
        pieces.append(text[at : m.start(i)])
        pieces.append(new.get(name, m.group(i)))
        at = m.end(i)
    pieces.append(text[at : m.end()])
    replaced = text[: m.start()] + "".join(pieces) + text[m.end() :]
    if replaced != text:
        path.write_text(replaced, encoding="utf-8")
    return replaced != text


def decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def number(text: str) -> float:
    return float(text.replace(",", ""))


# ----------------------------------------------------------------------------------------------
# Figures the docs quote from benchmarks/RESULTS.md (the peer tables): read, not re-measured

RESULTS = "benchmarks/RESULTS.md"


@dataclass(frozen=True)
class Quote:
    """A figure the docs quote from a table of RESULTS.md.

    Attributes:
        name: a short unique name.
        site: where the docs quote it (placeholders as in :class:`Figure`).
        section: the start of the RESULTS.md heading whose tables hold the source.
        table: which table under that heading (0: the first), up to the next heading of the
            same or a higher level.
        figures: placeholder -> (column, row filter {column: text}, ``"min"`` / ``"max"`` /
            ``"all"`` (every selected cell equal)); the cells' numbers ("0.77x", "**0.84x**"
            read as 0.77, 0.84).
    """

    name: str
    site: Site
    section: str
    figures: dict[str, tuple[str, dict[str, str], str]]
    table: int = 0


CELL_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?")


def results_table(section: str, index: int = 0, text: str | None = None) -> list[dict[str, str]]:
    """Table ``index`` under the RESULTS.md heading that starts with ``section``, as rows of
    {column header: cell}; ValueError naming the heading when it or the table is missing."""
    lines = (
        text if text is not None else (ROOT / RESULTS).read_text(encoding="utf-8")
    ).splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.lstrip("#").strip().startswith(section)
         and line.startswith("#")),
        None,
    )  # fmt: skip
    if start is None:
        raise ValueError(f"{RESULTS}: no heading starting with {section!r}")
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    tables: list[list[list[str]]] = []
    previous = ""
    for line in lines[start + 1 :]:
        hashes = len(line) - len(line.lstrip("#"))
        if line.startswith("#") and hashes <= level:
            break
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not previous.startswith("|"):
                tables.append([])
            if not all(set(c) <= set("-: ") for c in cells):
                tables[-1].append(cells)
        previous = line
    if index >= len(tables):
        raise ValueError(f"{RESULTS}: {section!r} has {len(tables)} tables, not {index + 1}")
    head, *rows = tables[index]
    return [dict(zip(head, row, strict=False)) for row in rows]


def quoted_value(rows: list[dict[str, str]], column: str, where: dict[str, str], how: str) -> float:
    """The figure ``how`` reduces from ``column`` of the rows matching ``where``."""
    cells = [r.get(column, "") for r in rows if all(r.get(k) == v for k, v in where.items())]
    numbers = [float(m.group().replace(",", "")) for c in cells if (m := CELL_NUMBER.search(c))]
    if not numbers:
        raise ValueError(f"no number in column {column!r} of the rows {where}")
    if how == "min":
        return min(numbers)
    if how == "max":
        return max(numbers)
    if how == "all" and len(set(numbers)) == 1:
        return numbers[0]
    raise ValueError(f"column {column!r} of the rows {where}: {how!r} of {numbers}")


PEERS_2026_11_28 = "Peer figures corrected"
TRAINABLE_SPARSE_EVENING = "NSA, DSA and the layers, evening"
SECOND_MACHINE = "A second machine"
PEER_TIME = ("time ratio", {}, "max")
QUOTES: tuple[Quote, ...] = (
    Quote(
        "readme-flex-bigbird",
        Site(README, "| block-sparse forward vs `torch.compile(flex_attention)`, steady state, 4k / 16k: window, causal + window, ALiBi, causal, document, BigBird | {_}-{_} (BigBird {bigbird_lo}-{bigbird_hi}, FlexAttention given its own mask_mod) |"),
        PEERS_2026_11_28,
        {"bigbird_lo": ("ratio", {"pattern": "bigbird"}, "min"),
         "bigbird_hi": ("ratio", {"pattern": "bigbird"}, "max")},
    ),
    Quote(
        "readme-peers-nystrom-performer",
        Site(README, "| Nyström and Performer vs nystrom-attention and performer-pytorch at the packages' defaults, 1k-16k, time | {peers_lo}-{peers_hi} |"),
        PEERS_2026_11_28,
        {"peers_lo": ("time ratio", {}, "min"), "peers_hi": ("time ratio", {}, "max")},
        table=1,
    ),
    *(
        Quote(
            f"distributed-ring-live-p{p}",
            Site("docs/distributed.md", f"| {p} | {{_}} | {{_}} | {{live_lo}}-{{live_hi}} | {{_}} |"),
            PEERS_2026_11_28,
            {"live_lo": ("live MiB / rank", {"P": str(p)}, "min"),
             "live_hi": ("live MiB / rank", {"P": str(p)}, "max")},
            table=2,
        )
        for p in (1, 2, 4)
    ),
    *(
        Quote(
            f"trainable-sparse-nsa-{machine}-{what}",
            Site("docs/trainable_sparse.md", row),
            section,
            {f"{'f' if step == 'forward' else 'b'}{n}": ("NSA / SDPA", {"N": str(n), "step": step}, "all")
             for step in ("forward", "forward+backward") for n in sizes},
            table=table,
        )
        for machine, section, sizes, what, table, row in (
            ("amd", TRAINABLE_SPARSE_EVENING, (8192, 16384), "time", 1,
             "| AMD EPYC | {f8192} / {f16384} / — | {b8192} / {b16384} / — | {_}x / {_}x"),
            ("amd", TRAINABLE_SPARSE_EVENING, (16384,), "memory", 2,
             "| AMD EPYC | {_} / {_} / — | {_} / {_} / — | {f16384}x / {b16384}x"),
            ("intel", SECOND_MACHINE, (8192, 16384, 32768), "time", 0,
             "| Intel Xeon (AVX-512) | {f8192} / {f16384} / {f32768} | {b8192} / {b16384} / {b32768} | {_}x / {_}x |"),
            ("intel", SECOND_MACHINE, (16384,), "memory", 1,
             "| Intel Xeon (AVX-512) | {_} / {_} / {_} | {_} / {_} / {_} | {f16384}x / {b16384}x |"),
        )
    ),
    Quote(
        "trainable-sparse-dsa-time",
        Site("docs/trainable_sparse.md", "AVX-512 the forward measures {f8}x at 8192 and {f16}x at 16384, forward + backward {b8}x\nand {b16}x"),
        SECOND_MACHINE,
        {"f8": ("DSA / SDPA", {"N": "8192", "step": "forward"}, "all"),
         "f16": ("DSA / SDPA", {"N": "16384", "step": "forward"}, "all"),
         "b8": ("DSA / SDPA", {"N": "8192", "step": "forward+backward"}, "all"),
         "b16": ("DSA / SDPA", {"N": "16384", "step": "forward+backward"}, "all")},
        table=6,
    ),
)  # fmt: skip


def check_quotes(quotes: tuple[Quote, ...] = QUOTES, text: str | None = None) -> list[str]:
    """Each quote's verdict line; a line starting with ``NO`` is a mismatch or a broken row."""
    out = []
    for quote in quotes:
        stated, error = documented(quote.site)
        if error:
            out.append(f"NO {quote.name}: {error}")
            continue
        try:
            rows = results_table(quote.section, quote.table, text)
        except ValueError as err:
            out.append(f"NO {quote.name}: {err}")
            continue
        for name, doc in stated.items():
            column, where, how = quote.figures[name]
            try:
                value = quoted_value(rows, column, where, how)
            except ValueError as err:
                out.append(f"NO {quote.name} {{{name}}}: {err}")
                continue
            shown = f"{value:.{decimals(doc)}f}"
            verdict = "yes" if shown == doc else "NO"
            out.append(f"{verdict} {quote.name} {{{name}}}: {quote.site.file} says {doc}, "
                       f"{RESULTS} gives {shown}")  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# Measuring


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _flatten(value, prefix: str = "") -> dict[str, float]:
    if isinstance(value, dict):
        out: dict[str, float] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}{key}."))
        return out
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {}
    return {prefix[:-1]: float(value)}


def _spawn(argv: list[str], cwd: Path) -> dict:
    """Run a command in a fresh process: wall seconds, peak RSS (MiB), load, output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    load_before = _load()
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - start
        log.seek(0)
        output = log.read()
    return {
        "returncode": proc.returncode,
        "seconds": wall,
        "mib": usage.ru_maxrss / 1024,
        "load": f"{load_before:.1f}-{_load():.1f}",
        "output": output,
    }


def _attnkit() -> list[str]:
    return [sys.executable, "-m", "attnkit"]


def _with_threads(argv: tuple[str, ...]) -> list[str]:
    out = list(argv)
    if out[0] == "run" and "--threads" not in out:
        out += ["--threads", "1"]
    if out[0] == "run":
        out += ["--no-progress"]
    return out


def _slug(argv: tuple[str, ...]) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", " ".join(argv))[:120]


class Measurer:
    """Runs each distinct command once per invocation (rows that share one share its result)."""

    def __init__(self, runs: Path) -> None:
        self.runs = runs
        self.done: dict[tuple[str, ...], dict] = {}

    def measure(self, figure: Figure) -> dict:
        if figure.argv not in self.done:
            self.done[figure.argv] = self._measure(figure.argv)
        result = self.done[figure.argv]
        if result.get("error"):
            return result
        values = dict(result["values"])
        if figure.run:
            sub = self.runs / _slug(figure.argv) / figure.run / "metrics.json"
            if not sub.is_file():
                return {**result, "error": f"no {sub}"}
            values.update(_flatten(json.loads(sub.read_text())))
        return {**result, "values": values}

    def _measure(self, argv: tuple[str, ...]) -> dict:
        out = self.runs / _slug(argv)
        record = self.runs / (_slug(argv) + ".json")
        if record.is_file():  # a finished measurement kept with --runs
            return json.loads(record.read_text())
        if argv[0] == "sum":
            parts = [self._measure(next(f for f in FIGURES if f.name == n).argv) for n in argv[1:]]
            failed = [p for p in parts if p.get("error")]
            if failed:
                return failed[0]
            seconds = sum(p["seconds"] for p in parts)
            load = " ".join(p["load"] for p in parts).replace(" ", "-")
            values = {"time": seconds, "time_min": seconds / 60}
            return {"returncode": 0, "seconds": seconds, "load": load, "values": values}
        if argv[0] == "python":
            result = _spawn([sys.executable, "-c", argv[1]], ROOT)
            line = [x for x in result["output"].splitlines() if x.startswith("FIGURE ")]
            if result["returncode"] != 0 or not line:
                return {**result, "error": result["output"][-400:]}
            reported = json.loads(line[-1][len("FIGURE ") :])
            values = {"time": reported.get("seconds", result["seconds"])}
            values.update({k: v for k, v in reported.items() if k != "seconds"})
            result["values"] = values
        else:
            command = list(argv)
            if command[0] == "explain":
                for i, word in enumerate(command):
                    if word.startswith("<run:"):  # a run of another row, made first
                        prior = next(f for f in FIGURES if f.name == word[5:-1])
                        self._measure(prior.argv)
                        command[i] = str(self.runs / _slug(prior.argv))
            else:
                command = [*_with_threads(argv), "--out", str(out)]
            result = _spawn(_attnkit() + command, ROOT)
            if result["returncode"] != 0:
                return {**result, "error": result["output"][-400:]}
            values = {"time": result["seconds"], "mib": result["mib"]}
            run_dir = Path(command[1]) if command[0] == "explain" else out
            for name in (
                ("metrics.json", "explanation.json")
                if command[0] == "explain"
                else ("metrics.json",)
            ):
                if (run_dir / name).is_file():
                    values.update(_flatten(json.loads((run_dir / name).read_text())))
            result["values"] = values
        result["values"]["time_min"] = result["values"]["time"] / 60
        result.pop("output", None)
        record.write_text(json.dumps(result, indent=1))
        return result


COSTS = ("time", "time_min", "mib")  # and every placeholder ending in "mib"


def _quiet(load: str) -> bool:
    """Whether a measurement's load average (``"before-after"``) stayed below the core count,
    the condition for writing a time or memory figure into the docs."""
    try:
        return max(float(x) for x in load.split("-")) < (os.cpu_count() or 1)
    except ValueError:
        return False


def compare(
    name: str, doc: str, measured: float, figure: Figure, tolerance: float
) -> tuple[str, bool]:
    """The measured value as printed, and whether it agrees with the documented text."""
    if name in COSTS or name.endswith("mib"):
        shown = f"{measured:.{max(decimals(doc), 1)}f}"
        want = number(doc)
        if name in figure.bound:
            return shown, measured <= want
        return shown, want / tolerance <= measured <= want * tolerance
    shown = f"{measured:.{decimals(doc)}f}"
    return shown, shown == doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the rows and their commands")
    parser.add_argument("--check", action="store_true", help="re-measure and compare")
    parser.add_argument(
        "--quotes",
        action="store_true",
        help="only compare the figures the docs quote from RESULTS.md's tables (nothing is run)",
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="only this row (repeatable)"
    )
    parser.add_argument("--slow", action="store_true", help="include the full-budget rows")
    parser.add_argument(
        "--metrics-only", action="store_true", help="compare metrics, not times/memory"
    )
    parser.add_argument(
        "--update", action="store_true", help="write measured figures that differ into the docs"
    )
    parser.add_argument(
        "--tolerance", type=float, default=1.5, help="time/memory factor (default 1.5)"
    )
    parser.add_argument(
        "--runs", type=Path, help="keep run directories here and reuse finished ones"
    )
    args = parser.parse_args()

    quotes = check_quotes()
    for line in quotes:
        print(line)
    quotes_bad = sum(line.startswith("NO") for line in quotes)
    if args.quotes:
        return 1 if quotes_bad else 0

    names = {f.name for f in FIGURES}
    unknown = [n for n in args.only if n not in names]
    if unknown:
        parser.error(f"--only: unknown row(s) {unknown}; rows: {', '.join(sorted(names))}")
    if args.only:
        rows = [f for f in FIGURES if f.name in args.only]
    else:
        rows = [f for f in FIGURES if args.slow or not f.slow]

    broken = 0
    for figure in rows:
        for site in figure.sites:
            _, error = documented(site)
            if error:
                print(f"{figure.name}: {error}")
                broken += 1
    if args.list or not args.check:
        for figure in rows:
            kind = figure.argv[0]
            if kind == "python":
                shown = "a Python snippet"
            elif kind == "sum":
                shown = "the times of " + " + ".join(figure.argv[1:])
            else:
                shown = "attnkit " + shlex.join(figure.argv)
            print(f"{figure.name:34} {'(slow) ' if figure.slow else ''}{shown}")
        return 2 if broken else 0

    runs = args.runs or Path(tempfile.mkdtemp(prefix="docs-figures-"))
    runs.mkdir(parents=True, exist_ok=True)
    measurer = Measurer(runs)
    bad = 0
    print("| row | figure | where | documented | measured | agrees | load |")
    print("|---|---|---|---:|---:|---|---|")
    for figure in rows:
        result = measurer.measure(figure)
        if result.get("error"):
            print(f"| {figure.name} | (command failed) | | | | no | {result.get('load', '')} |")
            print(result["error"], file=sys.stderr)
            bad += 1
            continue
        for site in figure.sites:
            stated, error = documented(site)
            if error:
                continue
            stated.update({k: f"{v:g}" for k, v in figure.fixed.items()})
            new: dict[str, str] = {}
            for name, doc in stated.items():
                if args.metrics_only and (name in COSTS or name.endswith("mib")):
                    continue
                key = figure.keys.get(name, name)
                if key not in result["values"]:
                    print(
                        f"| {figure.name} | {name} | {site.file} | {doc} | (not measured) | no | |"
                    )
                    bad += 1
                    continue
                shown, ok = compare(name, doc, result["values"][key], figure, args.tolerance)
                print(
                    f"| {figure.name} | {name} | {site.file} | {doc} | {shown} | "
                    f"{'yes' if ok else 'NO'} | {result['load']} |"
                )
                if not ok:
                    bad += 1
                    if name in figure.fixed:
                        continue  # worded, not written: the sentence needs a person
                    if name not in COSTS and not name.endswith("mib"):
                        new[name] = shown
                    elif _quiet(result["load"]):
                        new[name] = f"{number(shown):.{decimals(doc)}f}"
                    elif args.update:
                        print(
                            f"  not updated ({name}): load {result['load']} on {os.cpu_count()} cores"
                        )
            if args.update and new and update(site, new):
                print(f"  updated {site.file}: {new}")
    print(f"\nrun directories: {runs}")
    if broken:
        return 2
    return 1 if bad or quotes_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
