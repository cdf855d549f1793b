"""Kernels as registered parts: what a kernel is, the call it is asked to evaluate, the registry.

A kernel evaluates one validated attention call (:class:`Call`). It states what it supports as
class data (the capabilities below); :meth:`Kernel.reasons_not_supported` turns every unmet
capability into a sentence and adds the kernel's own :meth:`Kernel.extra_reasons` (empty when
it can evaluate the call). :meth:`Kernel.prefers` says whether automatic selection should take
it for a call it supports. :func:`select` picks by priority, or runs the kernel the caller forces
and, when that kernel cannot run the call, raises with its reasons;
:func:`attnkit.kernels.explain` says which kernel a call gets and why every other one does not.

A kernel with several ways of evaluating a call (a fast path and a general one) lists them as
:class:`attnkit.kernels.paths.Path` objects in ``paths``; each path declares what it needs with
the same capabilities (:class:`Capabilities`), and the kernel takes the first that serves the
call (:meth:`Kernel.choose_path`), so no fast path runs on a call it did not declare.

Kernels live in the shared :class:`attnkit.registry.Registry` (:data:`REGISTRY`), one class per
name; :func:`get` returns the class's single instance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.alignments.streaming import Streaming
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.output import AttentionOutput
from attnkit.registry import Registry
from attnkit.scores import Score

if TYPE_CHECKING:
    from attnkit.kernels.paths import Path

__all__ = [
    "REGISTRY",
    "Call",
    "Capabilities",
    "Kernel",
    "KernelRegistry",
    "available",
    "forced_kernel",
    "get",
    "guarded_sum",
    "head_size",
    "register",
    "select",
]

LOG = logging.getLogger("attnkit.kernels")


@dataclass(frozen=True)
class Call:
    """One validated attention call: q (B, …, M, d_q) or None, k (B, …, N, d_k),
    v (B, …, N, d_v), the score and alignment modules, mask/bias broadcastable to
    ``shape`` = (B, …, M, N), and optionally a sparse pattern's block mask and a score_mod.

    ``masked_finite``: no key or value that the mask hides from some query is NaN or infinite
    (:func:`attnkit.core.prepare_call` cleared them, found none, or was told the inputs are
    finite), so a kernel need not look for them; False (the default) leaves the guard to it."""

    q: Tensor | None
    k: Tensor
    v: Tensor
    score: Score
    align: Alignment
    shape: torch.Size
    mask: Tensor | None = None
    bias: Tensor | None = None
    need_weights: bool = False
    chunk_size: int | None = None
    dropout: float = 0.0
    block_mask: BlockMask | None = None
    score_mod: ScoreMod | None = None
    masked_finite: bool = False

    def parts(self) -> tuple[Tensor | None, Tensor, Tensor, Score, Alignment]:
        """(q, k, v, score, align), the positional arguments of the functional kernels."""
        return self.q, self.k, self.v, self.score, self.align


class Capabilities:
    """What evaluates a call (a kernel, or a path inside one) declares it can evaluate, as class
    data; :meth:`capability_reasons` turns every unmet capability into a sentence naming it.

    Capabilities (the defaults describe something that evaluates any call densely):

    - ``supports_dtypes``: the dtypes of q, k and v it evaluates (None: every floating dtype).
    - ``supports_devices``: the device types (``"cpu"``, ``"cuda"``, …) it runs on (None: all).
    - ``max_tokens``: the most queries or keys (max(M, N)) it takes (None: no limit).
    - ``needs_dot_product_score``: only scores in dot-product form (``score.dot_product_form``).
    - ``needs_equal_head_sizes``: only calls whose values have as many features (d_v) as the
      queries and keys have in the score's dot form (or d_k, for a score not in that form).
    - ``supports_multi_dimensional``: multi-dimensional scores (…, M, N, d_v) (eq. 31).
    - ``needs_softmax``: only softmax with a constant temperature (``align.softmax_temperature()``).
    - ``needs_streaming_alignment``: only alignments implementing the streaming protocol
      (:mod:`attnkit.alignments.streaming`) whose instance streams.
    - ``masks_key_mixing_scores``: hands a score that mixes neighbouring keys (``mixes_keys``)
      the whole mask, as such a score needs.
    - ``returns_weights``: returns the weights and scores (``need_weights=True``).
    - ``needs_block_mask``: only block-sparse calls (a ``block_mask``).
    - ``accepts_mask``, ``accepts_bias``, ``accepts_block_mask``, ``accepts_score_mod``,
      ``accepts_dropout``, ``accepts_chunk_size``: the call's optional arguments it honours.
    - ``gradients``: which gradients it gives when grad mode is on: ``"all"`` (q, k, v, the
      bias and every parameter of the score, alignment and score_mod), ``"inputs"`` (q, k and v
      only) or ``"none"`` (forward only).
    - ``runs_compiled``: it may run inside ``torch.compile``.
    """

    supports_dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    supports_devices: ClassVar[frozenset[str] | None] = None
    max_tokens: ClassVar[int | None] = None
    needs_dot_product_score: ClassVar[bool] = False
    needs_equal_head_sizes: ClassVar[bool] = False
    supports_multi_dimensional: ClassVar[bool] = True
    needs_softmax: ClassVar[bool] = False
    needs_streaming_alignment: ClassVar[bool] = False
    masks_key_mixing_scores: ClassVar[bool] = True
    returns_weights: ClassVar[bool] = True
    needs_block_mask: ClassVar[bool] = False
    accepts_mask: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    accepts_block_mask: ClassVar[bool] = True
    accepts_score_mod: ClassVar[bool] = True
    accepts_dropout: ClassVar[bool] = True
    accepts_chunk_size: ClassVar[bool] = False
    gradients: ClassVar[str] = "all"
    runs_compiled: ClassVar[bool] = True

    @property
    def label(self) -> str:
        """How its reasons name it (e.g. "the chunked kernel")."""
        raise NotImplementedError

    def reasons_not_supported(self, call: Call) -> list[str]:
        """Why this cannot evaluate ``call`` exactly; empty when it can.

        The reasons derived from the capabilities (:meth:`capability_reasons`), then its own
        (:meth:`extra_reasons`)."""
        return self.capability_reasons(call) + self.extra_reasons(call)

    def extra_reasons(self, call: Call) -> list[str]:
        """Its own reasons, beyond what its capabilities say; none by default."""
        return []

    def capability_reasons(self, call: Call) -> list[str]:
        """One sentence for every declared capability that ``call`` needs and this lacks.

        Reads attributes of the call and its parts only (no pass over a tensor's values)."""
        name = self.label
        reasons: list[str] = []
        score, align = call.score, call.align
        device = call.k.device.type
        if self.supports_devices is not None and device not in self.supports_devices:
            reasons.append(f"{name} runs on {_listed(self.supports_devices)}, not on {device}")
        if self.supports_dtypes is not None:
            seen = [t.dtype for t in (call.k, call.q, call.v) if t is not None]
            for dtype in dict.fromkeys(d for d in seen if d not in self.supports_dtypes):
                listed = _listed(str(d).removeprefix("torch.") for d in self.supports_dtypes)
                reasons.append(
                    f"{name} takes {listed} inputs, not {str(dtype).removeprefix('torch.')}"
                )
        if self.max_tokens is not None:
            m, n = call.shape[-2], call.shape[-1]
            if max(m, n) > self.max_tokens:
                reasons.append(
                    f"{name} takes at most {self.max_tokens} queries and keys, got M = {m}, N = {n}"
                )
        if self.needs_streaming_alignment:
            reasons.extend(_not_streamable(align))
        if self.needs_softmax and align.softmax_temperature() is None:
            reasons.append(
                f"the {type(align).__name__} alignment is not softmax with a constant temperature"
            )
        if self.needs_dot_product_score and not score.dot_product_form:
            reasons.append(f"the {type(score).__name__} score is not in dot-product form")
        if score.multi_dimensional and not self.supports_multi_dimensional:
            reasons.append(
                f"{name} does not evaluate multi-dimensional scores "
                f"(the {type(score).__name__} score gives one per value feature)"
            )
        if self.needs_equal_head_sizes and not score.multi_dimensional:
            d, d_v = head_size(call), call.v.shape[-1]
            if d != d_v:
                reasons.append(
                    f"{name} needs as many value features as query and key features "
                    f"(d_v = {d_v}, d = {d})"
                )
        masked = call.mask is not None or call.block_mask is not None
        if score.mixes_keys and masked and not self.masks_key_mixing_scores:
            reasons.append(
                f"score {type(score).__name__} mixes neighbouring keys, so it must see the whole "
                f"mask at once, which {name} does not give it (the dense kernel does)"
            )
        if call.need_weights and not self.returns_weights:
            reasons.append(f"{name} does not return the weights (need_weights=True)")
        if call.block_mask is None and self.needs_block_mask:
            reasons.append(f"{name} evaluates block-sparse calls only (a block_mask)")
        if call.mask is not None and not self.accepts_mask:
            reasons.append(f"{name} takes no mask")
        if call.bias is not None and not self.accepts_bias:
            reasons.append(f"{name} takes no bias")
        if call.block_mask is not None and not self.accepts_block_mask:
            reasons.append(
                f"{name} takes no block mask (block masks and score_mod run on the "
                f"{_kernels_with('accepts_block_mask')} kernel)"
            )
        if call.score_mod is not None:
            if not self.accepts_score_mod:
                reasons.append(
                    f"{name} takes no score_mod (score_mod runs on the "
                    f"{_kernels_with('accepts_score_mod')} kernel)"
                )
            elif score.multi_dimensional:
                reasons.append("score_mod applies to single-dimensional scores (…, M, N) only")
        if call.dropout > 0.0 and not self.accepts_dropout:
            reasons.append(f"{name} does not apply dropout (dropout={call.dropout})")
        if call.chunk_size is not None and not self.accepts_chunk_size:
            reasons.append(
                f"chunk_size is not an argument of {name} (it is the key block size "
                "of the chunked kernel)"
            )
        if self.gradients != "all":
            reasons.extend(_gradient_reasons(self.gradients, name, call))
        if not self.runs_compiled and torch.compiler.is_compiling():
            reasons.append(f"{name} does not run inside torch.compile")
        return reasons


class Kernel(Capabilities):
    """How attention is evaluated.

    Subclasses set ``name`` and ``priority`` (higher is tried first by automatic selection),
    declare their capabilities by overriding the class attributes of :class:`Capabilities`, and
    implement :meth:`attend`. The base class derives the generic reasons from the capabilities;
    a kernel adds what they cannot say in :meth:`extra_reasons` (data-dependent limits, for
    instance).

    Besides the capabilities:

    - ``preference``: the calls automatic selection takes it for, among those it supports (what
      :meth:`prefers` decides), in words completing "taken automatically only …"; empty when
      :meth:`prefers` is always True.
    - ``paths``: the ways the kernel evaluates a call it supports (:class:`attnkit.kernels.paths.
      Path`), fast paths first and its general path last; each declares what it needs beyond
      the kernel, and the kernel takes the first that serves the call (:meth:`choose_path`).
      Empty for a kernel with one way.
    """

    name: ClassVar[str]
    priority: ClassVar[int]
    preference: ClassVar[str] = ""
    paths: ClassVar[tuple[Path, ...]] = ()

    @property
    def label(self) -> str:
        return f"the {self.name} kernel"

    def prefers(self, call: Call) -> bool:
        """Whether automatic selection should take this kernel for a supported ``call``."""
        return True

    def direct(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        score: Score,
        align: Alignment,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        dropout: float = 0.0,
        additive: Tensor | None = None,
        keep_masked: bool = False,
    ) -> AttentionOutput | None:
        """The call of a layer whose plan has checked it (:mod:`attnkit.call_plan`) evaluated
        without building a :class:`Call`, as this kernel would evaluate it when selection takes
        it; None (the default) when the kernel offers no such entry or cannot be sure that
        selection would take it for these inputs, and the general call is made instead. No
        weights are asked for; the inputs' sizes, dtypes and devices are checked.

        Two options let a caller that holds its mask in another form, or keeps other semantics
        for masked keys, use the same entry (a kernel may ignore both):

        - ``additive``: ``mask`` and ``bias`` as one float tensor in the inputs' dtype: the
          bias (0 without one) where the mask allows a pair, at most the dtype's lowest value
          / 2 where it does not; given only when every query row may attend some key. A kernel
          may add it to the scores in place of applying ``mask`` and ``bias`` (still given).
        - ``keep_masked``: the caller takes the keys and values the mask hides as given (as a
          model's own attention does, which adds its mask to the scores): a kernel need not
          make them unable to reach the output, so a non-finite one may make its query rows
          non-finite.
        """
        return None

    def not_preferred_reason(self, call: Call) -> str:
        """Why automatic selection passes over this kernel for a call it supports."""
        if self.preference:
            return f"supported, but taken automatically only {self.preference}"
        return "supported, but not taken automatically for this call"

    def path(self, name: str) -> Path:
        """The path of this kernel called ``name``; an unknown name lists the kernel's paths."""
        for path in self.paths:
            if path.name == name:
                return path
        known = ", ".join(repr(p.name) for p in self.paths) or "none"
        raise ValueError(f"kernel {self.name!r} has no path {name!r} (its paths: {known})")

    def path_verdicts(self, call: Call) -> list[tuple[str, list[str]]]:
        """Each path tried for ``call`` in order, with why it does not serve it, up to and
        including the one that does (its reasons empty); empty for a kernel with one way."""
        out = []
        for path in self.paths:
            reasons = path.reasons_not_supported(call)
            out.append((path.name, reasons))
            if not reasons:
                break
        return out

    def choose_path(self, call: Call) -> Path | None:
        """The path that evaluates a call this kernel supports: the first that serves it;
        None for a kernel with one way. A kernel whose every path refuses the call raises."""
        if not self.paths:
            return None
        verdicts = self.path_verdicts(call)
        if verdicts[-1][1]:
            raise ValueError(
                f"no path of kernel {self.name!r} can evaluate this call: "
                + " | ".join(f"{name!r}: {'; '.join(why)}" for name, why in verdicts)
            )
        return self.path(verdicts[-1][0])

    def attend(self, call: Call) -> AttentionOutput:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kernel {self.name!r}>"


def head_size(call: Call) -> int:
    """The queries' and keys' features as the score compares them: the width of its dot form
    (read from the form of no rows), else d_k."""
    score, q, k = call.score, call.q, call.k
    if not score.dot_product_form:
        return k.shape[-1]
    with torch.no_grad():
        _, kp, _ = score.dot_form(None if q is None else q[..., :0, :], k[..., :0, :])
    return kp.shape[-1]


def _gradient_reasons(gradients: str, name: str, call: Call) -> list[str]:
    """Why a call needs gradients that ``gradients`` ("inputs" or "none") does not give."""
    if not torch.is_grad_enabled():
        return []
    inputs = [t for t in (call.q, call.k, call.v) if t is not None]
    others = [t for t in (call.bias,) if t is not None]
    others += [*call.score.parameters(), *call.align.parameters()]
    if isinstance(call.score_mod, torch.nn.Module):
        others += list(call.score_mod.parameters())
    if gradients == "none" and any(t.requires_grad for t in (*inputs, *others)):
        return [f"{name} gives no gradients (one is required)"]
    if gradients == "inputs" and any(t.requires_grad for t in others):
        return [
            f"{name} gives gradients for q, k and v only (the bias or a parameter of the score, "
            "alignment or score_mod requires one)"
        ]
    return []


def _listed(items) -> str:
    return ", ".join(sorted(items))


def _kernels_with(capability: str) -> str:
    """The registered kernels that declare ``capability``, in priority order, in words."""
    names = [n for n in available() if getattr(REGISTRY.get(n), capability)]
    return " or ".join(names) if names else "no registered"


def _not_streamable(align: Alignment) -> list[str]:
    if not isinstance(align, Streaming):
        return [
            f"the {type(align).__name__} alignment does not implement the streaming protocol "
            "(attnkit.alignments.streaming)"
        ]
    return align.stream_reasons()


K = TypeVar("K", bound=Kernel)


class KernelRegistry(Registry[Kernel]):
    """The shared registry, for kernels: names listed by priority (highest first), and one
    instance per registered class."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self._instances: dict[type[Kernel], Kernel] = {}
        # counts the changes to the table, so that what was resolved from it (the first
        # kernel, a layer's plan) is known to be current
        self.generation = 0
        self._first: tuple[int, str | None] = (-1, None)
        self._chosen: tuple[int, dict[str | None, Kernel]] = (-1, {})

    def register(self, name: str, *, override: bool = False) -> Callable[[type[K]], type[K]]:
        decorate = super().register(name, override=override)

        def registered(cls: type[K]) -> type[K]:
            cls = decorate(cls)
            self.generation += 1
            return cls

        return registered

    def restore(self, table: dict[str, type[Kernel]]) -> None:
        super().restore(table)
        self.generation += 1

    def available(self) -> list[str]:
        table = self._table
        return sorted(table, key=lambda name: (-table[name].priority, name))

    def first(self) -> str | None:
        """The kernel automatic selection tries first (None when none is registered), read
        again only after the table changed."""
        generation, name = self._first
        if generation != self.generation:
            names = self.available()
            name = names[0] if names else None
            self._first = (self.generation, name)
        return name

    def chosen(self, name: str | None) -> Kernel | None:
        """The instance of the kernel ``name`` or, for None, of the one automatic selection
        tries first (None when none is registered), kept until the table changes: what a
        per-call entry such as a layer's direct route looks up at every call."""
        generation, kept = self._chosen
        if generation != self.generation:
            kept = {}
            self._chosen = (self.generation, kept)
        kernel = kept.get(name)
        if kernel is None:
            resolved = name if name is not None else self.first()
            if resolved is None:
                return None
            kernel = kept[name] = get(resolved)
        return kernel

    def instance(self, name: str) -> Kernel:
        """The instance of the kernel class registered as ``name``."""
        cls = self.get(name)
        kernel = self._instances.get(cls)
        if kernel is None:
            kernel = self._instances[cls] = cls()
        return kernel

    def add(self, kernel: Kernel) -> None:
        """Register ``kernel``'s class under its ``name``, with ``kernel`` as its instance."""
        self.register(type(kernel).name)(type(kernel))
        self._instances[type(kernel)] = kernel


REGISTRY: KernelRegistry = KernelRegistry("kernel")


def register(kernel: K | type[K]) -> K | type[K]:
    """Register a kernel class (usable as a class decorator) or an instance under its ``name``.

    Registering the same definition again is silent; another class under a taken name is an
    error (see :meth:`attnkit.registry.Registry.register`)."""
    if isinstance(kernel, Kernel):
        _check_declared(type(kernel))
        REGISTRY.add(kernel)
    elif isinstance(kernel, type) and issubclass(kernel, Kernel):
        _check_declared(kernel)
        REGISTRY.register(kernel.name)(kernel)
    else:
        raise TypeError(
            f"register takes a Kernel subclass or instance, got {type(kernel).__name__}"
        )
    return kernel


def _check_declared(cls: type[Kernel]) -> None:
    for attr, kind, words in (("name", str, "a str"), ("priority", int, "an int")):
        value = getattr(cls, attr, None)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TypeError(
                f"kernel class {cls.__qualname__} must set {attr} to {words}, got {value!r}"
            )


def available() -> list[str]:
    """Registered kernel names, highest priority first."""
    return REGISTRY.available()


def get(name: str) -> Kernel:
    """The kernel registered as ``name``; unknown names fail with the options and a hint."""
    if not isinstance(name, str):
        raise TypeError(f"kernel must be a registered name (str) or None, got {name!r}")
    return REGISTRY.instance(name)


def forced_kernel(call: Call, kernel: str | None) -> str | None:
    """The kernel the caller asks for: ``kernel``, or ``"chunked"`` when the call sets
    ``chunk_size``; None for automatic selection."""
    if kernel is None and call.chunk_size is not None:
        return "chunked"
    return kernel


def select(call: Call, kernel: str | None = None) -> Kernel:
    """The kernel that evaluates ``call``: ``kernel`` when given (or ``"chunked"`` when the call
    sets ``chunk_size``), else the highest-priority kernel that supports and prefers it.

    A forced kernel that cannot evaluate the call raises ``ValueError`` with all its reasons.
    Automatic selection logs the reasons of every kernel it passed over at DEBUG level on the
    ``attnkit.kernels`` logger, and raises with every kernel's reasons when none can run."""
    forced = forced_kernel(call, kernel)
    if forced is not None:
        chosen = get(forced)
        reasons = chosen.reasons_not_supported(call)
        if reasons:
            raise ValueError(f"kernel {forced!r} cannot evaluate this call: " + "; ".join(reasons))
        return chosen
    # (kernel, its reasons; None: supported but not preferred, said only when asked)
    skipped: list[tuple[Kernel, list[str] | None]] = []
    for name in available():
        candidate = get(name)
        reasons = candidate.reasons_not_supported(call)
        if not reasons:
            if candidate.prefers(call):
                # the logger is not traced by torch.compile: log only when running eagerly
                if not torch.compiler.is_compiling() and LOG.isEnabledFor(logging.DEBUG):
                    LOG.debug("kernel %r chosen%s", name, _skipped_text(call, skipped))
                return candidate
            skipped.append((candidate, None))
        else:
            skipped.append((candidate, reasons))
    raise ValueError("no registered kernel can evaluate this call" + _skipped_text(call, skipped))


def _skipped_text(call: Call, skipped: list[tuple[Kernel, list[str] | None]]) -> str:
    if not skipped:
        return ""
    parts = []
    for kernel, reasons in skipped:
        why = reasons if reasons is not None else [kernel.not_preferred_reason(call)]
        parts.append(f"{kernel.name!r} skipped: {'; '.join(why)}")
    return " (" + " | ".join(parts) + ")"


def guarded_sum(combine: Callable[[Tensor, Tensor], Tensor], p: Tensor, v: Tensor) -> Tensor:
    """``combine(p, v)`` (Σ_l p_l v_l) in which a value with weight 0 has no influence even when it
    is NaN or infinite (a masked padding position); rows that give a non-finite value positive
    weight still get the non-finite result, as the plain sum would."""
    finite = torch.isfinite(v)
    zero = torch.zeros((), dtype=v.dtype)
    out = combine(p, torch.where(finite, v, zero))
    hit = combine((p != 0).to(p.dtype), (~finite).to(p.dtype))
    return out + torch.where(hit > 0, combine(p.detach(), v.detach()), zero)
