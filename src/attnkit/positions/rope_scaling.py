"""Rotary embeddings with partial dimensions, both feature layouts, and the context-extension
scalings of the inverse frequencies (position interpolation, NTK-aware, dynamic NTK, YaRN,
Llama 3).

RoPE (Su et al. 2021, eq. 34) rotates feature pairs of q and k by m·θ_i at position m, with
θ_i = base^{−2i/r}, i = 0 … r/2 − 1, over the first r = ⌊fraction · d⌋ features (partial
rotary, as GPT-NeoX's ``rotary_pct``; the other d − r features pass unchanged). Two layouts pair
the features differently:

- ``"interleaved"`` (Su et al.; Meta's Llama checkpoints): pair i is (x_{2i}, x_{2i+1});
- ``"halves"`` (GPT-NeoX, Hugging Face Llama): pair i is (x_i, x_{i+r/2}).

They are one rotation up to a fixed permutation of the features: with
P = :func:`interleaved_to_halves` (``[0, 2, 4, …, 1, 3, 5, …]``),
rotate_halves(x[P]) = rotate_interleaved(x)[P]. Since a permutation applied to both q and k
leaves q·k unchanged, a model trained in one layout runs in the other once the rows of its query
and key projections are permuted by P within each head (:func:`permute_heads`): this is the
permutation applied when porting Meta's Llama weights to the halves layout.

A scaling maps (r, base, sequence length) to the inverse frequencies θ_i and an attention factor
that multiplies the rotated features (so q·k by its square, YaRN's 1/t):

- :class:`LinearScaling` (Chen et al. 2023, position interpolation): θ_i / s.
- :class:`NTKScaling` (bloc97 2023, "NTK-aware"): base' = base · s^{r/(r−2)}.
- :class:`DynamicNTKScaling` (emozilla 2023): NTK with s' = s·L/L₀ − (s − 1) from the current
  length L once it exceeds the trained length L₀.
- :class:`YaRNScaling` (Peng et al. 2023, eqs. 17-22): per frequency, interpolate (θ_i / s) the
  long wavelengths, keep the short ones, ramp between; attention factor 0.1 ln s + 1.
- :class:`Llama3Scaling` (Llama 3.1): θ_i / s for wavelengths above L₀/low, θ_i below
  L₀/high, a smooth blend between.
- :class:`LongRoPEScaling` (Ding et al. 2024, LongRoPE; Phi-3): θ_i / λ_i with a searched
  rescale factor λ_i per frequency, one list up to the trained length L₀ and another past it,
  attention factor √(1 + ln s / ln L₀).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.positions.base import REGISTRY, Positioned, PositionScheme, check_qk

__all__ = [
    "DynamicNTKScaling",
    "LinearScaling",
    "Llama3Scaling",
    "LongRoPEScaling",
    "NTKScaling",
    "RopeScaling",
    "ScaledRotary",
    "YaRNScaling",
    "halves_to_interleaved",
    "interleaved_to_halves",
    "inverse_frequencies",
    "permute_heads",
    "rotate_partial",
]

LAYOUTS = ("interleaved", "halves")


def inverse_frequencies(rotary_dim: int, base: float) -> Tensor:
    """θ_i = base^{−2i/r}, i = 0 … r/2 − 1, float64 (Su et al. eq. 15)."""
    i = torch.arange(0, rotary_dim, 2, dtype=torch.float64)
    return base ** (-i / rotary_dim)


class RopeScaling:
    """A scaling of RoPE's frequencies: ``frequencies(rotary_dim, base, seq_len)`` ->
    (θ (r/2,) float64, attention factor). ``reads_length`` declares whether the frequencies
    depend on ``seq_len`` (then :attr:`ScaledRotary.reads_total_length` holds)."""

    reads_length: ClassVar[bool] = False

    def frequencies(self, rotary_dim: int, base: float, seq_len: int) -> tuple[Tensor, float]:
        raise NotImplementedError


def _factor(factor: object) -> float:
    value = arguments.finite_float(factor, "factor", positive=True)
    if value < 1:
        raise ValueError(f"factor must be >= 1 (a context extension), got {factor!r}")
    return value


@dataclass(frozen=True)
class LinearScaling(RopeScaling):
    """Position interpolation (Chen et al. 2023, eq. 4): position m is read as m / s, i.e.
    θ_i ↦ θ_i / s."""

    factor: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", _factor(self.factor))

    def frequencies(self, rotary_dim: int, base: float, seq_len: int) -> tuple[Tensor, float]:
        return inverse_frequencies(rotary_dim, base) / self.factor, 1.0


@dataclass(frozen=True)
class NTKScaling(RopeScaling):
    """NTK-aware scaling: base' = base · s^{r/(r−2)}, so that the lowest frequency is
    interpolated by s and the highest is kept."""

    factor: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", _factor(self.factor))

    def frequencies(self, rotary_dim: int, base: float, seq_len: int) -> tuple[Tensor, float]:
        scaled = base * self.factor ** (rotary_dim / (rotary_dim - 2))
        return inverse_frequencies(rotary_dim, scaled), 1.0


@dataclass(frozen=True)
class DynamicNTKScaling(RopeScaling):
    """Dynamic NTK: for a sequence of length L > L₀ = ``max_len``, NTK scaling with
    base' = base · (s·L/L₀ − (s − 1))^{r/(r−2)}; unchanged RoPE up to L₀."""

    factor: float
    max_len: int
    reads_length: ClassVar[bool] = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", _factor(self.factor))
        arguments.positive_int(self.max_len, "max_len")

    def frequencies(self, rotary_dim: int, base: float, seq_len: int) -> tuple[Tensor, float]:
        length = max(seq_len, self.max_len)
        ratio = self.factor * length / self.max_len - (self.factor - 1)
        return inverse_frequencies(rotary_dim, base * ratio ** (rotary_dim / (rotary_dim - 2))), 1.0


@dataclass(frozen=True)
class YaRNScaling(RopeScaling):
    """YaRN (Peng et al. 2023, sec. 3.2-3.4). The wavelength λ_i = 2π/θ_i turns r_i = L₀/λ_i
    times over the trained length L₀ = ``original_max_len``; with the ramp
    γ(r) = 0 for r < α = ``beta_slow``, 1 for r > β = ``beta_fast``, linear between (eq. 18),

        θ'_i = (1 − γ(r_i)) θ_i / s + γ(r_i) θ_i                              (eq. 19)

    and the attention scaled by √(1/t) = 0.1 ln s + 1 (eq. 22), applied to the rotated q and k.
    The ramp is laid over the dimension index: i_low/high = r ln(L₀/(2π β_{fast/slow})) /
    (2 ln base), rounded outwards when ``truncate`` (as the reference code).
    """

    factor: float
    original_max_len: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", _factor(self.factor))
        arguments.positive_int(self.original_max_len, "original_max_len")
        arguments.finite_float(self.beta_fast, "beta_fast", positive=True)
        arguments.finite_float(self.beta_slow, "beta_slow", positive=True)
        if not self.beta_fast > self.beta_slow:
            raise ValueError(
                f"beta_fast must be > beta_slow (the ramp γ(r) rises from r = beta_slow to r = "
                f"beta_fast, eq. 18), got beta_fast={self.beta_fast!r}, "
                f"beta_slow={self.beta_slow!r}"
            )
        arguments.boolean(self.truncate, "truncate")

    def _dimension(self, rotations: float, rotary_dim: int, base: float) -> float:
        return (
            rotary_dim
            * math.log(self.original_max_len / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    def frequencies(self, rotary_dim: int, base: float, seq_len: int) -> tuple[Tensor, float]:
        theta = inverse_frequencies(rotary_dim, base)
        low = self._dimension(self.beta_fast, rotary_dim, base)
        high = self._dimension(self.beta_slow, rotary_dim, base)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # a step, not a division by zero
        ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(
            0, 1
        )  # 0: keep θ_i (many rotations), 1: interpolate
        keep = 1 - ramp
        scaled = theta / self.factor * (1 - keep) + theta * keep
        factor = self.attention_factor
        if factor is None:
            factor = 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0
        return scaled, float(factor)


@dataclass(frozen=True)
class Llama3Scaling(RopeScaling):
    """Llama 3.1's frequency-dependent scaling: with L₀ = ``original_max_len`` and wavelength
    λ_i = 2π/θ_i, θ'_i = θ_i / s for λ_i > L₀/low, θ_i for λ_i < L₀/high, and otherwise
    (1 − σ) θ_i / s + σ θ_i with σ = (L₀/λ_i − low)/(high − low)."""

    factor: float = 8.0
    original_max_len: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "factor", _factor(self.factor))
        arguments.positive_int(self.original_max_len, "original_max_len")
        low = arguments.finite_float(self.low_freq_factor, "low_freq_factor", positive=True)
        high = arguments.finite_float(self.high_freq_factor, "high_freq_factor", positive=True)
        if not high > low:
            raise ValueError(f"high_freq_factor must exceed low_freq_factor, got {high} <= {low}")

    def frequencies(self, rotary_dim: int, base: float, seq_len: int) -> tuple[Tensor, float]:
        theta = inverse_frequencies(rotary_dim, base)
        wavelength = 2 * math.pi / theta
        long = wavelength > self.original_max_len / self.low_freq_factor
        short = wavelength < self.original_max_len / self.high_freq_factor
        smooth = (self.original_max_len / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blend = (1 - smooth) * theta / self.factor + smooth * theta
        return torch.where(long, theta / self.factor, torch.where(short, theta, blend)), 1.0


@dataclass(frozen=True)
class LongRoPEScaling(RopeScaling):
    """LongRoPE (Ding et al. 2024, "LongRoPE: Extending LLM Context Window Beyond 2 Million
    Tokens", sec. 2-3), as Phi-3 ships it: every frequency has its own rescale factor λ_i, found
    by the paper's evolutionary search, and θ'_i = θ_i / λ_i (eq. 6 with the factors
    1/λ_i). Two lists are kept: ``short_factor`` for sequences up to the trained length
    L₀ = ``original_max_len`` and ``long_factor`` past it, so the frequencies switch with the
    sequence length (the scaling reads the length, as dynamic NTK does, and a KV cache is
    refused) unless the two lists are equal. The rotated q and k are scaled by the attention
    factor √(1 + ln s / ln L₀) for the extension s = ``factor`` > 1 (1 for s = 1), or by
    ``attention_factor`` when given.

    Args:
        short_factor: λ_i for i = 0 … r/2 − 1, used while the length is at most L₀.
        long_factor: λ_i used past L₀.
        original_max_len: L₀, the pretrained context length.
        factor: s, the extended context length over L₀ (Phi-3: max_position_embeddings /
            original_max_position_embeddings).
        attention_factor: overrides √(1 + ln s / ln L₀).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_len: int
    factor: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            given = getattr(self, name)
            if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
                raise TypeError(f"{name} must be a sequence of numbers, got {given!r:.60}")
            values = tuple(
                arguments.finite_float(x, f"{name}[{i}]", positive=True)
                for i, x in enumerate(given)
            )
            if not values:
                raise ValueError(f"{name} must hold one factor per frequency, got none")
            object.__setattr__(self, name, values)
        if len(self.short_factor) != len(self.long_factor):
            raise ValueError(
                f"short_factor and long_factor need one factor per frequency each, got "
                f"{len(self.short_factor)} and {len(self.long_factor)}"
            )
        arguments.positive_int(self.original_max_len, "original_max_len")
        object.__setattr__(self, "factor", _factor(self.factor))
        if self.attention_factor is not None:
            value = arguments.finite_float(self.attention_factor, "attention_factor", positive=True)
            object.__setattr__(self, "attention_factor", value)

    @property
    def reads_length(self) -> bool:  # type: ignore[override]
        """The frequencies switch lists at L₀ unless the two lists are equal."""
        return self.short_factor != self.long_factor

    def frequencies(self, rotary_dim: int, base: float, seq_len: int) -> tuple[Tensor, float]:
        if len(self.short_factor) != rotary_dim // 2:
            raise ValueError(
                f"LongRoPE has {len(self.short_factor)} rescale factors per list but rotates "
                f"r = {rotary_dim} features, which need r/2 = {rotary_dim // 2}"
            )
        chosen = self.long_factor if seq_len > self.original_max_len else self.short_factor
        scale = torch.tensor(chosen, dtype=torch.float64)
        factor = self.attention_factor
        if factor is None:
            factor = (
                math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_len))
                if self.factor > 1 and self.original_max_len > 1
                else 1.0
            )
        return inverse_frequencies(rotary_dim, base) / scale, float(factor)


# ---- layouts ---------------------------------------------------------------------------------


def interleaved_to_halves(rotary_dim: int) -> Tensor:
    """P = [0, 2, 4, …, 1, 3, 5, …]: x_halves = x_interleaved[..., P] (the first ``rotary_dim``
    features; see the module docstring)."""
    rotary_dim = _even(rotary_dim)
    return torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)])


def halves_to_interleaved(rotary_dim: int) -> Tensor:
    """The inverse permutation of :func:`interleaved_to_halves`."""
    return torch.argsort(interleaved_to_halves(rotary_dim))


def permute_heads(weight: Tensor, num_heads: int, rotary_dim: int | None = None) -> Tensor:
    """Rows of a query or key projection (H·d, in) reordered within each head by
    :func:`interleaved_to_halves` over the first ``rotary_dim`` (default d) features: the
    weights of an interleaved-layout model for the halves layout (porting Llama checkpoints)."""
    num_heads = arguments.positive_int(num_heads, "num_heads")
    if not isinstance(weight, Tensor) or weight.dim() < 1 or weight.shape[0] % num_heads:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight needs H·d = {num_heads}·d rows, got {shape}")
    d = weight.shape[0] // num_heads
    r = d if rotary_dim is None else _even(rotary_dim)
    if r > d:
        raise ValueError(f"rotary_dim {r} exceeds the head size {d}")
    order = torch.cat([interleaved_to_halves(r), torch.arange(r, d)])
    return weight.unflatten(0, (num_heads, d))[:, order].flatten(0, 1)


def _even(rotary_dim: object) -> int:
    r = arguments.positive_int(rotary_dim, "rotary_dim")
    if r % 2:
        raise ValueError(f"rotary_dim must be even (feature pairs), got {r}")
    return r


def rotate_partial(
    x: Tensor,
    positions: Tensor,
    theta: Tensor,
    *,
    layout: str = "interleaved",
    attention_factor: float = 1.0,
) -> Tensor:
    """Rotate the first r = 2·len(θ) features of x (…, L, d) at ``positions`` (L,) by
    positions·θ_i in the given layout, scale them by ``attention_factor``; the other d − r
    features pass unchanged."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    cos, sin = _cos_sin(positions, theta, attention_factor, x.dtype)
    return _rotate(x, cos, sin, layout)


# Positions up to which ScaledRotary keeps a table of its angles (beyond: formed per call).
_TABLE_LIMIT = 1 << 16


def _cos_sin(
    positions: Tensor, theta: Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """factor·cos(p·θ_i) and factor·sin(p·θ_i), (L, r/2), formed in float64, given in dtype."""
    angle = positions.to(torch.float64)[:, None] * theta.to(torch.float64, copy=False)
    return (angle.cos() * attention_factor).to(dtype), (angle.sin() * attention_factor).to(dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, layout: str) -> Tensor:
    """The first r = 2·cos.shape[-1] features of x (…, L, d) rotated by the angles of
    :func:`_cos_sin`, the others unchanged."""
    r = 2 * cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if layout == "interleaved":
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return torch.cat((out, rest), dim=-1)


@REGISTRY.register("rope_scaled")
class ScaledRotary(PositionScheme):
    """RoPE over a fraction of each head's features, in either layout, with a scaling of its
    frequencies (module docstring). ``ScaledRotary()`` is :class:`attnkit.positions.Rotary`.

    Args:
        base: 10000 in RoFormer (500000 in Llama 3).
        fraction: share of the head's features rotated, r = ⌊fraction·d⌋ (even).
        layout: ``"interleaved"`` or ``"halves"``.
        scaling: a :class:`RopeScaling` or None. The sequence length a dynamic scaling reads is
            max(q_offset + M, k_offset + N).
    """

    def __init__(
        self,
        base: float = 10000.0,
        *,
        fraction: float = 1.0,
        layout: str = "interleaved",
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        self.base = arguments.finite_float(base, "base")
        if not self.base > 1:
            raise ValueError(f"base must be > 1, got {base}")
        self.fraction = arguments.finite_float(fraction, "fraction", positive=True)
        if self.fraction > 1:
            raise ValueError(f"fraction must lie in (0, 1], got {fraction}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(
                f"scaling must be an attnkit.positions.rope_scaling.RopeScaling or None, got "
                f"{type(scaling).__name__}"
            )
        self.layout = layout
        self.scaling = scaling

    per_token = True  # each vector rotated by its own position (at the sequence's length)
    same_for_every_head = True  # (the frequencies are the same for every head)
    bias_of_positions = True  # (no bias)

    def transform_at(self, x: Tensor, positions: Tensor, total: int) -> Tensor:
        theta, factor = self.frequencies(x.shape[-1], total)
        return rotate_partial(
            x, positions, theta.to(x.device), layout=self.layout, attention_factor=factor
        )

    @property
    def reads_total_length(self) -> bool:  # type: ignore[override]
        """Whether the scaling reads the sequence length (dynamic NTK does)."""
        return self.scaling is not None and self.scaling.reads_length

    @property
    def translation_invariant(self) -> bool:  # type: ignore[override]
        """A rotation by position reads only i − j, unless the frequencies follow the length."""
        return not self.reads_total_length

    def rotary_dim(self, head_dim: int) -> int:
        """r = ⌊fraction · d⌋; raises unless it is even and ≥ 2."""
        r = int(head_dim * self.fraction)
        if r < 2 or r % 2:
            raise ValueError(
                f"rope_scaled rotates r = int(fraction * d) = int({self.fraction} * {head_dim}) "
                f"= {r} features, which must be even and >= 2"
            )
        return r

    def frequencies(self, head_dim: int, seq_len: int) -> tuple[Tensor, float]:
        """θ (r/2,) float64 and the attention factor for heads of size d at this length."""
        r = self.rotary_dim(head_dim)
        if self.scaling is None:
            return inverse_frequencies(r, self.base), 1.0
        return self.scaling.frequencies(r, self.base, seq_len)

    def _frequencies_on(
        self, head_dim: int, seq_len: int, device: torch.device
    ) -> tuple[Tensor, float]:
        """:meth:`frequencies` on ``device``; without a scaling, made once per head size,
        base and fraction (every decoding step asks again)."""
        if self.scaling is not None:
            theta, factor = self.frequencies(head_dim, seq_len)
            return theta.to(device), factor
        key = (head_dim, self.base, self.fraction, device)
        kept = self.__dict__.get("_kept_frequencies")
        if kept is None or kept[0] != key:
            theta, factor = self.frequencies(head_dim, seq_len)
            kept = self.__dict__["_kept_frequencies"] = (key, theta.to(device), factor)
        return kept[1], kept[2]

    def _angles(
        self, head_dim: int, start: int, length: int, total: int, device: torch.device, dtype
    ) -> tuple[Tensor, Tensor]:
        """:func:`_cos_sin` at positions start … start + length − 1. Without a scaling, read
        from a table of the positions below a power of two, made when a later position is
        first asked for (each decoding step would otherwise form its angles again); the table
        holds the same values, formed the same way."""
        theta, factor = self._frequencies_on(head_dim, total, device)
        end = start + length
        if self.scaling is not None or end > _TABLE_LIMIT:
            positions = torch.arange(start, end, device=device)
            return _cos_sin(positions, theta, factor, dtype)
        key = (head_dim, self.base, self.fraction, device, dtype)
        kept = self.__dict__.get("_kept_angles")
        if kept is None or kept[0] != key or kept[1].shape[0] < end:
            size = max(64, 1 << (end - 1).bit_length())
            positions = torch.arange(size, device=device)
            kept = self.__dict__["_kept_angles"] = (key, *_cos_sin(positions, theta, factor, dtype))
        return kept[1][start:end], kept[2][start:end]

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_qk(q, k, "rope_scaled", q_offset=q_offset, k_offset=k_offset)
        m, n = q.shape[-2], k.shape[-2]
        total, d = max(q_offset + m, k_offset + n), q.shape[-1]
        cos, sin = self._angles(d, q_offset, m, total, q.device, q.dtype)
        if (k_offset, n) != (q_offset, m):  # (the keys of self-attention share the angles)
            k_cos, k_sin = self._angles(d, k_offset, n, total, k.device, k.dtype)
        else:
            k_cos, k_sin = cos, sin
        return Positioned(_rotate(q, cos, sin, self.layout), _rotate(k, k_cos, k_sin, self.layout))

    def extra_repr(self) -> str:
        return (
            f"base={self.base:g}, fraction={self.fraction:g}, layout={self.layout!r}, "
            f"scaling={self.scaling!r}"
        )
