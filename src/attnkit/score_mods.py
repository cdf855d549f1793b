"""score_mods that declare their form: ``score_mod(e, b, h, q_idx, kv_idx) -> e'`` (as in
FlexAttention) built from typed constructors, so that a kernel reads what the function is
instead of guessing it.

- :func:`relative` — ``e + f(h, q_idx − kv_idx)``: a per-head bias that depends on the query and
  key positions only through their distance (Shaw et al.'s relative positions as a bias);
- :func:`alibi` — ALiBi's linear bias ``e − m_h · (q_idx − kv_idx)`` (Press et al. 2022), one
  slope per head;
- :func:`bias_table` — ``e + T[h, clamp(q_idx − kv_idx)]``: a per-head table over distances
  (T5's buckets written out as a table, distances beyond its reach clamped to its ends);
- :func:`additive` — ``e + f(b, h, q_idx, kv_idx)``: any bias of the positions;
- :func:`softcap` — ``c · tanh(e / c)`` (Gemma 2's logit soft cap);
- :func:`compose` — several, applied in order (``compose(alibi(8), softcap(30))``).

Each is an ``nn.Module`` (a table or slopes given as ``nn.Parameter`` are trained) and
:class:`Declared`: its :meth:`Declared.form` says whether it is additive (``e + f`` with f
independent of e) and relative (f a function of the head and q_idx − kv_idx alone). The chunked
kernel's fused block-sparse path takes an additive score_mod as an additive mask, and evaluates
a relative one once per distance instead of once per tile. A plain function still works
everywhere: its form is then read from its traced graph
(:mod:`attnkit.kernels.chunked.forms`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "OTHER",
    "Declared",
    "Form",
    "additive",
    "alibi",
    "bias_table",
    "compose",
    "relative",
    "shifted",
    "softcap",
]


@dataclass(frozen=True)
class Form:
    """What a score_mod is: ``additive``, ``e + f(b, h, q_idx, kv_idx)`` with f independent of
    e; ``relative``, additive with f a function of h and q_idx − kv_idx alone."""

    additive: bool
    relative: bool

    def __post_init__(self) -> None:
        if self.relative and not self.additive:
            raise ValueError("a relative form is additive: Form(additive=True, relative=True)")


OTHER = Form(additive=False, relative=False)


class Declared(nn.Module):
    """A score_mod that declares its :class:`Form` (None: not known, e.g. a composition holding
    a plain function; the kernels then read the function itself)."""

    def form(self) -> Form | None:
        raise NotImplementedError

    def forward(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError


def _callable(fn: object, name: str) -> None:
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


class Additive(Declared):
    """``e + fn(b, h, q_idx, kv_idx)``."""

    def __init__(self, fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        _callable(fn, "fn")
        self.fn = fn

    def form(self) -> Form:
        return Form(additive=True, relative=False)

    def forward(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return e + self.fn(b, h, q_idx, kv_idx).to(e.dtype)


class Relative(Declared):
    """``e + bias(h, q_idx − kv_idx)``; subclasses give :meth:`bias`."""

    def form(self) -> Form:
        return Form(additive=True, relative=True)

    def bias(self, h: Tensor, distance: Tensor, dtype: torch.dtype) -> Tensor:
        """The bias of heads h at distances q_idx − kv_idx (broadcast tensors), in ``dtype``."""
        raise NotImplementedError

    def forward(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return e + self.bias(h, q_idx - kv_idx, e.dtype)


class _RelativeFunction(Relative):
    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        super().__init__()
        _callable(fn, "fn")
        self.fn = fn

    def bias(self, h: Tensor, distance: Tensor, dtype: torch.dtype) -> Tensor:
        return self.fn(h, distance).to(dtype)


class ALiBi(Relative):
    """``e − m_h · (q_idx − kv_idx)`` (or ``e − m_h · |q_idx − kv_idx|``, ``symmetric``)."""

    def __init__(self, slopes: Tensor, symmetric: bool) -> None:
        super().__init__()
        if isinstance(slopes, nn.Parameter):
            self.slopes = slopes
        else:
            self.register_buffer("slopes", slopes)
        self.symmetric = symmetric

    def bias(self, h: Tensor, distance: Tensor, dtype: torch.dtype) -> Tensor:
        d = distance.abs() if self.symmetric else distance
        return -self.slopes.to(dtype)[h] * d.to(dtype)

    def extra_repr(self) -> str:
        return f"heads={self.slopes.numel()}, symmetric={self.symmetric}"


class BiasTable(Relative):
    """``e + table[h, reach + clamp(q_idx − kv_idx, −reach, reach)]``."""

    def __init__(self, table: Tensor) -> None:
        super().__init__()
        if isinstance(table, nn.Parameter):
            self.table = table
        else:
            self.register_buffer("table", table)
        self.reach = (table.shape[-1] - 1) // 2

    def bias(self, h: Tensor, distance: Tensor, dtype: torch.dtype) -> Tensor:
        at = distance.clamp(-self.reach, self.reach) + self.reach
        return self.table.to(dtype)[h, at]

    def extra_repr(self) -> str:
        return f"heads={self.table.shape[0]}, reach={self.reach}"


class Softcap(Declared):
    """``cap · tanh(e / cap)``."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def form(self) -> Form:
        return OTHER

    def forward(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.cap * torch.tanh(e / self.cap)

    def extra_repr(self) -> str:
        return f"cap={self.cap}"


class Composed(Declared):
    """The score_mods in order: ``last(…(first(e, …), …), …)``."""

    def __init__(self, mods: Sequence[Callable]) -> None:
        super().__init__()
        for i, mod in enumerate(mods):
            _callable(mod, f"compose's argument {i}")
        self.mods = list(mods)
        # the nn.Module ones registered, so that their parameters are the composition's
        self.parts = nn.ModuleList([m for m in mods if isinstance(m, nn.Module)])

    def form(self) -> Form | None:
        forms = [m.form() if isinstance(m, Declared) else None for m in self.mods]
        if any(f is None for f in forms):
            return None
        return Form(
            additive=all(f.additive for f in forms), relative=all(f.relative for f in forms)
        )

    def forward(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        for mod in self.mods:
            e = mod(e, b, h, q_idx, kv_idx)
        return e


class Shifted(Declared):
    """``inner`` with q_idx moved by ``offset`` (the queries of a decoding step sit after the
    cached positions): its form is the inner one's (a shift keeps a function of
    q_idx − kv_idx one)."""

    def __init__(self, inner: Callable, offset: int) -> None:
        super().__init__()
        _callable(inner, "inner")
        self.inner = inner
        self.offset = offset

    def form(self) -> Form | None:
        return self.inner.form() if isinstance(self.inner, Declared) else None

    def forward(self, e: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.inner(e, b, h, q_idx + self.offset, kv_idx)


def additive(fn: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Declared:
    """``e + fn(b, h, q_idx, kv_idx)``: a bias of the batch entry, the head and the positions
    (broadcast index tensors), independent of the scores."""
    return Additive(fn)


def relative(fn: Callable[[Tensor, Tensor], Tensor]) -> Declared:
    """``e + fn(h, q_idx − kv_idx)``: a per-head bias of the distance between query and key
    (broadcast tensors h and q_idx − kv_idx)."""
    return _RelativeFunction(fn)


def alibi(slopes: int | Sequence[float] | Tensor, *, symmetric: bool = False) -> Declared:
    """ALiBi (Press et al. 2022): ``e − m_h · (q_idx − kv_idx)`` for head h, as FlexAttention's
    documentation writes it (under a causal mask, the paper's bias); with ``symmetric``,
    ``e − m_h · |q_idx − kv_idx|`` (:class:`attnkit.positions.ALiBi`'s).

    Args:
        slopes: the number of heads H (the paper's geometric slopes,
            :func:`attnkit.positions.alibi_slopes`), or the slopes m_h themselves (a sequence or
            a 1-d tensor; an ``nn.Parameter`` is trained).
        symmetric: penalise the distance in both directions.
    """
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool, got {symmetric!r}")
    if isinstance(slopes, bool):
        raise TypeError(f"slopes must be a number of heads or the slopes, got {slopes!r}")
    if isinstance(slopes, int):
        if slopes < 1:
            raise ValueError(f"alibi needs a number of heads >= 1, got {slopes}")
        slopes = _geometric_slopes(slopes)
    if not isinstance(slopes, Tensor):
        try:
            slopes = torch.tensor([float(s) for s in slopes])
        except (TypeError, ValueError):
            raise TypeError(
                f"slopes must be a number of heads, a sequence of floats or a tensor, got "
                f"{slopes!r:.60}"
            ) from None
    if slopes.dim() != 1 or slopes.numel() == 0 or not slopes.is_floating_point():
        raise ValueError(
            f"slopes must be a non-empty 1-d floating tensor (one per head), got "
            f"{slopes.dtype} of shape {tuple(slopes.shape)}"
        )
    return ALiBi(slopes, symmetric)


def _geometric_slopes(num_heads: int) -> Tensor:
    """Press et al. 3: 2^(−8/H), 2^(−16/H), … for H a power of two; otherwise the slopes of the
    closest smaller power of two c, then every other slope of 2c."""

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]

    c = 2 ** math.floor(math.log2(num_heads))
    return torch.tensor(geometric(c) + geometric(2 * c)[0::2][: num_heads - c])


def bias_table(table: Tensor) -> Declared:
    """``e + table[h, R + clamp(q_idx − kv_idx, −R, R)]``: a per-head table over the distances
    −R … R, those beyond clamped to its ends (T5's relative buckets, Raffel et al. 2020, written
    out per distance: their last bucket covers every distance past ``max_distance``).

    Args:
        table: (H, 2R + 1), entry R + d for distance d = q_idx − kv_idx (an ``nn.Parameter``
            is trained).
    """
    if not isinstance(table, Tensor):
        raise TypeError(f"table must be a tensor (H, 2R + 1), got {type(table).__name__}")
    if table.dim() != 2 or table.shape[-1] % 2 == 0 or not table.is_floating_point():
        raise ValueError(
            f"table must be a floating tensor (H, 2R + 1) over the distances −R … R, got "
            f"{table.dtype} of shape {tuple(table.shape)}"
        )
    return BiasTable(table)


def softcap(cap: float) -> Declared:
    """``cap · tanh(e / cap)``: scores squashed into (−cap, cap) (Gemma 2)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < math.inf:
        raise ValueError(f"cap must be a positive finite number, got {cap!r}")
    return Softcap(float(cap))


def compose(*mods: Callable) -> Declared:
    """The score_mods applied in order. Additive (relative) when every one is; its form is
    unknown (read from the function) when one is a plain function."""
    if not mods:
        raise ValueError("compose needs at least one score_mod")
    return Composed(mods)


def shifted(mod: Callable, offset: int) -> Declared:
    """``mod`` with q_idx counted from ``offset`` (queries after ``offset`` cached positions)."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {offset!r}")
    return Shifted(mod, offset)
