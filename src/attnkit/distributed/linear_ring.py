"""The gated linear family over a ring: a causal sequence split across processes, the recurrent
state passed between the ranks' parts (context parallelism for retention, GLA, Mamba-2's SSD,
DeltaNet, Gated DeltaNet and every part that continues from a state the same way).

Each part of :mod:`attnkit.linear_family` is a recurrence S_t = A_t S_{t−1} + (write)_t with an
output o_t read from S_t, both *affine* in the state it starts from: A_t = diag(exp g_t) for
the decay family, α_t (I − β_t k_t k_tᵀ) for the delta rule. So a rank's part of the sequence,
started from any state S_in, gives

    S_out = A S_in + B,        o_t = o_t⁰ + Q̃_t S_in,

with A (d_k × d_k) the product of its positions' transitions, B the state it reaches from zero,
o⁰ its output from zero and Q̃ (N_l × d_k) what each query reads of the incoming state. One run
of the part's own kernel gives all four (:meth:`LinearFamilyPart.run
<attnkit.linear_family.LinearFamilyPart.run>` from a given state): the values get d_k zero
columns and the state starts as [0 | I] — the state's columns never mix, so the extra columns
carry the identity through the recurrence and come out as [B | A] and [o⁰ | Q̃].

The ranks then exchange (A, B) in one all-gather and each composes the states entering its
part, S_in(r) = A_{r−1} S_in(r−1) + B_{r−1} from S_in(0) = 0 (a prefix scan of P small affine
maps), and adds Q̃ S_in to its output. Every rank works at once: the cost is one run over
N_l positions with d_v + d_k value columns instead of d_v, one all-gather of P·d_k·(d_k + d_v)
numbers per head, and P small products d_k × d_k × d_v. Passing the state along the ring
instead (rank r waits for rank r − 1's final state) sends less but runs the ranks one after
the other: P times one rank's work in wall time, against about (1 + d_k/d_v) times here.

The backward pass is autograd's through the runs and the composition, with the all-gather's
gradient summed over the group (every rank must run it). Under the ``"zigzag"`` layout a rank
holds two runs of positions; each is a part of the sequence of its own (2P maps to compose),
so a stack that balances its softmax layers by zigzag can hold linear layers too.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.distributed.agreement import Call, agree
from attnkit.distributed.layout import LAYOUTS, check_layout, segments
from attnkit.distributed.positions import RingPositions, global_positions
from attnkit.distributed.transport import Ring
from attnkit.head import HeadAttention, check_head_inputs
from attnkit.linear_family.base import Inputs, LinearFamilyPart
from attnkit.output import AttentionOutput
from attnkit.positions import PositionScheme

__all__ = ["RingLinearAttention", "reasons_not_recurrent", "ring_recurrence"]


def reasons_not_recurrent(part: object) -> list[str]:
    """Why the ring cannot pass ``part``'s state between the ranks (empty when it can), read
    from what the part declares: a causal part that keeps a recurrent state it continues from
    (``causal`` and ``takes_cache``, with the state hooks of
    :class:`attnkit.linear_family.LinearFamilyPart`: ``prepare``, ``run(x, form, state)``,
    ``finish``)."""
    name = type(part).__name__
    if not isinstance(part, HeadAttention):
        return [f"{name} is not a per-head attention part (attnkit.head.HeadAttention)"]
    out = []
    if not part.takes_cache:
        out.append(
            f"attention part {name} keeps no recurrent state (takes_cache is False), so there "
            "is no state to pass between the ranks"
        )
    if not getattr(part, "causal", False):
        out.append(f"attention part {name} is not causal (causal is not True)")
    if part.takes_cache and not isinstance(part, LinearFamilyPart):
        out.append(
            f"attention part {name} keeps a state but not through the hooks of "
            "attnkit.linear_family.LinearFamilyPart (prepare, run(x, form, state), finish)"
        )
    return out


class _Gather(torch.autograd.Function):
    """(P, …): every rank's tensor; the gradient of a rank's own is the sum over the group of
    the gradients of its copies."""

    @staticmethod
    def forward(ctx, ring: Ring, x: Tensor) -> Tensor:
        ctx.ring = ring
        x = x.contiguous()
        out = [torch.empty_like(x) for _ in range(ring.size)]
        with ring.guard("gathering the ranks' state transitions"):
            dist.all_gather(out, x, group=ring.group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ring: Ring = ctx.ring
        grad = grad.contiguous()
        with ring.guard("summing the gradients of the state transitions"):
            dist.all_reduce(grad, group=ring.group)
        return None, grad[ring.rank]


class _Tie(torch.autograd.Function):
    """``out`` unchanged, with the gathered transitions as an input whose gradient is zero
    here: every rank's output then reaches the all-gather in the backward pass, also rank 0's,
    which reads none of them (the collective's backward must run on every rank)."""

    @staticmethod
    def forward(ctx, out: Tensor, maps: Tensor) -> Tensor:
        ctx.maps = (maps.shape, maps.dtype, maps.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device = ctx.maps
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def _segment(x: Inputs, start: int, length: int) -> Inputs:
    def cut(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.narrow(-2, start, length)

    return Inputs(*(cut(t) for t in x))


def _affine_run(part: LinearFamilyPart, x: Inputs, form: str) -> tuple[Tensor, Tensor]:
    """One run from the state [0 | I] with d_k zero value columns appended: outputs
    [o⁰ | Q̃] (…, L, d_v + d_k) and final state [B | A] (…, d_k, d_v + d_k)."""
    lead = torch.broadcast_shapes(*(t.shape[:-2] for t in x if t is not None))
    d_k, d_v, length = x.k.shape[-1], x.v.shape[-1], x.v.shape[-2]
    opts = {"dtype": x.v.dtype, "device": x.v.device}
    v = torch.cat([x.v.expand(*lead, length, d_v), x.v.new_zeros(*lead, length, d_k)], -1)
    eye = torch.eye(d_k, **opts).expand(*lead, d_k, d_k)
    state = torch.cat([x.v.new_zeros(*lead, d_k, d_v), eye], -1)
    out, last = part.run(x._replace(v=v), form, state)
    return out, last


def _checked(part, q, k, v, layout, key_padding_mask) -> tuple[torch.Size, Tensor | None]:
    """Every check of a call that needs nothing of the group; the leading dims and the
    positions that exist (B, …, N_l) or None."""
    reasons = reasons_not_recurrent(part)
    if reasons:
        raise ValueError("the ring cannot pass this part's state: " + "; ".join(reasons))
    who = type(part).__name__
    check_layout(layout)
    lead = check_head_inputs(q, k, v, None, None, who)
    if len(lead) < 1 or lead[-1] != part.num_heads or q.shape[-1] != part.head_dim:
        raise ValueError(
            f"{who} has parameters for {part.num_heads} heads of size {part.head_dim}: q, k, v "
            f"must be (B, …, {part.num_heads}, N_l, {part.head_dim}) (heads at dim −3), got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    n = q.shape[-2]
    if k.shape[-2] != n or n == 0:
        raise ValueError(
            f"{who} over a ring is causal self-attention: each rank holds as many queries as "
            f"keys (N_l > 0), got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    if layout == "zigzag" and n % 2:
        raise ValueError(
            f"the zigzag layout holds a front and a back chunk of equal length per rank, so "
            f"each rank's length must be even, got {n}"
        )
    if key_padding_mask is None:
        return lead, None
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError(
            "key_padding_mask must be a boolean tensor (B, N_l), True = a real position, got "
            f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}"
        )
    if (
        len(lead) < 2
        or key_padding_mask.dim() != 2
        or key_padding_mask.shape[1] != n
        or key_padding_mask.shape[0] not in (1, lead[0])
    ):
        batch = lead[0] if len(lead) >= 2 else None
        raise ValueError(
            f"key_padding_mask must be (B, N_l) = ({batch}, {n}) for q {tuple(q.shape)} "
            f"(batch first, heads at dim −3), got {tuple(key_padding_mask.shape)}"
        )
    pad = key_padding_mask.to(q.device)
    return lead, pad.view(pad.shape[0], *([1] * (len(lead) - 1)), n)


def _zero(x: Tensor, keep: Tensor | None) -> Tensor:
    if keep is None:
        return x
    return torch.where(keep.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def ring_recurrence(
    part: LinearFamilyPart,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    key_padding_mask: Tensor | None = None,
    refusal: Exception | None = None,
) -> AttentionOutput:
    """A gated linear-attention part over a sequence split across the ranks of ``group``.

    Every rank calls it with its own part of the sequence, laid out as ``layout`` says
    (:func:`attnkit.distributed.shard`); the result on each rank is its part of what
    ``part(q, k, v)`` gives on the whole sequence in one process (the part is causal
    self-attention), forward and backward.

    Args:
        part: a part declaring a recurrent state (``causal`` and ``takes_cache``: the parts of
            :mod:`attnkit.linear_family`); its parameters are replicated on every rank.
        q, k: this rank's (B, …, H, N_l, d); v: (B, …, H, N_l, d_v).
        group: the process group of the ring (None: the default group).
        layout: ``"contiguous"`` or ``"zigzag"``, the same on every rank.
        key_padding_mask: this rank's (B, N_l), True = a real position; a padded position
            neither writes into the state nor decays it, and its row is 0 (as the part does
            on one process).
        refusal: an error the caller met on this rank before the call, agreed on with the
            other ranks as this function's own checks are (every rank raises it).

    Returns:
        :class:`attnkit.AttentionOutput` with this rank's context (B, …, H, N_l, d_v).

    Each rank's ``.grad`` of the part's parameters holds its positions' part: sum them over
    the group (``torch.distributed.all_reduce``).
    """
    lead = keep = None
    if refusal is None:
        try:
            lead, keep = _checked(part, q, k, v, layout, key_padding_mask)
        except (ValueError, TypeError) as err:
            refusal = err
    try:
        ring = Ring.of(group)
    except (ValueError, TypeError):
        if refusal is not None:
            raise refusal from None
        raise
    if refusal is None:
        try:
            ring.check_device(q, "q")
        except ValueError as err:
            refusal = err
    call = Call()
    for name, x in (("q", q), ("k", k), ("v", v), ("key_padding_mask", key_padding_mask)):
        call.tensor(name, x)
    call.dtype(q)
    call.value("world_size", ring.size, ring.size)
    call.value("layout", LAYOUTS.index(layout) if layout in LAYOUTS else -1, layout)
    call.part("part", part)
    agree(ring, call, refusal, ring.device_of(q), what="the linear ring")
    assert lead is not None  # every rank accepted: this one too
    n = q.shape[-2]
    dtype = q.dtype
    work = torch.promote_types(dtype, torch.float32)
    q, k, v = _zero(q.to(work), keep), _zero(k.to(work), keep), _zero(v.to(work), keep)
    x = part.prepare(q, k, v)
    if keep is not None:
        x = x._replace(g=_zero(x.g, keep), beta=None if x.beta is None else _zero(x.beta, keep))
    form = "recurrent" if part.form == "recurrent" else "chunkwise"
    d_v = x.v.shape[-1]
    mine = segments(ring.rank, ring.size, n, layout)
    runs = [_affine_run(part, _segment(x, s.local, s.length), form) for s in mine]
    maps = _Gather.apply(ring, torch.stack([last for _, last in runs]))  # (P, segs, …)
    order = sorted(
        (s.start, r, i)
        for r in range(ring.size)
        for i, s in enumerate(segments(r, ring.size, n, layout))
    )
    entering: dict[tuple[int, int], Tensor] = {}
    state: Tensor | None = None  # the state entering the next part of the sequence: 0 first
    for _, r, i in order:
        if r == ring.rank:
            entering[i] = state
        if len(entering) == len(mine):
            break
        b, a = maps[r, i].split((d_v, maps.shape[-1] - d_v), dim=-1)
        state = b if state is None else a @ state + b
    outs = []
    for i, (out, _) in enumerate(runs):
        base, reads = out.split((d_v, out.shape[-1] - d_v), dim=-1)
        s_in = entering[i]
        outs.append(base if s_in is None else base + reads @ s_in)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
    if maps.requires_grad:
        out = _Tie.apply(out, maps)
    out = _zero(part.finish(out, x), keep).to(dtype)
    return AttentionOutput(out)


class RingLinearAttention(HeadAttention):
    """A gated linear-attention part over a sequence split across the ranks of ``group``, for
    :class:`attnkit.MultiHeadAttention`'s ``attention=`` slot (:func:`ring_recurrence`).

    Args:
        part: the part to run (its parameters are this module's: shared, not copied).
        group: the ring's process group (None: the default group).
        layout: ``"contiguous"`` or ``"zigzag"``; each rank passes its tokens laid out so.
        position: a per-token position scheme (RoPE), applied to each rank's queries and keys
            at their global positions; schemes that add a bias to scores are refused (a linear
            part has no scores to add it to).

    The part is causal by construction. The layer's ``mask`` may mark padded positions,
    (B, 1, …, 1, N_l), or be a causal mask of this rank's tokens ∧ padding (a decoder layer's).
    No bias, no weights. A refusal on one rank reaches every rank as the same ValueError.
    """

    causal_form: ClassVar[bool] = True
    causal: ClassVar[bool] = True
    decodes_with_cache: ClassVar[bool] = False
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal"})
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("q", "k", "v")}
    # each rank holds its tokens only: no whole row of weights, and a row without a key here
    # reads the state of the ranks before
    returns_weights: ClassVar[bool] = False
    sharded: ClassVar[bool] = True

    def __init__(
        self,
        part: LinearFamilyPart,
        *,
        group: dist.ProcessGroup | None = None,
        layout: str = "contiguous",
        position: str | PositionScheme | None = None,
    ) -> None:
        super().__init__()
        reasons = reasons_not_recurrent(part)
        if reasons:
            raise ValueError("the ring cannot pass this part's state: " + "; ".join(reasons))
        self.part = part
        self.group = group
        self.layout = check_layout(layout)
        if isinstance(position, str):
            from attnkit import positions

            position = positions.build(position)
        if position is not None and not isinstance(position, PositionScheme):
            raise TypeError(
                "position must be a per-head position scheme (attnkit.positions."
                f"PositionScheme), its registered name or None, got {type(position).__name__}"
            )
        self.position = None if position is None else RingPositions(position)
        if self.position is not None and self.position.has_bias:
            raise ValueError(
                f"position scheme {type(position).__name__} adds a bias to the scores, which "
                f"{type(part).__name__} (a linear recurrence) does not form"
            )

    # The template's holes (attnkit.head.HeadAttention.forward validates, refuses a bias and
    # weights by capability, hides the keys no query of this rank attends).

    def declared_mask(self, mask: Tensor | None, m: int, who: str) -> Tensor | None:
        """The mask as given: :meth:`attend` reads it as padded positions within the causal
        triangle and refuses any other form with the other ranks."""
        return mask

    def refused(self, error: Exception, q, k, v, **call) -> AttentionOutput:
        """A call the template refused on this rank: agreed on with the other ranks, which
        then raise the same error (ring_recurrence), instead of leaving them waiting."""
        from attnkit.distributed.attention import _padding_as_passed

        return ring_recurrence(
            self.part,
            q,
            k,
            v,
            group=self.group,
            layout=self.layout,
            key_padding_mask=_padding_as_passed(call["mask"], q, k, True),
            refusal=error,
        )

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:  # fmt: skip
        from attnkit.distributed.attention import _key_padding

        # A refusal here is agreed on with the other ranks (ring_recurrence), never raised
        # alone: they would wait for this rank until the group's timeout.
        refusal, pad = None, None
        try:
            if self.position is not None:
                ring = Ring.of(self.group)
                n = q.shape[-2]
                pos = global_positions(ring.rank, ring.size, n, self.layout, q.device)
                q = self.position.rotate(q, pos, ring.size * n)
                k = self.position.rotate(k, pos, ring.size * n)
            pad = None if mask is None else _key_padding(mask, q, k, True)
        except (ValueError, TypeError) as err:
            refusal = err
        return ring_recurrence(
            self.part,
            q,
            k,
            v,
            group=self.group,
            layout=self.layout,
            key_padding_mask=pad,
            refusal=refusal,
        )
