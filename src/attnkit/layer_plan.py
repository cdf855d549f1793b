"""The per-layer plan of a Transformer stack: which token mixing each layer holds, as today's
hybrid models mix them (Qwen3-Next: 3 Gated DeltaNet layers to 1 attention layer; Jamba: 7 Mamba
layers to 1; Gemma 2/3: sliding-window layers between global ones; MiniMax: lightning to softmax).

A plan is given where a stack takes its number of layers (``layers=`` of
:class:`attnkit.transformer.TransformerEncoder`, :class:`attnkit.transformer.TransformerDecoder`
and :class:`attnkit.models.decoder_lm.DecoderLM`):

- an int N: N ``full`` layers, the stack as it always was;
- a pattern, groups of ``COUNT NAME`` separated by ``:`` (a count of 1 may be left out):
  ``"3 gated_deltanet : 1 full"`` is one period of four layers. With ``num_layers`` the period
  is repeated to fill that many layers (``num_layers=12``: three periods); a ``num_layers`` that
  is not a multiple of the period is refused, naming both;
- a list with one entry per layer: a name as in a pattern, an ``nn.Module`` or a factory
  (repeated, as a pattern, when ``num_layers`` is given).

The names (:func:`names` lists them):

- ``full``: the stack's self-attention as its other arguments build it (score, alignment,
  ``attention``, ``position``, ``pattern``, ``score_mod``, ``gate``);
- ``sliding:W``: that self-attention over a sliding window of W keys (each query attends
  itself and the W − 1 positions before it: Gemma 2/3's and Mistral's local layers; in an
  encoder, the positions less than W away on either side), evaluated block-sparsely over a
  whole sequence so that its cost follows N·W; no ``pattern``;
- a per-head attention part registered in :mod:`attnkit.mechanisms` (``gated_deltanet``,
  ``mamba2``, ``retention``, ``gla``, ...), built by its ``for_heads`` at the layer's sizes and
  placed in the self-attention's ``attention`` slot (without the stack's ``position``,
  ``pattern``, ``score_mod`` or ``gate``, which shape the ``full`` layers); ``part.NAME`` says so
  explicitly;
- a token mixer registered in :data:`attnkit.mixers.REGISTRY`, a whole layer in place of the
  self-attention, built with ``embed_dim`` and those of the layer's sizes its constructor takes
  (``num_heads``, ``head_dim``, ``device``, ``dtype``); ``mixer.NAME`` says so explicitly, and a
  name registered both as a per-head part and as a mixer means the part unless written so.

A list entry may also be a module — a :class:`attnkit.mixers.TokenMixer` (the layer's token
mixing) or an :class:`attnkit.HeadAttention` (a per-head part for the self-attention) — used by
that one layer, or a factory called as ``factory(embed_dim=E, num_heads=H, head_dim=d)`` for
each layer it fills that returns one.

A decoder stack's cache (:func:`stack_cache`) holds one slot per layer of that layer's kind:
keys and values (:class:`attnkit.kv_cache.LayerCache`), a recurrent state
(:class:`attnkit.linear_family.RecurrentCache`), a mixer's state (its ``new_cache()``), or the
last W − 1 keys of a sliding layer (:class:`attnkit.modern.StreamingCache` without sinks, when
its positions are relative; all keys otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from attnkit import arguments
from attnkit.kv_cache import KVCache, LayerCache

__all__ = [
    "LayerEntry",
    "StackCache",
    "build_mixer",
    "describe",
    "layer_arguments",
    "mixer_name",
    "names",
    "parse",
    "seen",
    "split",
    "stack_cache",
]

# A group separator is a ':' that does not belong to "sliding:W".
_SEPARATOR = re.compile(r"(?<!sliding):")
_GROUP = re.compile(r"^(?:(\d+)\s+)?(\S+)$")
_SLIDING = re.compile(r"^sliding:(\d+)$")
_NAME = re.compile(r"^(?:(part|mixer)\.)?([A-Za-z_]\w*)$")

# The self-attention arguments that shape the ``full`` layers only.
_SELF_ATTENTION = ("attention", "position", "pattern", "score_mod", "gate")


@dataclass(frozen=True)
class LayerEntry:
    """One layer of a plan.

    Attributes:
        kind: ``"full"``, ``"sliding"``, ``"part"`` (a registered per-head part), ``"mixer"``
            (a registered token mixer) or ``"module"`` (a module or factory given).
        name: how the layer is spelt in a pattern (``"sliding:512"``, ``"gated_deltanet"``,
            ``"mixer.mamba2"``), or the module's or factory's name.
        window: W of a ``sliding`` layer.
        make: the module or factory of a ``module`` entry.
    """

    kind: str
    name: str
    window: int | None = None
    make: Any = None


def _mechanisms() -> dict[str, type]:
    """Registered mechanisms that are per-head parts, name -> class."""
    from attnkit import mechanisms
    from attnkit.head import HeadAttention

    out = {}
    for name in mechanisms.available():
        cls = mechanisms.REGISTRY.get(name)
        if isinstance(cls, type) and issubclass(cls, HeadAttention):
            out[name] = cls
    return out


def _mixers() -> list[str]:
    from attnkit import mixers

    return mixers.REGISTRY.available()


def names() -> list[str]:
    """Every name a plan may hold: ``full``, ``sliding:W``, the per-head parts, the token
    mixers (a mixer whose name is also a per-head part's as ``mixer.NAME``)."""
    parts = sorted(_mechanisms())
    mixers = [f"mixer.{m}" if m in parts else m for m in _mixers()]
    return ["full", "sliding:W", *parts, *mixers]


def _options() -> str:
    return ", ".join(names())


def _entry(text: str, where: str) -> LayerEntry:
    """The entry named ``text``; ValueError naming ``where`` and the options otherwise."""
    if text == "full":
        return LayerEntry("full", "full")
    if text.startswith("sliding"):
        found = _SLIDING.match(text)
        if found is None or int(found.group(1)) < 1:
            raise ValueError(
                f"{where}: {text!r} is not a sliding window; write sliding:W with W >= 1 the "
                "keys each query attends (e.g. sliding:512)"
            )
        return LayerEntry("sliding", text, window=int(found.group(1)))
    found = _NAME.match(text)
    if found is not None:
        prefix, name = found.groups()
        if prefix != "mixer" and name in _mechanisms():
            return LayerEntry("part", text)
        if prefix != "part" and name in _mixers():
            return LayerEntry("mixer", text)
    import difflib

    close = difflib.get_close_matches(text, names(), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{where}: unknown layer {text!r}{hint} (a layer is one of: {_options()})")


def split(text: str, num_layers: int | None = None) -> list[str]:
    """The layer names of the pattern ``text``, one per layer, repeated to ``num_layers`` —
    the grammar only, the names unchecked (for a model with names of its own, as ``attnkit
    run``'s tasks have). ValueError for a malformed pattern or a ``num_layers`` that its
    period does not divide."""
    if not isinstance(text, str):
        raise TypeError(f"layers must be a pattern (str), got {type(text).__name__}")
    arguments.optional_positive_int(num_layers, "num_layers")
    where = f"layers {text!r}"
    out: list[str] = []
    for group in _SEPARATOR.split(text):
        found = _GROUP.match(group.strip())
        if found is None:
            what = "an empty group" if not group.strip() else f"group {group.strip()!r}"
            raise ValueError(
                f"{where}: {what} is not COUNT NAME; a pattern is groups of COUNT NAME "
                "separated by ':', e.g. '3 gated_deltanet : 1 full'"
            )
        count = 1 if found.group(1) is None else int(found.group(1))
        if count < 1:
            raise ValueError(f"{where}: group {group.strip()!r} has a count of 0")
        out += [found.group(2)] * count
    _check_period(len(out), num_layers, repr(text))
    return out * (1 if num_layers is None else num_layers // len(out))


def _check_period(period: int, num_layers: int | None, spelt: str) -> None:
    if not period:
        raise ValueError("layers: the plan holds no layer")
    if num_layers is not None and num_layers % period:
        raise ValueError(
            f"num_layers = {num_layers} is not a multiple of the {period} layers of "
            f"{spelt}: the pattern repeats whole; give a multiple of {period} or spell "
            "every layer"
        )


def _pattern(text: str) -> list[LayerEntry]:
    return [_entry(name, f"layers {text!r}") for name in split(text)]


def _module(item: object, i: int) -> LayerEntry:
    if isinstance(item, nn.Module) or callable(item):
        name = getattr(item, "__name__", type(item).__name__)
        return LayerEntry("module", name, make=item)
    raise TypeError(
        f"layers[{i}] must be a layer name (str), an nn.Module or a factory, got "
        f"{type(item).__name__}"
    )


def parse(layers: object, num_layers: int | None = None) -> tuple[LayerEntry, ...]:
    """The plan of a stack, one entry per layer (module docstring for the spellings).

    Raises:
        ValueError: an unknown name (the options listed), a malformed pattern, an empty list, a
            ``num_layers`` that the period does not divide, or one module given to several
            layers (a module holds one layer's parameters: give a factory), or ``layers`` that
            is neither a positive int, a pattern nor a list.
        TypeError: a list entry that is neither a name, a module nor a factory.
    """
    arguments.optional_positive_int(num_layers, "num_layers")
    if not isinstance(layers, str | Sequence):
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(
                f"layers must be a positive int, got {layers!r}, or a plan: a pattern such as "
                "'3 gated_deltanet : 1 full' or a list of one entry per layer"
            )
        if num_layers is not None and num_layers != layers:
            raise ValueError(
                f"num_layers = {num_layers} repeats a pattern; with layers = {layers} (an int) "
                "leave it out"
            )
        return (LayerEntry("full", "full"),) * layers
    if isinstance(layers, str):
        period = _pattern(layers)
        spelt = repr(layers)
    else:
        period = [
            _entry(item, f"layers[{i}]") if isinstance(item, str) else _module(item, i)
            for i, item in enumerate(layers)
        ]
        spelt = "the list"
    _check_period(len(period), num_layers, spelt)
    plan = tuple(period) * (1 if num_layers is None else num_layers // len(period))
    used: dict[int, int] = {}
    for i, entry in enumerate(plan):
        if isinstance(entry.make, nn.Module):
            if id(entry.make) in used:
                raise ValueError(
                    f"layers: the module {entry.name} fills layers {used[id(entry.make)]} and "
                    f"{i}, which would share its parameters; give a factory that makes one per "
                    "layer"
                )
            used[id(entry.make)] = i
    return plan


def describe(plan: Sequence[LayerEntry]) -> str:
    """The plan as a pattern, runs of equal entries counted: ``"3 gated_deltanet : 1 full"``."""
    groups: list[list] = []
    for entry in plan:
        if groups and groups[-1][1] == entry.name:
            groups[-1][0] += 1
        else:
            groups.append([1, entry.name])
    return " : ".join(f"{count} {name}" for count, name in groups)


def _check_mixer(module: object, who: str) -> None:
    from attnkit.mixers import TokenMixer

    if not isinstance(module, TokenMixer):
        raise TypeError(f"{who} must be an attnkit.mixers.TokenMixer, got {type(module).__name__}")


def _built(entry: LayerEntry, sizes: dict[str, Any], device: Any, dtype: Any) -> dict[str, Any]:
    """The layer arguments of a ``module`` entry: its module, or what its factory makes."""
    from attnkit.head import HeadAttention
    from attnkit.mixers import TokenMixer

    module = entry.make
    made = not isinstance(module, nn.Module)
    if made:
        module = module(**sizes)
        if (device is not None or dtype is not None) and isinstance(module, nn.Module):
            module = module.to(device=device, dtype=dtype)
    if isinstance(module, TokenMixer):
        return {"mixer": module}
    if isinstance(module, HeadAttention):
        return {"attention": module}
    what = f"the factory {entry.name} made" if made else "the module given"
    raise TypeError(
        f"layers: {what} is a {type(module).__name__}; a layer takes an attnkit.mixers."
        "TokenMixer (a whole token-mixing layer) or an attnkit.HeadAttention (a per-head part "
        "for the self-attention)"
    )


def layer_arguments(
    entry: LayerEntry,
    layer: dict[str, Any],
    *,
    embed_dim: int,
    num_heads: int,
    max_len: int | None = None,
    keeps_score: bool = False,
    index: int = 0,
    depth: int = 1,
) -> dict[str, Any]:
    """The keyword arguments of the Transformer layer that ``entry`` is, from ``layer``, the
    stack's keyword arguments. ``keeps_score``: the layer reads ``score``/``align`` besides its
    self-attention (a decoder layer's cross-attention), so they stay for every entry.
    ``index`` and ``depth``: the layer's place in a stack of ``depth`` layers, given as
    ``layer_idx`` and ``num_layers`` to a registered part or mixer whose constructor takes them
    (lightning attention's decays depend on the layer's place).

    Raises ValueError for a part or mixer that cannot be built from the layer's sizes."""
    if entry.kind == "full":
        return dict(layer)
    out = {k: v for k, v in layer.items() if k not in _SELF_ATTENTION}
    if entry.kind == "sliding":
        for key in ("attention", "position", "score_mod", "gate"):
            if key in layer:
                out[key] = layer[key]
        return {**out, "window": entry.window}
    if not keeps_score:
        out.pop("score", None)
        out.pop("align", None)
    head_dim = layer.get("head_dim") or embed_dim // num_heads
    sizes = {"embed_dim": embed_dim, "num_heads": num_heads, "head_dim": head_dim}
    device, dtype = layer.get("device"), layer.get("dtype")
    if entry.kind == "module":
        return {**out, **_built(entry, sizes, device, dtype)}
    name = entry.name.partition(".")[2] or entry.name
    place = {"layer_idx": index, "num_layers": depth}
    if entry.kind == "part":
        from attnkit import mechanisms

        cls = _mechanisms()[name]
        takes = mechanisms.REGISTRY.accepts(name)
        try:
            part = cls.for_heads(
                **sizes, max_len=max_len, **{k: v for k, v in place.items() if k in takes}
            )
        except TypeError as err:
            raise ValueError(
                f"layers: the per-head part {name!r} cannot be built from the layer's sizes "
                f"({err}); build it yourself and give a factory in a list of layers"
            ) from None
        if device is not None or dtype is not None:
            part = part.to(device=device, dtype=dtype)
        return {**out, "attention": part}
    module = build_mixer(name, **sizes, index=index, depth=depth, device=device, dtype=dtype)
    return {**out, "mixer": module}


def mixer_name(text: str) -> str | None:
    """The registered token mixer that the layer name ``text`` (``NAME`` or ``mixer.NAME``)
    names, or None."""
    name = text.removeprefix("mixer.")
    return name if name in _mixers() else None


def build_mixer(
    name: str,
    *,
    embed_dim: int,
    num_heads: int,
    head_dim: int | None = None,
    index: int = 0,
    depth: int = 1,
    device: Any = None,
    dtype: Any = None,
) -> nn.Module:
    """The registered token mixer ``name`` for a layer of width ``embed_dim`` with
    ``num_heads`` heads of ``head_dim`` (embed_dim / num_heads by default), at place ``index``
    of ``depth`` layers: its constructor gets those of these sizes it takes (``layer_idx`` and
    ``num_layers`` for the place). Raises ValueError for an unknown name (the options listed)
    or a mixer that the sizes do not build."""
    from attnkit import mixers

    takes = mixers.REGISTRY.accepts(name)  # unknown names: ValueError listing the mixers
    if "embed_dim" not in takes:
        raise ValueError(
            f"layers: token mixer {name!r} takes no embed_dim, so it cannot be built from the "
            "layer's sizes; give a factory in a list of layers"
        )
    given = {
        "embed_dim": embed_dim,
        "num_heads": num_heads,
        "head_dim": head_dim or embed_dim // num_heads,
        "layer_idx": index,
        "num_layers": depth,
        "device": device,
        "dtype": dtype,
    }
    try:
        module = mixers.REGISTRY.build(name, **{k: v for k, v in given.items() if k in takes})
    except TypeError as err:
        raise ValueError(
            f"layers: token mixer {name!r} cannot be built from the layer's sizes ({err}); give "
            "a factory in a list of layers"
        ) from None
    _check_mixer(module, f"token mixer {name!r}")
    return module


class StackCache(KVCache):
    """A :class:`attnkit.kv_cache.KVCache` whose slot i is the kind layer i decodes with
    (``layer.new_cache()``): keys and values, a recurrent state, a mixer's state, a window.

    ``length`` is the number of positions seen (a window slot holds fewer)."""

    def __init__(self, slots: Sequence[LayerCache]) -> None:
        super().__init__(len(slots))
        self.layers = list(slots)

    @property
    def length(self) -> int:
        """The number of positions seen (the position offset of the next token)."""
        return seen(self.layers[0])


def seen(slot: LayerCache) -> int:
    """The positions a slot has seen: its length, or for a window slot the tokens appended."""
    from attnkit.modern.streaming import StreamingCache

    return slot.seen if isinstance(slot, StreamingCache) else len(slot)


def stack_cache(layers: Sequence[nn.Module]) -> StackCache:
    """One slot per layer, each made by the layer's ``new_cache()``."""
    return StackCache([layer.new_cache() for layer in layers])
