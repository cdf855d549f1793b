"""What the gated linear-attention parts share: the per-head part (validation, padding, the
choice of form, decoding from a constant-size state), its alignment and the recurrent cache.

Every part of the family is causal self-attention whose whole past is one state S per head,
S (…, d_k, d_v), updated once per position. That gives three forms that agree — parallel
(quadratic, the "attention" view), chunkwise (training) and recurrent (decoding) — and a decoder
that keeps S instead of the keys and values: :class:`RecurrentCache`, a drop-in
:class:`attnkit.kv_cache.LayerCache` whose size does not grow with the length.

Padding: a key padding mask removes a position entirely (it neither writes into the state nor
decays it), so key padding equals truncation; in causal self-attention a padded position is
padding as a query too, and its row is 0. A mask (…, M, N) is honoured when, within the causal
triangle, it is key padding (any causal mask ∧ key padding, e.g. a decoder's); a mask that
varies over queries otherwise (a window) is refused with a ValueError.
"""

from __future__ import annotations

import weakref
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, hooks, masks
from attnkit import taxonomy as tx
from attnkit.alignments.base import Alignment, AlignOutput
from attnkit.head import HeadAttention
from attnkit.inputs import broadcast_shapes
from attnkit.kv_cache import KVCache, LayerCache
from attnkit.linear_family import decay
from attnkit.linear_family.decay import tril
from attnkit.output import AttentionOutput

__all__ = [
    "FORMS",
    "Inputs",
    "LinearFamilyPart",
    "RecurrentCache",
    "UnnormalizedWeights",
    "recurrent_cache",
]

FORMS = ("chunkwise", "parallel", "recurrent")


class UnnormalizedWeights(Alignment):
    """The alignment of linear attention without a feature map: the weights are the (decayed)
    scores themselves, a_ij = e_ij on the keys a query may attend and 0 elsewhere — neither
    normalised nor non-negative (Dao and Gu 2024: the "attention" of an SSM is the masked
    matrix L ∘ CBᵀ)."""

    label = tx.AlignmentKind.SOFT
    normalized = False

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        if mask is None:
            return AlignOutput(scores)
        return AlignOutput(torch.where(mask, scores, torch.zeros((), dtype=scores.dtype)))


class Inputs(NamedTuple):
    """A head's per-position inputs to the kernels: q (…, N, d_k) scaled, k (…, N, d_k),
    v (…, N, d_v), the log-decay g (…, N, 1) or (…, N, d_k) (≤ 0), and for the delta rule the
    writing strength β (…, N, 1) (None otherwise)."""

    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    beta: Tensor | None = None


class RecurrentCache(LayerCache):
    """The decoding state of one layer of a gated linear-attention part: the state S
    (B, …, H, d_k, d_v) after the positions seen so far — constant in size, unlike the keys and
    values of a :class:`attnkit.kv_cache.LayerCache`, which it replaces in
    ``MultiHeadAttention(..., cache=...)``. ``len(cache)`` counts the positions seen.

    Only a part that declares ``takes_cache`` (the parts of :mod:`attnkit.linear_family`) reads
    it; a layer holding another part refuses it when it first claims the cache.
    """

    # positions are folded into the state
    keeps_every_position: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.state: Tensor | None = None
        self._seen = 0
        self._part: weakref.ref[nn.Module] | None = None

    def read(self, part: nn.Module, lead: tuple[int, ...]) -> Tensor | None:
        """The state to continue from for ``part``, whose inputs have the leading dims ``lead``
        (B, …, H); None before the first step. Raises ValueError when another part wrote the
        state (a state belongs to the part that made it, also when parts are called directly,
        without a layer claiming the cache) or when it was made for other leading dims (another
        batch size)."""
        if self._part is not None and self._part() is not part:
            raise ValueError(
                f"this RecurrentCache holds the state of another part, not of "
                f"{type(part).__name__}: give every part its own cache"
            )
        if self.state is not None and tuple(self.state.shape[: len(lead)]) != tuple(lead):
            raise ValueError(
                f"this RecurrentCache holds a state for inputs (B, …, H) = "
                f"{tuple(self.state.shape[:-2])}, but the step has {tuple(lead)} (another batch "
                "size?): start a new cache for a new batch"
            )
        return self.state

    def __len__(self) -> int:
        """The number of positions seen (the position of the next token)."""
        return self._seen

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep nothing: the new keys and values go to the part, which folds them into the
        state (:meth:`advance`)."""
        return k, v

    def advance(self, state: Tensor, positions: int, part: nn.Module | None = None) -> None:
        """Store the state after ``positions`` more positions, made by ``part``."""
        self.state = state
        self._seen += positions
        if part is not None and self._part is None:
            self._part = weakref.ref(part)

    def check_part(self, part: HeadAttention | None, layer: nn.Module) -> None:
        """Refuse a part that does not declare ``decodes_with_cache`` (see
        :meth:`attnkit.kv_cache.LayerCache.check_part`) or does not read this state
        (``takes_cache``)."""
        super().check_part(part, layer)
        if part is None or not part.takes_cache:
            what = "no attention part" if part is None else f"{type(part).__name__}, a part"
            raise ValueError(
                f"a RecurrentCache holds the state of a gated linear-attention part, not keys "
                f"and values; {type(layer).__name__} holds {what} that does not declare "
                "takes_cache = True (it does not read the state): use attnkit.kv_cache.LayerCache"
            )

    @property
    def nbytes(self) -> int:
        """Bytes held by the state (and a cross-attention's projected memory)."""
        own = 0 if self.state is None else self.state.numel() * self.state.element_size()
        return own + self.memory.nbytes


def recurrent_cache(layers: int) -> KVCache:
    """A :class:`attnkit.kv_cache.KVCache` of ``layers`` :class:`RecurrentCache` slots, for a
    decoder stack whose self-attention parts belong to this family."""
    cache = KVCache(layers)
    cache.layers = [RecurrentCache() for _ in range(layers)]
    return cache


def _key_padding(mask: Tensor, n: int, who: str) -> tuple[Tensor, Tensor | None]:
    """``mask`` (…, N or 1, N) as (keep (…, N): the positions that exist, empty (…, N) or None:
    query rows that may attend nothing under causality); ValueError when the mask varies over
    queries within the causal triangle other than by key padding."""
    if mask.shape[-2] == 1 or n == 1:
        keep = mask[..., -1, :]
        return keep.expand(*keep.shape[:-1], n), None
    below = tril(n, mask.device)
    seen = mask & below
    keep = seen.any(-2)  # a key some query at or after it may attend
    empty = ~seen.any(-1)
    if not bool(((seen == (keep.unsqueeze(-2) & below)) | empty.unsqueeze(-1)).all()):
        raise ValueError(
            f"{who}: the mask (shape {tuple(mask.shape)}) varies over queries other than by key "
            "padding within the causal triangle; a recurrent state holds every earlier key, so "
            "only key padding (…, 1, N), a causal mask or both combined are honoured"
        )
    return keep, empty


def _zero(x: Tensor, keep: Tensor | None) -> Tensor:
    if keep is None:
        return x
    return torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


class LinearFamilyPart(HeadAttention):
    """The base of the gated linear-attention parts: ``part(q, k, v, *, mask, bias,
    need_weights, q_offset, cache)`` with q, k (B, …, H, N, d), v (B, …, H, N, d_v) →
    :class:`attnkit.AttentionOutput` with context (B, …, H, N, d_v).

    A subclass says how a head turns q, k, v into the kernels' :class:`Inputs` (:meth:`prepare`),
    which kernels run them (:meth:`run`, :meth:`dense_weights`), and what follows the state read
    (:meth:`finish`: a norm, a skip).

    Args:
        head_dim: d, the size of q and k per head.
        num_heads: H (the parameters and decays are per head; inputs have H at dim −3).
        form: ``"chunkwise"`` (default), ``"parallel"`` or ``"recurrent"`` — equal results.
        chunk_size: positions per chunk of the chunkwise form.

    The weights (``need_weights=True`` or a capture) are the parallel form's matrix W with
    context = W v before :meth:`finish`: signed and unnormalised (``signed_weights``). With a
    :class:`RecurrentCache` the keys are gone, so no weights are reported and asking for them
    is refused.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal"})

    causal: ClassVar[bool] = True
    decodes_with_cache: ClassVar[bool] = True  # a step from the state equals its causal rows
    takes_q_offset: ClassVar[bool] = True
    takes_cache: ClassVar[bool] = True  # reads and updates a RecurrentCache
    signed_weights: ClassVar[bool] = True
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("q", "k", "v")}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        *,
        form: str = "chunkwise",
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        if form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
        self.form = form
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        self.align = UnnormalizedWeights()

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_heads={self.num_heads}, form={self.form!r}, "
            f"chunk_size={self.chunk_size}"
        )

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.SOFT]

    @classmethod
    def example(cls):
        from attnkit.mechanisms import example_tensor

        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (1, 2, 3))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(4, 2, chunk_size=3), (q, k, v), {"mask": mask}

    # What a subclass provides.

    def prepare(self, q: Tensor, k: Tensor, v: Tensor) -> Inputs:
        """The kernels' inputs from a head's q, k, v (padding already zero)."""
        raise NotImplementedError

    def run(self, x: Inputs, form: str, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(o (…, N, d_v), the last state or None) by ``form`` from ``state``."""
        raise NotImplementedError

    def dense_weights(self, x: Inputs) -> Tensor:
        """W (…, N, N) with the output before :meth:`finish` equal to W v."""
        raise NotImplementedError

    def finish(self, out: Tensor, x: Inputs) -> Tensor:
        """What follows reading the state (identity here)."""
        return out

    # The template's holes (attnkit.head.HeadAttention.forward validates, refuses a bias by
    # capability, hides the keys no query attends and reports the weights).

    def state_positions(self, cache: object) -> int:
        """The positions a :class:`RecurrentCache` has folded into its state (0 for any other
        cache, whose keys the layer gives with the new ones)."""
        return len(cache) if isinstance(cache, RecurrentCache) else 0

    def declared_mask(self, mask: Tensor | None, m: int, who: str) -> Tensor | None:
        """The mask as given: the part is causal by construction and reads a mask only within
        the causal triangle, where :meth:`attend` refuses one that is not key padding."""
        return mask

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        q_offset: int = 0,
        cache: LayerCache | None = None,
    ) -> AttentionOutput:
        """Causal self-attention of the N positions of q, k, v after ``q_offset`` earlier ones:
        given as keys too (k, v hold all ``q_offset`` + M), or folded into the state of a
        :class:`RecurrentCache` (k, v hold the M new ones)."""
        who = type(self).__name__
        offset = arguments.nonnegative_int(q_offset, "q_offset")
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if len(lead) < 1 or lead[-1] != self.num_heads or q.shape[-1] != self.head_dim:
            raise ValueError(
                f"{who} has parameters for {self.num_heads} heads of size {self.head_dim}: "
                f"q, k, v must be (B, …, {self.num_heads}, L, {self.head_dim}) (heads at dim "
                f"−3), got q {tuple(q.shape)}, k {tuple(k.shape)}"
            )
        m, n = q.shape[-2], k.shape[-2]
        if cache is not None and not isinstance(cache, LayerCache):
            raise TypeError(
                f"{who}: cache must be a LayerCache or None, got {type(cache).__name__}"
            )
        stateful = isinstance(cache, RecurrentCache)
        # the template asks for weights under a capture (hooks listening) too: a step from the
        # state has none and runs, reporting nothing; asked outside a capture, it refuses (the
        # caller's own request cannot be told from the capture's inside one)
        if stateful and (n != m or (need_weights and not hooks.listening())):
            raise ValueError(
                f"{who}: with a RecurrentCache k and v hold the {m} new positions only (got k "
                f"{tuple(k.shape)}), and the weights over the earlier positions, whose keys are "
                "not kept, cannot be returned (need_weights must be False)"
            )
        if stateful and offset != len(cache):
            raise ValueError(
                f"{who}: q_offset {offset} is not the {len(cache)} positions the RecurrentCache "
                "has seen"
            )
        if not stateful and n != offset + m:
            raise ValueError(
                f"{who} is causal self-attention: the {m} queries at positions {offset} … "
                f"{offset + m - 1} need {offset + m} keys, got k {tuple(k.shape)}"
            )
        if mask is not None and not stateful and offset and m > 1 and mask.shape[-2] == m:
            above = mask.new_zeros(*mask.shape[:-2], offset, mask.shape[-1])
            mask = torch.cat([above, mask], -2)  # the earlier rows: left out, then cut away
        length = m if stateful else n
        if offset and not stateful:
            q = F.pad(q, (0, 0, offset, 0))
        keep, empty = (None, None) if mask is None else _key_padding(mask, length, who)
        rows = keep if empty is None else keep & ~empty
        dtype = q.dtype
        work = torch.promote_types(dtype, torch.float32)
        q, k, v = _zero(q.to(work), rows), _zero(k.to(work), keep), _zero(v.to(work), keep)
        x = self.prepare(q, k, v)
        if keep is not None:
            x = x._replace(g=_zero(x.g, keep), beta=None if x.beta is None else _zero(x.beta, keep))
        if stateful:
            form = "recurrent" if self.form == "recurrent" else "chunkwise"
            out, state = self.run(x, form, cache.read(self, tuple(lead)))
            cache.advance(state, m, self)
        else:
            out, _ = self.run(x, self.form, None)
        out = _zero(self.finish(out, x), rows)[..., length - m :, :].to(dtype)
        if stateful or not need_weights:
            return AttentionOutput(out)
        visible = tril(length, q.device)
        if rows is not None:
            visible = visible & rows.unsqueeze(-1) & keep.unsqueeze(-2)
        weights = self.align(self.dense_weights(x), visible).weights
        return AttentionOutput(out, weights[..., length - m :, :].to(dtype))


class _DecayFamily(LinearFamilyPart):
    """The parts whose state only decays and is written to (no delta rule): the kernels of
    :mod:`attnkit.linear_family.decay`."""

    def run(self, x: Inputs, form: str, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if form == "parallel":
            return decay.parallel(x.q, x.k, x.v, x.g), None
        if form == "recurrent":
            return decay.recurrent(x.q, x.k, x.v, x.g, state)
        return decay.chunkwise(x.q, x.k, x.v, x.g, self.chunk_size, state)

    def dense_weights(self, x: Inputs) -> Tensor:
        return decay.weights(x.q, x.k, x.g)
