"""Which transformers architectures swap_attention reproduces exactly: the table of
docs/integrations.md; with --hybrid, which layers of the hybrid architectures swap_attention and
swap_mixers reproduce (the table "Linear layers of hybrid models" there).

    python benchmarks/transformers_coverage.py              # every model type (about 10 min)
    python benchmarks/transformers_coverage.py llama t5     # some
    python benchmarks/transformers_coverage.py --rows a.jsonl --rows b.jsonl  # table of saved rows
    python benchmarks/transformers_coverage.py --hybrid     # the hybrid models (about 2 min)
    python benchmarks/transformers_coverage.py --hybrid qwen3_next bamba

Each model type is built small (random weights, float64) from its default configuration and
compared with its own eager attention (see attnkit.integrations.transformers_sweep); the script
prints a markdown table, one row per model type, and the count per status.

With --hybrid, each hybrid architecture is built from the small configuration below (random
weights, float64, every weight perturbed) and compared with itself swapped three ways: its
attention layers (swap_attention), its linear layers (swap_mixers), and both: logits without
padding and left-padded, and 3 greedy tokens through the cache (tokens equal, step logits). A
column reads "exact (gap)" with the largest gap relative to the logits' scale (transformers'
recurrent paths run with their float32 casts widened to float64, so both sides compute in float64),
"refused: reason", "none" (no such layers) or "differs".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import types
from collections.abc import Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from attnkit.integrations import transformers_sweep

_ATTN = {
    "vocab_size": 48,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
_MAMBA = {"mamba_d_state": 6, "mamba_n_groups": 2, "mamba_expand": 2, "mamba_chunk_size": 5}
#: Small configurations of the hybrid architectures (and of Mamba-2, all linear layers).
HYBRIDS: dict[str, dict] = {
    "bamba": _ATTN
    | _MAMBA
    | {"num_hidden_layers": 2, "attn_layer_indices": [1]}
    | {"mamba_n_heads": 4, "mamba_d_head": 8},
    "falcon_h1": _ATTN
    | _MAMBA
    | {"num_hidden_layers": 2, "mamba_n_heads": 4}
    | {"mamba_d_head": 8, "mamba_d_ssm": None},
    "granitemoehybrid": _ATTN
    | _MAMBA
    | {"num_hidden_layers": 2}
    | {"layer_types": ["mamba", "attention"], "mamba_n_heads": 4, "mamba_d_head": 8}
    | {"num_local_experts": 2, "num_experts_per_tok": 1},
    "jamba": _ATTN
    | {"num_hidden_layers": 2, "attn_layer_period": 2, "attn_layer_offset": 1}
    | {"expert_layer_period": 2, "num_experts": 2, "mamba_d_state": 6},
    "kimi_linear": _ATTN
    | {"num_hidden_layers": 2, "num_key_value_heads": 2}
    | {"layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense"] * 2}
    | {"linear_head_dim": 8, "linear_num_heads": 2, "kv_lora_rank": 8, "v_head_dim": 8}
    | {"qk_rope_head_dim": 4, "qk_nope_head_dim": 4},
    "mamba2": {"vocab_size": 48, "hidden_size": 16, "num_heads": 4, "head_dim": 8}
    | {"state_size": 6, "n_groups": 2, "expand": 2, "chunk_size": 5, "num_hidden_layers": 2}
    | {"pad_token_id": 0},
    # full attention first: MiniMaxCache counts the cached positions on layer 0, and counts none
    # when layer 0 is a lightning layer (the model's own cached decoding then restarts positions)
    "minimax": _ATTN
    | {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}
    | {"num_local_experts": 2, "num_experts_per_tok": 1, "block_size": 4},
    "nemotron_h": _ATTN
    | {"num_hidden_layers": 3, "layers_block_type": ["mamba", "attention", "mlp"]}
    | {"mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 6, "n_groups": 2}
    | {"chunk_size": 5},
    "qwen3_next": _ATTN
    | {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    | {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8}
    | {"linear_value_head_dim": 6, "num_experts": 2, "num_experts_per_tok": 1}
    | {"moe_intermediate_size": 8, "shared_expert_intermediate_size": 8},
    "qwen3_5_text": _ATTN
    | {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    | {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8}
    | {"linear_value_head_dim": 6},
    "qwen3_5_moe_text": _ATTN
    | {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
    | {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8}
    | {"linear_value_head_dim": 6, "num_experts": 2, "num_experts_per_tok": 1}
    | {"moe_intermediate_size": 8, "shared_expert_intermediate_size": 8},
    "zamba2": _ATTN
    | {"num_hidden_layers": 2, "layers_block_type": ["mamba", "hybrid"]}
    | {"n_mamba_heads": 4, "mamba_headdim": 8, "mamba_d_state": 6, "mamba_ngroups": 2}
    | {"mamba_expand": 2, "chunk_size": 5, "num_mem_blocks": 1},
}


class _Float64Torch(types.ModuleType):
    """torch, except that float32 is float64."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> object:
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@contextlib.contextmanager
def _float64(model: torch.nn.Module) -> Iterator[None]:
    """transformers' recurrent paths (scans, gated norms) cast to float32 whatever the input;
    within the block the model's modelling module reads float64 for float32 and
    ``Tensor.float()`` keeps float64, so that the comparison is in float64 throughout."""
    module = sys.modules[type(model).__module__]
    saved, original = module.torch, torch.Tensor.float
    module.torch = _Float64Torch()
    torch.Tensor.float = lambda self, *a, **k: self.to(
        torch.promote_types(self.dtype, torch.float32)
    )
    try:
        yield
    finally:
        module.torch, torch.Tensor.float = saved, original


@dataclasses.dataclass(frozen=True)
class HybridRow:
    """One hybrid architecture: its class and the status of each swap."""

    model_type: str
    model_class: str
    attention: str
    linear: str
    both: str


def _hybrid_model(model_type: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **HYBRIDS[model_type])
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # buffers computed at construction in float64 too
    torch.manual_seed(0)
    try:
        with transformers_sweep._quiet():
            model = AutoModelForCausalLM.from_config(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _outputs(model: torch.nn.Module) -> list[torch.Tensor]:
    """Logits without padding and left-padded (real positions), then generation's step
    logits; raises when the generated tokens are not those of ``_outputs.reference``."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 48, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with transformers_sweep._quiet(), torch.no_grad(), _float64(model):
        plain = model(ids).logits
        padded = model(ids, attention_mask=mask).logits[mask.bool()]
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return [plain, padded, out.sequences.double(), *out.logits]


def _compare(reference: list[torch.Tensor], model: torch.nn.Module) -> str:
    try:
        got = _outputs(model)
    except Exception as e:  # a swapped model that fails to run differs
        return f"differs: {type(e).__name__}: {transformers_sweep._short(e)}"
    if not torch.equal(got[2], reference[2]):
        return "differs: generated tokens differ"
    worst = max(transformers_sweep._gap(a, b) for a, b in zip(got, reference, strict=True))
    return (
        f"exact ({worst:.0e})"
        if worst <= transformers_sweep.TOLERANCE
        else f"differs ({worst:.0e})"
    )


def check_hybrid(model_type: str) -> HybridRow:
    """Build the small ``model_type`` and compare it with its attention layers, its linear layers
    and both swapped."""
    import copy

    from attnkit.integrations.transformers import swap_attention
    from attnkit.integrations.transformers_mixers import swap_mixers

    try:
        model = _hybrid_model(model_type)
        reference = _outputs(model)
    except Exception as e:
        reason = f"not built: {type(e).__name__}: {transformers_sweep._short(e)}"
        return HybridRow(model_type, "?", reason, reason, reason)
    statuses: dict[str, str] = {}
    for kind, swaps in {
        "attention": (swap_attention,),
        "linear": (swap_mixers,),
        "both": (swap_attention, swap_mixers),
    }.items():
        if kind == "both" and "none" in statuses.values():  # one kind only: nothing to add
            statuses[kind] = next(v for v in statuses.values() if v != "none")
            continue
        swapped = copy.deepcopy(model)
        try:
            with transformers_sweep._quiet():
                for swap in swaps:
                    swap(swapped)
        except ValueError as e:
            text = str(e)
            none = "holds no linear" in text or "computes its attention in its own code" in text
            if none and kind != "both":
                statuses[kind] = "none"
            elif kind == "both" and statuses["linear"].startswith("refused"):
                statuses[kind] = "refused (linear layers)"
            else:
                statuses[kind] = f"refused: {_reason(text)}"
            continue
        statuses[kind] = _compare(reference, swapped)
    return HybridRow(model_type, type(model).__name__, **statuses)


def _reason(text: str, n: int = 110) -> str:
    text = " ".join(text.split())
    if text.startswith("swap_mixers does not reproduce") and "(" in text:
        text = text[text.index("(") + 1 :].removesuffix(")")  # "Layer: why"
    return text if len(text) <= n else text[: n - 1] + "…"


def hybrid_markdown(rows: list[HybridRow]) -> str:
    """The hybrid rows as a markdown table."""
    lines = [
        "| model type | class | attention layers (swap_attention) | linear layers (swap_mixers) "
        "| both |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [
            c.replace("|", "\\|").replace("[", "\\[").replace("]", "\\]")
            for c in (r.attention, r.linear, r.both)
        ]
        lines.append(f"| {r.model_type} | {r.model_class} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", help="model types (default: all)")
    parser.add_argument(
        "--hybrid",
        action="store_true",
        help="the hybrid architectures' attention and linear layers",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per model type")
    parser.add_argument("--save", help="append each row to this JSON-lines file as it is done")
    parser.add_argument(
        "--rows", action="append", help="print the table of rows saved with --save (no checks)"
    )
    args = parser.parse_args(argv)
    if args.hybrid:
        hybrid = [check_hybrid(t) for t in args.model_types or sorted(HYBRIDS)]
        print(hybrid_markdown(hybrid))
        return (
            1 if any("differs" in c for r in hybrid for c in (r.attention, r.linear, r.both)) else 0
        )
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
