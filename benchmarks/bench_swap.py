"""The cost of :func:`attnkit.integrations.transformers.swap_attention`: a transformers model
with attnkit's attention swapped in (the defaults: the model's scaled dot product, softmax)
against the same model with its own attention, in one process.

Models from small random configs (no download), float32, eval, ``--threads`` threads:

- GPT-2 forward: 4 layers, n_embd 256, 4 heads, batch 4 × 128 tokens;
- GPT-2 ``generate``: the same model, greedy with the KV cache, a 32-token prompt + 64 new tokens,
  batch 1;
- BERT forward: 4 layers, hidden 256, 4 heads, batch 4 × 128 tokens with padding (the last two
  rows end 32 and 64 tokens early).

Each case holds three copies of one model (same weights): transformers' ``sdpa`` attention (the
default), its ``eager`` attention and the swap. They run interleaved (sdpa, swap, eager; then
swap, eager, sdpa; …) so that load changes hit all three and none always runs first. Each repeat
gives a ratio swap / sdpa and swap / eager; the table shows the medians of these paired ratios
(≤ 1: the swap is no slower), by wall time and by the thread's CPU time (steadier on a loaded
machine). Outputs are compared before timing (max abs diff; generated tokens must be
identical), so that speed is not bought by a wrong answer.

``--inside`` measures instead, in place, the thread CPU time spent inside the attention
functions and the mask function of the ``sdpa`` model and of the swapped model (their entries in
transformers' attention and mask registries, wrapped with a timer), over paired runs of each case:
what the swap adds where it acts, steadier than the ratio of whole-model times on a loaded
machine.

    python benchmarks/bench_swap.py [--repeats 15] [--quick] [--threads 1] [--inside]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable

import torch

from attnkit.benchmarking.timing import machine
from attnkit.integrations.transformers import swap_attention

VOCAB = 1024


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=256,
        n_embd=256,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).eval()


def _bert():
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return BertModel(config).eval()


def _variants(model) -> dict[str, torch.nn.Module]:
    """sdpa, swap and eager copies of ``model`` (same weights)."""
    out = {}
    for name in ("sdpa", "swap", "eager"):
        m = copy.deepcopy(model)
        if name == "swap":
            swap_attention(m)
        else:
            m.set_attn_implementation(name)
        out[name] = m
    return out


def _cases(quick: bool) -> list[tuple[str, dict[str, Callable[[], torch.Tensor]], bool]]:
    """(label, {variant: call}, exact tokens?) for each case."""
    g = torch.Generator().manual_seed(1)
    b, n = (2, 64) if quick else (4, 128)
    new = 16 if quick else 64
    gpt2 = _variants(_gpt2())
    ids = torch.randint(0, VOCAB, (b, n), generator=g)
    prompt = torch.randint(0, VOCAB, (1, 32), generator=g)
    prompt_mask = torch.ones_like(prompt)
    bert = _variants(_bert())
    bert_ids = torch.randint(0, VOCAB, (b, n), generator=g)
    bert_mask = torch.ones(b, n, dtype=torch.long)
    bert_mask[-1, n - n // 4 :] = 0
    bert_mask[-2, n - n // 2 :] = 0

    def forward(m):
        return lambda: m(ids).logits

    def generate(m):
        return lambda: m.generate(
            prompt,
            attention_mask=prompt_mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )

    def encode(m):
        return lambda: m(bert_ids, attention_mask=bert_mask).last_hidden_state

    return [
        (f"GPT-2 forward, batch {b} × {n}", {k: forward(m) for k, m in gpt2.items()}, False),
        (
            f"GPT-2 generate, prompt 32 + {new} new, batch 1",
            {k: generate(m) for k, m in gpt2.items()},
            True,
        ),
        (f"BERT forward, batch {b} × {n}, padded", {k: encode(m) for k, m in bert.items()}, False),
    ]


def _time(fn: Callable[[], torch.Tensor], inner: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call: ``time.perf_counter`` and ``time.thread_time`` (with one
    torch thread every operation runs on the calling thread, so its CPU time leaves out the
    time spent waiting for a core on a loaded machine)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - wall) / inner, (time.thread_time() - cpu) / inner


def _inner(fn: Callable[[], torch.Tensor], target: float = 0.05) -> int:
    """Calls per sample so that one sample lasts about ``target`` seconds."""
    once = _time(fn, 1)[0]
    return max(1, round(target / max(once, 1e-6)))


def _ratio(times: dict[str, list[tuple[float, float]]], other: str, clock: int) -> float:
    """Median over the repeats of swap / ``other`` on ``clock`` (0: wall, 1: CPU)."""
    pairs = zip(times["swap"], times[other], strict=True)
    return statistics.median(s[clock] / r[clock] for s, r in pairs)


def _inside(repeats: int, quick: bool) -> None:
    """The table of ``--inside`` (see the module's text)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    spent = {"attention": 0.0, "mask": 0.0}
    cases = _cases(quick)  # (the swaps register their functions here)
    for table, slot in (
        (ALL_ATTENTION_FUNCTIONS, "attention"),
        (ALL_MASK_ATTENTION_FUNCTIONS, "mask"),
    ):
        mapping = table._global_mapping
        for name in [n for n in mapping if n == "sdpa" or n.startswith("attnkit")]:

            def timed(*a, _fn=mapping[name], _slot=slot, **k):
                start = time.thread_time()
                try:
                    return _fn(*a, **k)
                finally:
                    spent[_slot] += time.thread_time() - start

            mapping[name] = timed
    print(
        "| case | sdpa model, CPU (ms) | sdpa: attention + mask (ms) "
        "| swap: attention + mask (ms) | swap's extra |"
    )
    print("|---|---:|---:|---:|---:|")
    with torch.no_grad():
        for label, fns, _ in cases:
            runs: dict[str, list[tuple[float, float, float]]] = {"sdpa": [], "swap": []}
            for name in runs:
                fns[name]()
            for r in range(repeats):
                for name in ("sdpa", "swap") if r % 2 == 0 else ("swap", "sdpa"):
                    spent["attention"] = spent["mask"] = 0.0
                    start = time.thread_time()
                    fns[name]()
                    total = time.thread_time() - start
                    runs[name].append((total, spent["attention"], spent["mask"]))
            ms = {
                n: [1e3 * statistics.median(run[i] for run in v) for i in range(3)]
                for n, v in runs.items()
            }
            s, w = ms["sdpa"], ms["swap"]
            extra = w[1] + w[2] - s[1] - s[2]
            print(
                f"| {label} | {s[0]:.1f} | {s[1]:.2f} + {s[2]:.2f} | {w[1]:.2f} + {w[2]:.2f} "
                f"| {extra:+.2f} ms ({100 * extra / s[0]:+.1f} %) |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="smaller inputs, 5 repeats")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--inside",
        action="store_true",
        help="CPU time inside the attention and mask functions, sdpa model vs swap",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else args.repeats
    if args.inside:
        print(f"Machine: {machine()}; {args.threads} thread(s), float32, eval, no_grad")
        print(f"Thread CPU time, medians of {repeats} paired runs (sdpa and swap alternating)\n")
        _inside(repeats, args.quick)
        return
    rows = []
    with torch.no_grad():
        for label, fns, tokens in _cases(args.quick):
            outs = {k: f() for k, f in fns.items()}
            if tokens:
                same = all(torch.equal(outs["swap"], outs[k]) for k in ("sdpa", "eager"))
                if not same:
                    raise SystemExit(f"{label}: the swapped model generates other tokens")
                diffs = ("identical", "identical")
            else:
                diffs = tuple(
                    f"{(outs['swap'] - outs[k]).abs().max().item():.1e}" for k in ("sdpa", "eager")
                )
            inner = _inner(fns["sdpa"])
            load = os.getloadavg()[0]
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
            order = ["sdpa", "swap", "eager"]
            for r in range(repeats):
                for k in order[r % 3 :] + order[: r % 3]:  # each goes first in turn
                    times[k].append(_time(fns[k], inner))
            load = (load + os.getloadavg()[0]) / 2
            ratios = [_ratio(times, other, c) for c in (0, 1) for other in ("sdpa", "eager")]
            ms = {k: 1e3 * statistics.median(t[0] for t in v) for k, v in times.items()}
            rows.append((label, ms, ratios, diffs, load))

    import transformers

    print(f"Machine: {machine()}")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.threads} thread(s), float32, eval, no_grad"
    )
    print(
        f"Medians of {repeats} paired repeats (sdpa, swap, eager interleaved, rotating); "
        "ratios by wall time and by the thread's CPU time; load: 1-minute load average during "
        "the case\n"
    )
    print(
        "| case | sdpa (ms) | swap (ms) | eager (ms) | swap / sdpa | swap / eager "
        "| CPU: swap / sdpa | CPU: swap / eager | max abs diff vs sdpa | vs eager | load |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, ms, ratios, diffs, load in rows:
        cells = " | ".join(f"{r:.3f}" for r in ratios)
        print(
            f"| {label} | {ms['sdpa']:.2f} | {ms['swap']:.2f} | {ms['eager']:.2f} | {cells} | "
            f"{diffs[0]} | {diffs[1]} | {load:.1f} |"
        )


if __name__ == "__main__":
    main()
