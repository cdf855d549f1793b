"""Which ``transformers`` architectures :func:`swap_attention` reproduces exactly, measured.

For every model type that ``transformers`` ships whose modelling code goes through its
attention-function interface, :func:`check` builds the model from its default configuration
shrunk to a few small layers (random weights, float64), then compares the swapped model with the
model's own eager implementation: the outputs without padding, with padding (at the positions
that are not padding), and for decoders the greedy generation of a few tokens through the
key/value cache (tokens and step logits). :func:`sweep` does it for all of them and
:func:`to_markdown` writes the table of ``docs/integrations.md``
(``python benchmarks/transformers_coverage.py`` re-runs it).

Each row ends in one of four states:

* ``exact``: equal to eager to 1e-9 on every comparison;
* ``refused``: :func:`swap_attention` raises for it, naming why;
* ``not built``: the sweep cannot build it small or feed it (the reason is given);
* ``differs``: swapped and eager disagree; no model type may end here (the tests check).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Row", "check", "check_isolated", "model_types", "small_config", "sweep", "to_markdown"]

TOLERANCE = 1e-6

_WIDTH = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "n_embed")
_HEADS = (
    "num_attention_heads",
    "n_head",
    "num_heads",
    "n_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_decoder_attention_heads",
)
_LAYERS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
)
_FFN = (
    "intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "d_ff",
    "n_inner",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "expert_intermediate_size",
    "ffn_hidden_size",
    "decoder_ffn_embed_dim",
    "encoder_ffn_embed_dim",
)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_HEAD_DIM = ("head_dim", "d_kv", "attention_head_dim", "kv_channels")


@dataclasses.dataclass(frozen=True)
class Row:
    """One model type's result: ``status`` is exact / refused / not built / differs."""

    model_type: str
    model_class: str
    kind: str
    status: str
    detail: str = ""


def _modeling_source(model_type: str) -> str:
    """The text of ``transformers/models/<type>/modeling_<type>.py`` (empty when absent)."""
    import transformers.models
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)
    path = os.path.join(
        os.path.dirname(transformers.models.__file__), module, f"modeling_{module}.py"
    )
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


def model_types() -> list[str]:
    """Model types with a model class whose modelling code uses the attention interface."""
    from transformers.models.auto import modeling_auto

    names = sorted(modeling_auto.MODEL_MAPPING_NAMES)
    return [t for t in names if "ALL_ATTENTION_FUNCTIONS" in _modeling_source(t)]


_SMALLER = {  # further sizes: multi-head latent attention, partial rotary, vision
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "rotary_dim": 4,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "max_source_positions": 128,
    "sliding_window": 4,  # shorter than the inputs, so that the window shows
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
}


def _layer_sample(values: list[Any], keep: int) -> list[int]:
    """Indices of ``keep`` layers (at least 2) that include every distinct per-layer value."""
    first: dict[str, int] = {}
    for i, v in enumerate(values):
        first.setdefault(repr(v), i)
    idx = sorted(first.values())
    rest = [i for i in range(len(values)) if i not in idx]
    return sorted(idx + rest[: max(0, keep - len(idx))])


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    """A configuration dict made small: 2 layers (or one of each per-layer kind, up to 4),
    width 32, 4 heads of 8, up to 4 experts; sub-configurations likewise."""
    out = dict(d)
    heads = next((d[k] for k in _HEADS if isinstance(d.get(k), int)), None)
    layers = next((d[k] for k in _LAYERS if isinstance(d.get(k), int) and d[k] > 0), None)
    per_layer = [
        k
        for k, v in d.items()
        if isinstance(v, list) and layers and len(v) == layers > 2 and k != "architectures"
    ]
    # One layer of each per-layer kind (first occurrences, in order), at least 2, at most 4.
    idx = set(range(min(2, layers or 2)))
    if per_layer:
        idx = {i for k in per_layer for i in _layer_sample(d[k], 0)}
        idx |= set(_layer_sample(list(range(layers or 0)), 2)[: max(0, 2 - len(idx))])
    idx = sorted(idx)[:4]
    new_layers = len(idx)
    for k in _WIDTH:
        if isinstance(d.get(k), int) and d[k] > 32:
            out[k] = 32
    for k in _HEADS:
        if isinstance(d.get(k), int) and d[k] > 0:
            out[k] = 4
    kv = d.get("num_key_value_heads")
    if isinstance(kv, int) and heads:
        out["num_key_value_heads"] = 4 if kv >= heads else 2 if kv > 1 else 1
    for k in _HEAD_DIM:
        if isinstance(d.get(k), int) and d[k] > 8:
            out[k] = 8
    for k in _LAYERS:
        if isinstance(d.get(k), int) and d[k] > new_layers:
            out[k] = new_layers
    for k in _FFN:
        if isinstance(d.get(k), int) and d[k] > 64:
            out[k] = 64
    for k in _EXPERTS:
        if isinstance(d.get(k), int) and d[k] > 4:
            out[k] = 4
    for k, small in _SMALLER.items():
        if isinstance(d.get(k), int) and not isinstance(d[k], bool) and d[k] > small:
            out[k] = small
    for k in ("n_group", "topk_group"):  # expert groups: one group of the 4 experts
        if isinstance(d.get(k), int) and d[k] > 1:
            out[k] = 1
    if "qk_head_dim" in d and "qk_nope_head_dim" in out and "qk_rope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
        if d.get("head_dim") == d.get("qk_rope_head_dim"):
            out["head_dim"] = out["qk_rope_head_dim"]
    size, patch = d.get("image_size"), d.get("patch_size")
    if isinstance(size, int) and size > 64:
        out["image_size"] = 4 * patch if isinstance(patch, int) and patch <= 16 else 64
    for k in ("out_features", "out_indices"):  # backbones name their stages by depth
        if k in d:
            out[k] = None
    for k, v in d.items():
        if k.endswith("_token_id") and isinstance(v, int) and v >= out.get("vocab_size", 1 << 30):
            out[k] = 3
        elif k in per_layer:
            out[k] = [v[i] for i in idx]
        elif isinstance(v, dict) and "model_type" in v:
            out[k] = _shrink(v)
        elif isinstance(v, dict) and v and layers and all(str(i).isdigit() for i in v):
            out[k] = {i: v[i] for i in v if int(i) < new_layers}  # per-layer settings
    if isinstance(d.get("rope_scaling"), dict):
        out["rope_scaling"] = None
    return out


def _small(config: Any) -> Any:
    small = type(config).from_dict(_shrink(config.to_dict()))
    small._attn_implementation = "eager"
    for sub in _subconfigs(small):
        sub._attn_implementation = "eager"
    for c in (small, *_subconfigs(small)):
        with contextlib.suppress(AttributeError, TypeError):
            c._experts_implementation = "eager"  # the loop over experts: any dtype
    return small


def _subconfigs(config: Any) -> list[Any]:
    from transformers import PretrainedConfig

    return [v for v in vars(config).values() if isinstance(v, PretrainedConfig)]


def small_config(model_type: str) -> Any:
    """The default configuration of ``model_type``, shrunk (eager attention)."""
    from transformers import AutoConfig

    return _small(AutoConfig.for_model(model_type))


def _candidates(model_type: str) -> list[tuple[type, str, Any]]:
    """The classes to try, in order, with their kind and small configuration: the causal LM
    (decoders), the sequence-to-sequence LM, the base model, then the text and vision towers of a
    multimodal model (its text_config / vision_config)."""
    import transformers
    from transformers.models.auto import modeling_auto as m

    def named(mapping: dict[str, Any]) -> type | None:
        name = mapping.get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        return getattr(transformers, name, None) if name else None

    config = small_config(model_type)
    out = []
    causal = named(m.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if causal is not None and model_type not in m.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        out.append((causal, "decoder", config))
    seq2seq = named(m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
    if seq2seq is not None:
        out.append((seq2seq, "encoder-decoder", config))
    base = named(m.MODEL_MAPPING_NAMES)
    if base is not None:
        kind = "encoder-decoder" if getattr(config, "is_encoder_decoder", False) else "encoder"
        out.append((base, kind, config))
        prefix = base.__name__.removesuffix("Model")
        for part, tower in (("text_config", "TextModel"), ("vision_config", "VisionModel")):
            cls = getattr(transformers, prefix + tower, None)
            sub = getattr(config, part, None)
            if cls is not None and sub is not None:
                out.append((cls, f"{tower[:-5].lower()} tower", sub))
    if not out:
        raise LookupError(f"no model class in transformers for {model_type}")
    return out


def _inputs(model: nn.Module, kind: str, config: Any, pad: bool) -> dict[str, Tensor]:
    """Two examples; with ``pad`` the second is right-padded (its last 2 tokens masked)."""
    g = torch.Generator().manual_seed(3)
    name = getattr(model, "main_input_name", "input_ids")
    if name == "input_ids":
        vocab = getattr(config.get_text_config(), "vocab_size", None) or 64
        ids = torch.randint(4, min(vocab, 64), (2, 7), generator=g)
        out: dict[str, Tensor] = {"input_ids": ids}
        if pad:
            mask = torch.ones(2, 7, dtype=torch.long)
            mask[1, 5:] = 0
            out["attention_mask"] = mask
        if kind == "encoder-decoder":
            out["decoder_input_ids"] = ids[:, :4].clone()
        return out
    if pad:  # padding is exercised on token inputs only
        return {}
    if name == "pixel_values":
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(config, "num_channels", 3)
        out = {"pixel_values": torch.randn(2, channels, size, size, generator=g).double()}
    elif name == "input_values":  # raw audio
        out = {"input_values": torch.randn(2, 1600, generator=g).double()}
    elif name == "input_features":  # log-mel frames (B, mel bins, frames)
        bins = getattr(config, "num_mel_bins", None) or getattr(config, "feature_size", 80)
        frames = 2 * getattr(config, "max_source_positions", 32)
        out = {"input_features": torch.randn(2, bins, frames, generator=g).double()}
    else:
        raise NotImplementedError(f"inputs {name!r} are not generated by the sweep")
    if kind == "encoder-decoder":
        out["decoder_input_ids"] = torch.randint(4, 64, (2, 4), generator=g)
    return out


def _main_output(out: Any) -> Tensor:
    for key in ("logits", "last_hidden_state", "prediction_logits", "start_logits"):
        value = getattr(out, key, None)
        if isinstance(value, Tensor):
            return value
    return next(v for v in out.values() if isinstance(v, Tensor))


def _gap(a: Tensor, b: Tensor, keep: Tensor | None = None) -> float:
    """The largest difference relative to the reference's scale (at ``keep`` positions)."""
    if keep is not None and a.dim() >= 2 and a.shape[:2] == keep.shape:
        a, b = a[keep.bool()], b[keep.bool()]
    if not a.numel():
        return 0.0
    return ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import transformers

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            transformers.logging.set_verbosity(level)


def _build(cls: type, config: Any) -> nn.Module:
    torch.manual_seed(0)
    with _quiet():
        model = cls(config)
    model = model.double().eval()
    model.set_attn_implementation("eager")
    return model


def _seeded(model: nn.Module, inputs: dict[str, Tensor]) -> Any:
    """The model's outputs, the random generator reset first (ViT-MAE draws its patch mask)."""
    torch.manual_seed(1)
    return model(**inputs)


def _generate(model: nn.Module, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    out = model.generate(
        input_ids=ids,
        max_new_tokens=3,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences, list(out.logits)


def check(model_type: str) -> Row:
    """Build the small model of ``model_type`` and compare its swapped and eager outputs: with
    and without padding, and greedy cached generation of 3 tokens for decoders."""
    from attnkit.integrations.transformers import swap_attention

    err: BaseException | None = None
    try:
        candidates = _candidates(model_type)
    except Exception as e:
        return Row(model_type, "?", "?", "not built", f"{type(e).__name__}: {_short(e)}")
    for cls, kind, config in candidates:
        try:
            model = _build(cls, config)
            runs = {pad: _inputs(model, kind, config, pad) for pad in (False, True)}
            runs = {pad: x for pad, x in runs.items() if x}
            with _quiet(), torch.no_grad():
                ref = {pad: _main_output(_seeded(model, x)) for pad, x in runs.items()}
                ref_gen = _generate(model, runs[False]["input_ids"]) if kind == "decoder" else None
            break
        except Exception as e:
            err = e
    else:
        name = candidates[0][0].__name__
        return Row(model_type, name, "?", "not built", f"{type(err).__name__}: {_short(err)}")
    cls_name = type(model).__name__
    try:
        with _quiet():
            swap_attention(model)
    except ValueError as e:
        return Row(model_type, cls_name, kind, "refused", _short(e, 200))
    gaps = []
    try:
        with _quiet(), torch.no_grad():
            for pad, x in runs.items():
                keep = x.get("attention_mask") if kind != "encoder-decoder" else None
                gaps.append(_gap(_main_output(_seeded(model, x)), ref[pad], keep))
            if ref_gen is not None:
                seq, logits = _generate(model, runs[False]["input_ids"])
                if not torch.equal(seq, ref_gen[0]):
                    return Row(model_type, cls_name, kind, "differs", "generated tokens differ")
                gaps += [_gap(a, b) for a, b in zip(logits, ref_gen[1], strict=True)]
    except Exception as e:
        return Row(model_type, cls_name, kind, "differs", f"{type(e).__name__}: {_short(e)}")
    worst = max(gaps)
    status = "exact" if worst <= TOLERANCE else "differs"
    return Row(model_type, cls_name, kind, status, f"max relative gap {worst:.0e}")


def _short(err: BaseException, n: int = 120) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _child(model_type: str, conn: Any, memory: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    # A forked child must not start the thread pool its parent has used (OpenMP's is not
    # fork-safe: the first parallel operation can hang); one thread needs none.
    torch.set_num_threads(1)
    try:
        row = check(model_type)
    except BaseException as e:
        row = Row(model_type, "?", "?", "not built", f"{type(e).__name__}: {_short(e)}")
    conn.send(row)
    conn.close()


def check_isolated(model_type: str, timeout: float = 120.0, memory_gib: float = 6.0) -> Row:
    """:func:`check` in a forked process: a model that needs more than ``timeout`` seconds or
    ``memory_gib`` GiB of address space becomes a ``not built`` row instead of stalling the
    sweep."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(model_type, send, int(memory_gib * 2**30)))
    proc.start()
    send.close()
    try:
        if receive.poll(timeout):
            return receive.recv()
        reason = f"not done in {timeout:.0f} s"
    except EOFError:
        reason = f"its process ended with code {proc.exitcode}"
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    return Row(model_type, "?", "?", "not built", reason)


def sweep(types: list[str] | None = None, timeout: float = 120.0) -> list[Row]:
    """:func:`check_isolated` over ``types`` (default: :func:`model_types`)."""
    return [check_isolated(t, timeout) for t in (model_types() if types is None else types)]


def to_markdown(rows: list[Row]) -> str:
    """The rows as a markdown table, then a count per status."""
    lines = ["| model type | class | kind | status | detail |", "|---|---|---|---|---|"]
    for r in rows:
        # brackets would read as markdown link references (the docs build checks those)
        detail = r.detail.replace("|", "\\|").replace("[", "\\[").replace("]", "\\]")
        lines.append(f"| {r.model_type} | {r.model_class} | {r.kind} | {r.status} | {detail} |")
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    total = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    return "\n".join(lines) + f"\n\n{len(rows)} model types: {total}.\n"
