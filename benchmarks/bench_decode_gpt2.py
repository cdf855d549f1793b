"""Greedy decoding with the KV cache: attnkit's DecoderLM against transformers' GPT-2 of the same
size, in one process.

Both models: 4 layers, d_model 256, 4 heads, feed-forward 1024, GELU (tanh), pre-norm with a
final LayerNorm, learned absolute positions, tied embeddings, float32, eval, batch 1. Each
generates ``--new`` tokens greedily after a ``--prompt``-token prompt (the prompt's pass
included): ``DecoderLM.generate(prompt, new)`` and GPT-2's ``generate(..., do_sample=False,
use_cache=True)``. tokens/s = new tokens / wall time, median of ``--repeats`` runs after a
warm-up, the two interleaved so that load changes hit both. Ratio = attnkit / GPT-2 (≥ 1: attnkit
decodes at least as fast).

    python benchmarks/bench_decode_gpt2.py [--threads 1] [--vocab 1024] [--prompt 32]
        [--new 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch import nn

import attnkit
from attnkit.benchmarking.timing import machine
from attnkit.models.decoder_lm import DecoderLM


def _gpt2(vocab: int, max_len: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab,
        n_positions=max_len,
        n_embd=256,
        n_layer=4,
        n_head=4,
        n_inner=1024,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    max_len = args.prompt + args.new
    ours = DecoderLM(
        args.vocab,
        256,
        4,
        4,
        max_len=max_len,
        d_ff=1024,
        activation=nn.GELU(approximate="tanh"),
    ).eval()
    theirs = _gpt2(args.vocab, max_len)
    prompt = torch.randint(0, args.vocab, (1, args.prompt))
    attention_mask = torch.ones_like(prompt)

    def run_ours() -> torch.Tensor:
        return ours.generate(prompt, args.new)

    def run_theirs() -> torch.Tensor:
        return theirs.generate(
            prompt,
            attention_mask=attention_mask,
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )

    with torch.no_grad():
        assert run_ours().shape == run_theirs().shape == (1, max_len)
        times: dict[str, list[float]] = {"attnkit": [], "gpt2": []}
        for _ in range(args.repeats):
            for name, fn in (("attnkit", run_ours), ("gpt2", run_theirs)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    rate = {k: args.new / statistics.median(v) for k, v in times.items()}
    print(f"Machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    print(f"attnkit from {os.path.dirname(attnkit.__file__)}")
    print(
        f"4 layers, d_model 256, 4 heads, vocab {args.vocab}, prompt {args.prompt}, "
        f"{args.new} new tokens, greedy, batch 1, float32, {args.threads} thread(s), "
        f"median of {args.repeats}\n"
    )
    print("| attnkit DecoderLM (tokens/s) | transformers GPT-2 (tokens/s) | ratio |")
    print("|---:|---:|---:|")
    print(f"| {rate['attnkit']:.0f} | {rate['gpt2']:.0f} | {rate['attnkit'] / rate['gpt2']:.2f} |")


if __name__ == "__main__":
    main()
