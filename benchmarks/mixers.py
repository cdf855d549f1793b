"""Token-mixer layers (:mod:`attnkit.mixers`) against the transformers modules they equal, with
the same weights, in one process: a training step (forward + backward) at each length, and
decoding tokens/s from the layer's cache.

Layers from small random configs (no download), float32, ``--threads`` threads (1 by default):

- ``mamba2``: transformers' ``Mamba2Mixer`` (hidden 256, 8 heads of 64, state 64, 1 group,
  kernel 4, its chunk 256) vs :class:`attnkit.mixers.Mamba2Mixer` (chunk 64);
- ``gated_deltanet``: transformers' ``Qwen3NextGatedDeltaNet`` (hidden 256, 2 key heads and 4
  value heads of 64, kernel 4, its chunk 64) vs :class:`attnkit.mixers.GatedDeltaNetMixer`
  (chunk 64);
- ``kda``: transformers' ``KimiLinearDeltaAttention`` (hidden 256, 4 heads of 64, kernel 4, its
  chunk 64) vs :class:`attnkit.mixers.KimiDeltaAttentionMixer` (chunk 64);
- ``lightning``: transformers' ``MiniMaxLightningAttention`` (hidden 256, 4 heads of 64, its
  block 256, layer 1 of 4) vs :class:`attnkit.mixers.LightningAttentionMixer` (chunk 64);
- ``gated_attention``: transformers' ``Qwen3NextAttention`` (hidden 256, 4 query and 2 key/value
  heads of 64, a quarter of each head rotated, SDPA) vs
  :meth:`attnkit.modern.GatedAttention.from_transformers`, Qwen3-Next's full-attention layer;
- ``deepseek_v32``: transformers' ``DeepseekV32Attention`` (hidden 256, 4 heads, latent ranks 64,
  its indexer with 4 heads of 32 and top-k 2048, eager) vs
  :meth:`attnkit.sparse_trainable.SparseLatentAttention.from_transformers`;
- ``kimi_mla``: transformers' ``KimiLinearAttention`` (hidden 256, 4 heads, latent ranks 64,
  nope 32 / "rope" 16 / value 32 per head, no positions, SDPA) vs
  ``attnkit.modern.MultiHeadLatentAttention(rotary=False)`` with its weights (Kimi Linear's
  full-attention layer).

All run transformers' torch path (no compiled kernels are installed). The two run interleaved
(transformers, attnkit; then attnkit, transformers; …) so that load changes hit both and neither
always runs first; each repeat gives a ratio attnkit / transformers, and the table shows the
medians of these paired ratios (≤ 1: attnkit is no slower), by wall time and by the thread's CPU
time (steadier on a loaded machine). Outputs are compared before timing (max abs difference), so
that speed is not bought by a wrong answer. Decoding: a 64-token prefill into the cache, then
``--steps`` single-token steps, timed together (tokens/s).

    python benchmarks/mixers.py [--repeats 7] [--sizes 1024 4096] [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache, Mamba2Config, Qwen3NextConfig
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v32 import modeling_deepseek_v32
from transformers.models.kimi_linear import configuration_kimi_linear, modeling_kimi_linear
from transformers.models.mamba2 import modeling_mamba2
from transformers.models.minimax import modeling_minimax
from transformers.models.qwen3_next import modeling_qwen3_next

import attnkit as ak
from attnkit.benchmarking.timing import machine
from attnkit.kv_cache import LayerCache
from attnkit.mixers import (
    GatedDeltaNetMixer,
    KimiDeltaAttentionMixer,
    LightningAttentionMixer,
    Mamba2Mixer,
)
from attnkit.modern import GatedAttention, LatentCache, MultiHeadLatentAttention
from attnkit.sparse_trainable.deepseek_v32 import SparseLatentAttention, SparseLatentCache

HIDDEN = 256


def mamba2() -> tuple[object, torch.nn.Module, torch.nn.Module]:
    cfg = Mamba2Config(
        hidden_size=HIDDEN, num_heads=8, head_dim=64, state_size=64, n_groups=1, expand=2,
        conv_kernel=4, chunk_size=256, num_hidden_layers=1,
    )  # fmt: skip
    theirs = modeling_mamba2.Mamba2Mixer(cfg, 0)
    return cfg, theirs, Mamba2Mixer.from_transformers(theirs, chunk_size=64)


def gated_deltanet() -> tuple[object, torch.nn.Module, torch.nn.Module]:
    cfg = Qwen3NextConfig(
        hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        num_hidden_layers=1, layer_types=["linear_attention"],
    )  # fmt: skip
    theirs = modeling_qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0)
    return cfg, theirs, GatedDeltaNetMixer.from_transformers(theirs, chunk_size=64)


def kda() -> tuple[object, torch.nn.Module, torch.nn.Module]:
    cfg = configuration_kimi_linear.KimiLinearConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
        layer_types=["linear_attention"],
        linear_attn_config={"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4},
    )  # fmt: skip
    theirs = modeling_kimi_linear.KimiLinearDeltaAttention(cfg, 0)
    with torch.no_grad():  # the forget gate is torch.empty until a model initialises it
        theirs.forget_gate.A_log.uniform_(1, 16).log_()
        dt = torch.empty_like(theirs.forget_gate.dt_bias).uniform_(-6.9, -2.3).exp()
        theirs.forget_gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return cfg, theirs, KimiDeltaAttentionMixer.from_transformers(theirs, chunk_size=64)


class _MiniMaxLayer(torch.nn.Module):
    """transformers' MiniMaxLightningAttention called as the other layers are: x (and a cache)
    to the output; its cache is a MiniMaxCache (``new_cache``)."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def new_cache(self) -> object:
        return modeling_minimax.MiniMaxCache()

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        return self.module(x, None, None, cache=cache)[0]


def lightning() -> tuple[object, torch.nn.Module, torch.nn.Module]:
    cfg = modeling_minimax.MiniMaxConfig(
        hidden_size=HIDDEN, num_attention_heads=4, head_dim=64, num_hidden_layers=4,
        block_size=256, layer_types=["linear_attention"] * 4,
    )  # fmt: skip
    theirs = modeling_minimax.MiniMaxLightningAttention(cfg, 1)
    ours = LightningAttentionMixer.from_transformers(theirs, chunk_size=64)
    return cfg, _MiniMaxLayer(theirs), ours


class _Qwen3NextFull(torch.nn.Module):
    """transformers' Qwen3NextAttention (SDPA, causal by SDPA's own mode) called as the other
    layers are: x (and a DynamicCache) to the output, its rotary embedding at the positions
    after the cached ones."""

    def __init__(self, module: torch.nn.Module, cfg: object) -> None:
        super().__init__()
        self.module = module
        self.rotary = modeling_qwen3_next.Qwen3NextRotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        start = 0 if cache is None else cache.get_seq_length()
        positions = torch.arange(start, start + x.shape[1])[None]
        cos_sin = self.rotary(x, positions)
        return self.module(x, cos_sin, None, cache=cache)[0]


class _GatedFull(torch.nn.Module):
    """attnkit's GatedAttention called the same way: a causal mask over a prefill, none for a
    single decoding step (it may attend every cached key)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def new_cache(self) -> LayerCache:
        return LayerCache()

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        n = x.shape[1]
        start = 0 if cache is None else len(cache)
        mask = ak.masks.causal(n, start + n) if n > 1 else None
        return self.layer(x, mask=mask, cache=cache).context


def gated_attention() -> tuple[object, torch.nn.Module, torch.nn.Module]:
    cfg = Qwen3NextConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25},
        num_hidden_layers=1, layer_types=["full_attention"], max_position_embeddings=8192,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    theirs = modeling_qwen3_next.Qwen3NextAttention(cfg, 0)
    ours = _GatedFull(GatedAttention.from_transformers(theirs))
    return cfg, _Qwen3NextFull(theirs, cfg), ours


class _DeepseekV32Full(torch.nn.Module):
    """transformers' DeepseekV32Attention (eager, its causal mask from ``create_causal_mask``)
    called as the other layers are, its rotary embedding after the cached positions."""

    def __init__(self, module: torch.nn.Module, cfg: object) -> None:
        super().__init__()
        self.module, self.cfg = module, cfg
        self.rotary = modeling_deepseek_v32.DeepseekV32RotaryEmbedding(cfg)

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        start = 0 if cache is None else cache.get_seq_length()
        positions = torch.arange(start, start + x.shape[1])[None]
        mask = create_causal_mask(
            config=self.cfg, inputs_embeds=x, attention_mask=None, cache=cache,
            position_ids=positions,
        )  # fmt: skip
        cos_sin = self.rotary(x, positions)
        return self.module(x, cos_sin, mask, cache=cache, position_ids=positions)[0]


class _SparseLatentFull(torch.nn.Module):
    """attnkit's SparseLatentAttention called the same way (a causal mask over a prefill)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def new_cache(self) -> SparseLatentCache:
        return SparseLatentCache()

    def forward(self, x: torch.Tensor, cache: SparseLatentCache | None = None) -> torch.Tensor:
        mask = ak.masks.causal(x.shape[1]) if x.shape[1] > 1 else None
        return self.layer(x, mask, cache=cache).output


def deepseek_v32() -> tuple[object, torch.nn.Module, torch.nn.Module]:
    cfg = modeling_deepseek_v32.DeepseekV32Config(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        index_n_heads=4, index_head_dim=32, index_topk=2048, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=8192, num_hidden_layers=1, vocab_size=10,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    theirs = modeling_deepseek_v32.DeepseekV32Attention(cfg, 0)
    ours = _SparseLatentFull(SparseLatentAttention.from_transformers(theirs))
    return cfg, _DeepseekV32Full(theirs, cfg), ours


class _KimiFull(torch.nn.Module):
    """transformers' KimiLinearAttention (SDPA; no positions, so no rotary embedding) called as
    the other layers are, its causal mask from ``create_causal_mask`` (None for SDPA's own
    causal mode when nothing is padded)."""

    def __init__(self, module: torch.nn.Module, cfg: object) -> None:
        super().__init__()
        self.module, self.cfg = module, cfg

    def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
        start = 0 if cache is None else cache.get_seq_length()
        positions = torch.arange(start, start + x.shape[1])[None]
        mask = create_causal_mask(
            config=self.cfg, inputs_embeds=x, attention_mask=None, cache=cache,
            position_ids=positions,
        )  # fmt: skip
        return self.module(x, mask, cache=cache)[0]


class _LatentFull(torch.nn.Module):
    """attnkit's MultiHeadLatentAttention called the same way: a causal mask over a prefill,
    none for a single decoding step."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def new_cache(self) -> LatentCache:
        return LatentCache()

    def forward(self, x: torch.Tensor, cache: LatentCache | None = None) -> torch.Tensor:
        n = x.shape[1]
        start = 0 if cache is None else len(cache)
        mask = ak.masks.causal(n, start + n) if n > 1 else None
        return self.layer(x, mask, cache=cache).output


# transformers' KimiLinearAttention parameter names -> MultiHeadLatentAttention's
_KIMI_NAMES = {
    "kv_a_proj_with_mqa": "w_dkv", "kv_a_layernorm": "kv_norm", "kv_b_proj": "w_ukv",
    "o_proj": "w_o", "q_proj": "w_q", "q_a_proj": "w_dq", "q_a_layernorm": "q_norm",
    "q_b_proj": "w_uq",
}  # fmt: skip


def kimi_mla() -> tuple[object, torch.nn.Module, torch.nn.Module]:
    cfg = configuration_kimi_linear.KimiLinearConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
        kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        attention_bias=False, max_position_embeddings=8192, num_hidden_layers=1,
        layer_types=["full_attention"], vocab_size=10, pad_token_id=None, bos_token_id=None,
        eos_token_id=None,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    theirs = modeling_kimi_linear.KimiLinearAttention(cfg, 0)
    ours = MultiHeadLatentAttention(
        HIDDEN, 4, 64, head_dim=32, rope_dim=16, v_head_dim=32, q_rank=64, rotary=False,
        eps=1e-6,
    )  # fmt: skip
    state = theirs.state_dict()
    ours.load_state_dict({_KIMI_NAMES[k.split(".")[0]] + k[k.index(".") :]: v
                          for k, v in state.items()})  # fmt: skip
    return cfg, _KimiFull(theirs, cfg), _LatentFull(ours)


LAYERS: dict[str, Callable[[], tuple[object, torch.nn.Module, torch.nn.Module]]] = {
    "mamba2": mamba2,
    "gated_deltanet": gated_deltanet,
    "kda": kda,
    "lightning": lightning,
    "gated_attention": gated_attention,
    "deepseek_v32": deepseek_v32,
    "kimi_mla": kimi_mla,
}


def _time(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def paired(fns: dict[str, Callable[[], object]], repeats: int) -> dict:
    """Run ``fns`` (``"theirs"``, ``"ours"``) interleaved, each first in turn; the medians of
    both and of the paired ratios ours / theirs (wall, CPU), and the mean load."""
    for fn in fns.values():
        fn()  # warm-up
    load = os.getloadavg()[0]
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    order = list(fns)
    for r in range(repeats):
        for k in order[r % 2 :] + order[: r % 2]:
            times[k].append(_time(fns[k]))
    load = (load + os.getloadavg()[0]) / 2
    ratios = [
        statistics.median(o[c] / t[c] for o, t in zip(times["ours"], times["theirs"], strict=True))
        for c in (0, 1)
    ]
    medians = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
    return {"medians": medians, "ratios": ratios, "load": load}


def training_row(name: str, n: int, repeats: int) -> str:
    torch.manual_seed(0)
    _, theirs, ours = LAYERS[name]()
    theirs.train()
    ours.train()
    x = torch.randn(1, n, HIDDEN)
    with torch.no_grad():
        diff = (ours(x) - theirs(x)).abs().max().item()
    xs = {k: x.clone().requires_grad_() for k in ("theirs", "ours")}
    probe = torch.randn(1, n, HIDDEN)
    layers = {"theirs": theirs, "ours": ours}

    def step(k: str) -> Callable[[], None]:
        return lambda: (layers[k](xs[k]) * probe).sum().backward()

    res = paired({k: step(k) for k in layers}, repeats)
    ms = res["medians"]
    return (
        f"| {name} | fwd+bwd N={n} | {ms['theirs'] * 1e3:.0f} ms | {ms['ours'] * 1e3:.0f} ms | "
        f"{res['ratios'][0]:.2f} | {res['ratios'][1]:.2f} | {diff:.1e} | {res['load']:.1f} |"
    )


def decoding_row(name: str, steps: int, repeats: int) -> str:
    torch.manual_seed(0)
    cfg, theirs, ours = LAYERS[name]()
    theirs.eval()
    ours.eval()
    prompt, tokens = torch.randn(1, 64, HIDDEN), torch.randn(1, steps, HIDDEN)

    def decode_theirs() -> torch.Tensor:
        cache = theirs.new_cache() if hasattr(theirs, "new_cache") else DynamicCache(config=cfg)
        theirs(prompt, cache=cache)
        return torch.cat([theirs(tokens[:, t : t + 1], cache=cache) for t in range(steps)], 1)

    def decode_ours() -> torch.Tensor:
        cache = ours.new_cache()
        ours(prompt, cache=cache)
        return torch.cat([ours(tokens[:, t : t + 1], cache=cache) for t in range(steps)], 1)

    with torch.no_grad():
        diff = (decode_ours() - decode_theirs()).abs().max().item()
        res = paired({"theirs": decode_theirs, "ours": decode_ours}, repeats)
    rate = {k: steps / s for k, s in res["medians"].items()}
    return (
        f"| {name} | decode {steps} tokens | {rate['theirs']:.0f} tok/s | "
        f"{rate['ours']:.0f} tok/s | {res['ratios'][0]:.2f} | {res['ratios'][1]:.2f} | "
        f"{diff:.1e} | {res['load']:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="N = 256, 3 repeats, 16 steps")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--names", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=128, help="decoding steps")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes, repeats, steps = args.sizes, args.repeats, args.steps
    if args.quick:
        sizes, repeats, steps = [256], 3, 16
    print(f"Machine: {machine()}; load (1 min) at start {os.getloadavg()[0]:.1f}")
    print(f"float32, batch 1, hidden {HIDDEN}; medians of {repeats} paired repeats\n")
    print(
        "| layer | case | transformers | attnkit | ratio (wall) | ratio (CPU) | max diff | load |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in args.names:
        for n in sizes:
            print(f"... {name} N={n}", file=sys.stderr)
            print(training_row(name, n, repeats), flush=True)
        print(f"... {name} decoding", file=sys.stderr)
        print(decoding_row(name, steps, repeats), flush=True)


if __name__ == "__main__":
    main()
