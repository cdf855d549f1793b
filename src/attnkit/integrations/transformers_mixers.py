"""attnkit's token-mixer layers inside Hugging Face ``transformers`` hybrid models.

Hybrid models alternate softmax attention with *linear* token-mixer layers (Mamba-2's mixer,
Gated DeltaNet, Kimi Delta Attention, lightning attention). Their attention layers go through
transformers' attention interface and :func:`attnkit.integrations.transformers.swap_attention`
evaluates them with attnkit; their linear layers are modules of their own, which
:func:`swap_mixers` replaces: each becomes a :class:`TransformersMixer`, a module with the
original's forward signature that holds the attnkit mixer equal to it (built by the mixer's
``from_transformers``, its weights copied) and reads and writes the model's own cache, so
``model(...)`` and ``model.generate(...)`` work unchanged:

    from attnkit.integrations.transformers import swap_attention
    from attnkit.integrations.transformers_mixers import swap_mixers
    swap_mixers(model)        # every linear layer now an attnkit mixer
    swap_attention(model)     # and every attention layer attnkit's attention

With the defaults the swapped model is the same model: its logits equal the original's (float64:
to rounding, with and without left or right padding at the real positions), and greedy
generation gives the same tokens through the same cache. The layers covered
(:data:`SUPPORTED`):

- ``Mamba2Mixer`` (Mamba-2), ``BambaMixer`` (Bamba), ``GraniteMoeHybridMambaLayer`` (Granite 4
  hybrid), ``NemotronHMamba2Mixer`` (Nemotron-H), ``Zamba2MambaMixer`` (Zamba 2):
  :class:`attnkit.mixers.Mamba2Mixer`;
- ``Qwen3NextGatedDeltaNet`` (Qwen3-Next), ``Qwen3_5GatedDeltaNet`` and
  ``Qwen3_5MoeGatedDeltaNet`` (Qwen3.5): :class:`attnkit.mixers.GatedDeltaNetMixer`;
- ``KimiLinearDeltaAttention`` (Kimi Linear): :class:`attnkit.mixers.KimiDeltaAttentionMixer`;
- ``MiniMaxLightningAttention`` (MiniMax): :class:`attnkit.mixers.LightningAttentionMixer`.

Linear layers that no attnkit mixer reproduces (Mamba-1 in Jamba, Zamba and Falcon-Mamba;
Falcon-H1's µP-scaled mixer; the Gated DeltaNet variants not checked) are listed in
:data:`NOT_EXACT`, and :func:`swap_mixers` refuses a model holding one by name, with the reason.

The cache: transformers keeps a linear layer's state in its cache (``DynamicCache``'s linear
attention layers: ``get_conv_state`` / ``get_recurrent_state`` and their ``update_*``; MiniMax's
``MiniMaxCache``: ``get_linear_cache`` / ``set_linear_cache``). At every call the adapter reads
the layer's states from there into a :class:`attnkit.mixers.MixerCache` (the convolution's
last inputs, transposed; the recurrent state, transposed for Mamba-2, whose transformers layout
is (B, H, P, n)), runs the mixer, and writes the new states back in transformers' layout: the
convolution's new inputs through ``update_conv_state`` (so the cache keeps what transformers
keeps, also when it records the past for rollback), the state through
``update_recurrent_state``. Beam search and the cache's other operations act on those tensors
as usual. The recurrent state is stored in the mixer's working dtype (float32 for half and
float32 models, float64 for float64 ones; transformers stores Kimi's in float32 always).

Decoding a Mamba-2 layer: transformers' one-token step leaves the time-step limit out (its
sequence path clamps Δ to ``time_step_limit``); the adapter does the same, so that Nemotron-H and
Zamba 2, whose default limit is (time_step_min, ∞), decode as transformers does.

Padding: transformers zeroes the padded positions of the layer's input; attnkit's mixers remove
them entirely (no write, no decay, output 0). At real positions the outputs agree for left and
right padding when the input projection has no bias (every default configuration); the state
after a *right*-padded prefill differs (transformers keeps decaying it over the padding,
attnkit's is the state of the sequence alone), which matters only for generation from a
right-padded batch (transformers pads generation on the left).

Choosing another part: ``swap_mixers(model, chunk_size=16)`` passes its keyword arguments to
the mixers' ``from_transformers`` (any chunk size gives the same outputs); ``mixer=`` builds
another attnkit mixer per layer: a registered name or a :class:`attnkit.mixers.TokenMixer`
class (built by its ``from_transformers``), or a callable ``module -> TokenMixer`` (a mixer
of any kind and size, e.g. a new one to fine-tune). A mixer of the layer's own attnkit class
keeps its states in transformers' cache as above; a mixer of another class keeps its
:class:`attnkit.mixers.MixerCache` on the transformers cache object (one per layer; beam
search does not reorder it).

Parameters: the attnkit mixer holds copies of the original layer's weights (Gated DeltaNet's
projections reordered into blocks, see :mod:`attnkit.mixers.gated_deltanet`), registered as
``<layer>.mixer.*``; the original module is dropped, so ``model.parameters()`` and
``model.state_dict()`` hold the attnkit layout (``state_dict`` keys change accordingly; save the
original model for transformers' loaders; the swapped model's ``save_pretrained`` raises
``ValueError``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.mixers import REGISTRY as MIXERS
from attnkit.mixers import (
    GatedDeltaNetMixer,
    KimiDeltaAttentionMixer,
    LightningAttentionMixer,
    Mamba2Mixer,
    MixerCache,
    TokenMixer,
)
from attnkit.mixers.conv import zero_padding

__all__ = ["NOT_EXACT", "SUPPORTED", "Layout", "TransformersMixer", "swap_mixers"]

#: Where a :class:`TransformersMixer` keeps the caches of mixers whose states have no place in
#: transformers' layout (an attribute of the transformers cache object: layer index → cache).
SIDE_CACHES = "attnkit_mixer_caches"

_QWEN35 = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")


def _gated_deltanet(module: nn.Module, **overrides: Any) -> GatedDeltaNetMixer:
    """:class:`GatedDeltaNetMixer` equal to Qwen3.5's Gated DeltaNet layer (Qwen3-Next's layer
    with its projections apart: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``,
    each in blocks, head-major, as attnkit's), weights copied."""
    name = type(module).__name__
    if module.activation not in ("silu", "swish") or module.conv1d.bias is not None:
        raise ValueError(
            f"{name}: expected a SiLU convolution without bias, got activation "
            f"{module.activation!r}, bias {module.conv1d.bias is not None}"
        )
    if getattr(module.norm, "activation", "silu") not in ("silu", "swish"):
        raise ValueError(
            f"{name}: expected a SiLU gate in the norm, got {module.norm.activation!r}"
        )
    sizes = {
        "embed_dim": module.hidden_size,
        "num_heads": module.num_k_heads,
        "head_dim": module.head_k_dim,
        "num_v_heads": module.num_v_heads,
        "head_v_dim": module.head_v_dim,
        "conv_kernel": module.conv_kernel_size,
        "eps": module.norm.variance_epsilon,
    }
    weight = module.in_proj_qkv.weight
    layer = GatedDeltaNetMixer(**(sizes | overrides), device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.in_proj_qkvz.weight.copy_(torch.cat([weight, module.in_proj_z.weight], 0))
        layer.in_proj_ba.weight.copy_(
            torch.cat([module.in_proj_b.weight, module.in_proj_a.weight], 0)
        )
        layer.conv.weight.copy_(module.conv1d.weight)
        for attr in ("dt_bias", "A_log"):
            getattr(layer, attr).copy_(getattr(module, attr))
        layer.norm.weight.copy_(module.norm.weight)
        layer.out_proj.weight.copy_(module.out_proj.weight)
    return layer


def _mamba2_mixer(module: nn.Module, **overrides: Any) -> Mamba2Mixer:
    """The Mamba-2 mixer at the module's own chunk size (any chunk size gives the same
    outputs), weights copied."""
    return Mamba2Mixer.from_transformers(module, **({"chunk_size": module.chunk_size} | overrides))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one transformers linear layer maps onto attnkit.

    Attributes:
        mixer: the attnkit mixer class equal to it.
        build: ``(module, **overrides) -> mixer`` with the weights copied.
        state: the :class:`attnkit.mixers.MixerCache` entry of the recurrent state.
        transposed: transformers' state is that entry with its last two dimensions swapped.
        cache: ``"linear"`` (``get_conv_state`` / ``get_recurrent_state``) or ``"minimax"``
            (``get_linear_cache`` / ``set_linear_cache``).
        returns_state: the module's forward returns (output, state) rather than the output.
        step_unlimited: a one-token step from a state leaves the time-step limit out (as
            transformers' Mamba-2 step does; its sequence path applies it).
    """

    mixer: type[TokenMixer]
    build: Callable[..., TokenMixer]
    state: str
    transposed: bool = False
    cache: str = "linear"
    returns_state: bool = False
    step_unlimited: bool = False


#: transformers linear layers that :func:`swap_mixers` replaces, by class name.
SUPPORTED: dict[str, Layout] = {
    **{
        n: Layout(Mamba2Mixer, _mamba2_mixer, "ssm", True, step_unlimited=True)
        for n in Mamba2Mixer.TRANSFORMERS_NAMES
    },
    "Qwen3NextGatedDeltaNet": Layout(
        GatedDeltaNetMixer, GatedDeltaNetMixer.from_transformers, "delta"
    ),
    **{n: Layout(GatedDeltaNetMixer, _gated_deltanet, "delta") for n in _QWEN35},
    "KimiLinearDeltaAttention": Layout(
        KimiDeltaAttentionMixer, KimiDeltaAttentionMixer.from_transformers, "delta"
    ),
    "MiniMaxLightningAttention": Layout(
        LightningAttentionMixer,
        LightningAttentionMixer.from_transformers,
        "lightning",
        cache="minimax",
        returns_state=True,
    ),
}

_MAMBA1 = (
    "Mamba-1's selective scan (a diagonal state per channel, Δ, B and C from x_proj/dt_proj) "
    "is not a layer attnkit builds; its Mamba2Mixer has scalar decays per head"
)
_UNCHECKED = "not compared with attnkit's Gated DeltaNet layer"

#: transformers linear layers that no attnkit mixer reproduces, with the reason;
#: :func:`swap_mixers` refuses a model holding one.
NOT_EXACT: dict[str, str] = {
    "MambaMixer": _MAMBA1,
    "FalconMambaMixer": _MAMBA1 + " (and Falcon-Mamba RMS-normalises B, C and Δ)",
    "JambaMambaMixer": _MAMBA1 + " (and Jamba RMS-normalises B, C and Δ)",
    "ZambaMambaMixer": _MAMBA1,
    "FalconH1Mixer": (
        "Falcon-H1 scales the input by ssm_in_multiplier and the projections by a µP vector, and "
        "by default (mamba_rms_norm=False) gates y·SiLU(z) without the RMSNorm, which attnkit's "
        "Mamba2Mixer always applies"
    ),
    "Qwen4ExpTextGatedDeltaNet": _UNCHECKED,
    "OlmoHybridGatedDeltaNet": _UNCHECKED,
    "LaraMiniGatedDeltaNet": _UNCHECKED,
    "BailingHybridDeltaAttention": "not compared with attnkit's linear layers",
    "Glm5NextTextLinearAttention": "not compared with attnkit's linear layers",
}

_CACHE_NAMES = ("cache", "cache_params", "past_key_values")


def _capture_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook on the mixer's convolution: keep its input (the new positions'
    pre-convolution channels) for the transformers cache."""
    module.__dict__["_attnkit_input"] = args[0] if args else kwargs["x"]


class TransformersMixer(nn.Module):
    """A transformers linear layer evaluated by an attnkit mixer (see the module docstring).

    Args:
        mixer: the attnkit :class:`attnkit.mixers.TokenMixer`, registered as ``mixer``.
        original: the transformers module replaced: its forward signature, ``layer_idx`` and
            class name are kept (the module itself is not).
        in_layout: the mixer's states live in transformers' cache layout (the mixer is the
            layer's own attnkit class); otherwise its cache is kept beside it.
    """

    def __init__(self, mixer: TokenMixer, original: nn.Module, *, in_layout: bool = True) -> None:
        super().__init__()
        if not isinstance(mixer, TokenMixer):
            raise TypeError(f"mixer must be an attnkit TokenMixer, got {type(mixer).__name__}")
        source = _name(original)
        if source not in SUPPORTED:
            raise ValueError(
                f"original must be a transformers {' / '.join(sorted(SUPPORTED))}, got "
                f"{type(original).__module__}.{type(original).__name__}"
            )
        self.mixer = mixer
        self.source = source
        self.layer_idx = original.layer_idx
        self.in_layout = bool(in_layout) and type(mixer) is SUPPORTED[source].mixer
        self._signature = inspect.signature(original.forward)
        self.kernel_size = None
        conv = getattr(mixer, "conv", None)
        if self.in_layout and SUPPORTED[source].cache == "linear":
            self.kernel_size = conv.kernel_size
            conv.register_forward_pre_hook(_capture_input, with_kwargs=True)

    def extra_repr(self) -> str:
        return f"source={self.source}, layer_idx={self.layer_idx}, in_layout={self.in_layout}"

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        for old in _CACHE_NAMES[1:]:  # transformers' deprecated names for the cache
            if old in kwargs and "cache" not in kwargs and old not in self._signature.parameters:
                kwargs["cache"] = kwargs.pop(old)
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{self.source} (swapped): {err}") from None
        arguments = dict(bound.arguments)
        extra = arguments.pop(
            next((n for n, p in self._signature.parameters.items() if p.kind == p.VAR_KEYWORD), ""),
            {},
        )
        packed = extra.get("cu_seq_lens_q")
        if packed is not None:
            raise ValueError(
                f"{self.source} (swapped): packed sequences (cu_seq_lens_q) are not supported; "
                "give a padded batch with an attention_mask"
            )
        return arguments

    def _keep(self, mask: object, x: Tensor) -> Tensor | None:
        if mask is None:
            return None
        if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape != x.shape[:2]:
            shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(
                f"{self.source} (swapped): attention_mask must be the padding mask of the new "
                f"positions, (B, N) = {tuple(x.shape[:2])} with 1 = a real position, got {shape}"
            )
        return mask.bool()

    def _read(self, cache: Any, x: Tensor) -> MixerCache:
        """The layer's states in transformers' ``cache`` as a MixerCache for the mixer."""
        layout = SUPPORTED[self.source]
        ours = self.mixer.new_cache()
        if not self.in_layout:
            side = cache.__dict__.setdefault(SIDE_CACHES, {})
            return side.setdefault(self.layer_idx, ours)
        work = torch.promote_types(x.dtype, torch.float32)
        if layout.cache == "minimax":
            state = cache.get_linear_cache(self.layer_idx)
            conv = None
        else:
            state = cache.get_recurrent_state(self.layer_idx)
            conv = cache.get_conv_state(self.layer_idx)
        if isinstance(conv, Tensor) and self.kernel_size > 1:
            last = conv[..., conv.shape[-1] - (self.kernel_size - 1) :]
            ours.states[self.mixer.conv.state_name] = last.transpose(1, 2).to(x.dtype).contiguous()
        if isinstance(state, Tensor):
            state = state.transpose(-1, -2) if layout.transposed else state
            ours.states[layout.state] = state.to(work).contiguous()
        return ours

    def _write(self, cache: Any, ours: MixerCache, keep: Tensor | None) -> Tensor | None:
        """Write the mixer's new states back into transformers' ``cache``; returns the
        recurrent state in transformers' layout."""
        layout = SUPPORTED[self.source]
        state = ours.states[layout.state]
        state = state.transpose(-1, -2).contiguous() if layout.transposed else state
        if layout.cache == "minimax":
            cache.set_linear_cache(self.layer_idx, state)
            return state
        new = self.mixer.conv.__dict__.pop("_attnkit_input")
        new = zero_padding(new, keep).transpose(1, 2)  # (B, channels, N), as transformers'
        cache.update_conv_state(new, self.layer_idx, conv_kernel_size=self.kernel_size)
        cache.update_recurrent_state(state, self.layer_idx)
        return state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The original module's forward: same arguments, same outputs."""
        arguments = self._arguments(args, kwargs)
        x = arguments["hidden_states"]
        keep = self._keep(arguments.get("attention_mask"), x)
        cache = arguments.get("cache")
        layout = SUPPORTED[self.source]
        if cache is None:
            try:
                out = self.mixer(x, mask=keep)
            finally:
                if self.kernel_size is not None:  # the captured input is not needed
                    self.mixer.conv.__dict__.pop("_attnkit_input", None)
            return (out, None) if layout.returns_state else out
        ours = self._read(cache, x)
        limit = None
        if (
            self.in_layout
            and layout.step_unlimited
            and x.shape[1] == 1
            and layout.state in ours.states
        ):
            limit, self.mixer.time_step_limit = self.mixer.time_step_limit, (0.0, math.inf)
        try:
            out = self.mixer(x, mask=keep, cache=ours)
            state = self._write(cache, ours, keep) if self.in_layout else None
        finally:
            if limit is not None:
                self.mixer.time_step_limit = limit
            if self.kernel_size is not None:
                self.mixer.conv.__dict__.pop("_attnkit_input", None)
        return (out, state) if layout.returns_state else out


def _name(module: nn.Module) -> str:
    """The class name of a transformers module ("" for others: attnkit's Mamba2Mixer is not
    transformers')."""
    cls = type(module)
    return cls.__name__ if cls.__module__.startswith("transformers.") else ""


def _builder(mixer: Any, overrides: dict[str, Any]) -> Callable[[nn.Module], TokenMixer]:
    """``module -> TokenMixer`` for the ``mixer`` argument of :func:`swap_mixers`."""
    if mixer is None:
        return lambda m: SUPPORTED[type(m).__name__].build(m, **overrides)
    if isinstance(mixer, str):
        mixer = MIXERS.get(mixer)
    if isinstance(mixer, type):
        if not issubclass(mixer, TokenMixer) or not hasattr(mixer, "from_transformers"):
            raise TypeError(
                f"mixer must be a TokenMixer class with from_transformers, got {mixer.__name__}"
            )
        cls = mixer

        def build(m: nn.Module) -> TokenMixer:
            try:
                return cls.from_transformers(m, **overrides)
            except TypeError as err:
                raise ValueError(
                    f"mixer {cls.__name__} cannot be built from {type(m).__name__}: {err}"
                ) from None

        return build
    if callable(mixer):
        if overrides:
            raise TypeError(
                f"keyword arguments {sorted(overrides)} go to from_transformers; a callable mixer "
                "takes none"
            )
        return mixer
    raise TypeError(
        f"mixer must be None, a registered mixer name, a TokenMixer class or a callable "
        f"module -> TokenMixer, got {type(mixer).__name__}"
    )


def swap_mixers(model: nn.Module, *, mixer: Any = None, **overrides: Any) -> list[str]:
    """Replace every linear token-mixer layer of a ``transformers`` model by an attnkit mixer.

    Args:
        model: a transformers model (any ``nn.Module``) holding layers listed in
            :data:`SUPPORTED`.
        mixer: None for the attnkit mixer equal to each layer (its ``from_transformers``);
            a registered mixer name or a :class:`attnkit.mixers.TokenMixer` class, built from
            each layer by its ``from_transformers``; or a callable ``module -> TokenMixer``.
        **overrides: passed to ``from_transformers`` (e.g. ``chunk_size``).

    Returns:
        The names of the modules replaced, in ``model.named_modules()`` order.

    Raises:
        ValueError: the model holds a layer listed in :data:`NOT_EXACT` (named, with the
            reason), or no linear layer at all; a mixer cannot be built from a layer.
        TypeError: ``mixer`` is none of the above, or a callable returns no TokenMixer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
    refused = sorted({_name(m) for m in model.modules() if _name(m) in NOT_EXACT})
    if refused:
        reasons = "; ".join(f"{n}: {NOT_EXACT[n]}" for n in refused)
        raise ValueError(f"swap_mixers does not reproduce {', '.join(refused)} ({reasons})")
    targets = [(name, m) for name, m in model.named_modules() if _name(m) in SUPPORTED]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} holds no linear token-mixer layer that swap_mixers knows "
            f"({', '.join(sorted(SUPPORTED))})"
        )
    build = _builder(mixer, overrides)
    replaced = []
    for name, module in targets:  # built first: a failure leaves the model as it was
        built = build(module)
        if not isinstance(built, TokenMixer):
            raise TypeError(
                f"the mixer built for {name} ({type(module).__name__}) must be a TokenMixer, got "
                f"{type(built).__name__}"
            )
        built.train(module.training)
        replaced.append((name, TransformersMixer(built, module)))
    for name, adapter in replaced:
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, adapter)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = types.MethodType(_refuse_saving, model)
    return [name for name, _ in replaced]


def _refuse_saving(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``save_pretrained`` of a model whose linear layers :func:`swap_mixers` replaced."""
    raise ValueError(
        f"{type(self).__name__}'s linear layers are attnkit mixers (swap_mixers), whose weights "
        "transformers cannot load: save the original model, or torch.save(model.state_dict()) "
        "and load it into a model swapped the same way"
    )
