"""Native Sparse Attention, NSA (Yuan et al. 2025, "Native Sparse Attention: Hardware-Aligned
and Natively Trainable Sparse Attention", DeepSeek): three causal branches per query, combined
by learned gates (eqs. 5, 7-12 of the paper).

For query t at position p_t, with keys k_{1:p_t} and values v_{1:p_t}:

- **compressed** (eq. 7): the keys of each block of length l, taken with stride s, are compressed
  to one key by a learned map φ,
  K̃ᶜᵐᵖ_t = {φ(k_{is+1 : is+l}) | 0 ≤ i ≤ ⌊(p_t − l)/s⌋} (likewise the values), and
  oᶜᵐᵖ_t = Σ_i pᶜᵐᵖ_{t,i} ṽ_i with pᶜᵐᵖ_t = softmax(q_tᵀ K̃ᶜᵐᵖ_t / √d) (eq. 8).
- **selected** (eqs. 8-12): the keys are cut into selection blocks of length l'; block j's
  importance is the compressed attention that falls on it,
  pˢˡᶜ_t[j] = Σ_{i : [is, is + l) ∩ [jl', (j + 1)l') ≠ ∅} pᶜᵐᵖ_{t,i}, each compressed block that
  shares a key with block j counted once, summed over the heads of a GQA group (eq. 10) so
  that the group reads the same blocks; the top n blocks
  (eq. 11) give the keys and values attended at token level, oˢˡᶜ_t = softmax(q_tᵀKˢˡᶜ_t/√d)Vˢˡᶜ_t.
  As in the paper's set-up, the first ``num_initial`` blocks and the ``num_local`` blocks ending
  at the query's own are always selected (they count towards n).
- **window** (eq. 5): the last w keys, oʷⁱⁿ_t = softmax(q_tᵀ k_{p_t−w+1 : p_t}/√d) v_{…}.

    o_t = Σ_{c ∈ {cmp, slc, win}} g_t^c · o_t^c,   g_t^c = σ(MLP(x_t)) ∈ (0, 1)   (eq. 5)

Evaluation follows the selection. Without a mask, on the CPU, for queries that end at the
last key (self-attention, or a chunk of it at a multiple of l'), the forward (softmax
alignment, no weights requested) evaluates the selected and window branches as pieces of
PyTorch's fused attention kernel (:mod:`attnkit.sparse_trainable._nsa_blocks`): the query's
own block, the previous one, block 0 and the window's blocks as batched calls on views of the
keys, the other selected blocks as tiles of queries that chose the same block, merged by their
log-sum-exps, with a backward that recomputes the branches and runs the kernel's backward per
piece. Without autograd it computes one selection group's compressed keys and gates at a time;
under autograd, where φ is the module's own :class:`BlockCompression` and s divides l and N,
the gates and φ run inside that backward (:mod:`attnkit.sparse_trainable._nsa_trained`), so
their gradients join ∂L/∂q, ∂L/∂k, ∂L/∂v a head at a time. Otherwise it runs the three
branches a chunk of queries at a time with one hand-written backward
(:mod:`attnkit.sparse_trainable._nsa_chunks`): the compressed branch as a product over the
compressed blocks the chunk has seen, the selected and window branches over (query, key block)
pairs tiled by key block, so that every score comes from a batched matrix product and a key
block is read once per tile of queries. Per query that scores n·l' selected keys, w (+ up to
2l' at the window's edges) window keys and p_t/s compressed keys: O(M·(n·l' + w)·d) plus
O(M·N/s·d), against O(M·N·d) for causal attention (at the defaults 0.43 of causal attention's
scores at N = 8192, 0.25 at 16384). Kept for the backward: three log-sum-exps per query and
the chosen blocks. :meth:`NativeSparseAttention.branches` (and the forward when weights are
requested or a hook listens) evaluates the branches one by one with per-query gathers
(:mod:`attnkit.sparse_trainable._gathered`), returning every branch's weights.

Eq. 9 is not the paper's double sum. The paper states the intent — selection scores "according
to their spatial relationship" with the compression blocks, reducing to pˢˡᶜ = pᶜᵐᵖ when
l' = l = s — and writes pˢˡᶜ_t[j] = Σ_{m<l'/s} Σ_{n<l/s} pᶜᵐᵖ_t[(l'/s)·j − m − n]. Read
literally at its defaults (l = 32, s = 16, l' = 64) that sums compressed blocks 4j − 4 … 4j with
multiplicities 1, 2, 2, 2, 1: blocks starting at tokens 64j − 64 … 64j, mostly before selection
block j (keys 64j … 64j + 63), of which blocks 4j + 1 … 4j + 3 inside it are left out. The
overlap sum above follows the stated intent; both reduce to pˢˡᶜ = pᶜᵐᵖ when l' = l = s.

Differences from the paper, by necessity of the per-head slot: the gates read the head's query
q_t (the paper's MLP reads the token's hidden state x_t, which a per-head part never sees), and φ
is a linear map of the flattened block plus a learned intra-block position embedding (the
paper's "MLP with intra-block position encoding", one layer). Selection is shared by heads h in
consecutive groups of ``group_size`` (head h reads key/value head h // group_size in
:class:`attnkit.MultiHeadAttention` with ``num_kv_heads``); ``group_size=1`` selects per head.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, hooks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.head import HeadAttention, check_head_inputs
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput
from attnkit.sparse_trainable import _nsa_blocks as nsa_blocks
from attnkit.sparse_trainable import _nsa_trained as nsa_trained
from attnkit.sparse_trainable._gathered import gathered_softmax
from attnkit.sparse_trainable._nsa_chunks import Sizes, importance, nsa_chunked, rank_blocks
from attnkit.sparse_trainable._select import (
    all_finite,
    gather_keys,
    gather_mask,
    group_sum,
    query_positions,
    row_mask,
    sanitize,
)
from attnkit.sparse_trainable.compression import (
    BlockCompression,
    MeanCompression,
    compress_blocks,
)

__all__ = ["BlockCompression", "MeanCompression", "NSABranches", "NativeSparseAttention"]


class NSABranches(NamedTuple):
    """Each branch of NSA for per-head q (*lead, M, d).

    Attributes:
        context: (*lead, M, d_v) the gated sum.
        compressed, selected, window: (*lead, M, d_v) the branch outputs o^c.
        gates: (*lead, M, 3) g^cmp, g^slc, g^win.
        compressed_weights: (*lead, M, n_cmp) pᶜᵐᵖ over the compressed blocks.
        selected_blocks: (*lead, M, n') indices of the selected blocks (n' = min(n, blocks)),
            with ``selected_available`` (*lead, M, n') False where fewer blocks were available.
        selected_weights, window_weights: (*lead, M, N) token weights of the two token branches.
    """

    context: Tensor
    compressed: Tensor
    selected: Tensor
    window: Tensor
    gates: Tensor
    compressed_weights: Tensor
    selected_blocks: Tensor
    selected_available: Tensor
    selected_weights: Tensor | None
    window_weights: Tensor | None


def _scatter(weights: Tensor, index: Tensor, n: int) -> Tensor:
    """Token weights (*lead, M, T) at key indices (*lead, M, T) as dense (*lead, M, N)."""
    dense = weights.new_zeros(*weights.shape[:-1], n)
    return dense.scatter_add(-1, index, weights)


@REGISTRY.register("native_sparse")
class NativeSparseAttention(HeadAttention):
    """Native Sparse Attention (module docstring), a causal per-head part
    ``part(q, k, v, *, mask, bias, need_weights, q_offset)`` with q (B, …, H, M, d),
    k (B, …, H, N, d), v (B, …, H, N, d_v): query i sits at position ``q_offset + i`` and attends
    keys j ≤ q_offset + i.

    Args:
        head_dim: d.
        compress_block: l, the compression block length (32 in the paper).
        compress_stride: s, the stride between compression blocks (16).
        select_block: l', the selection block length (64).
        num_selected: n, blocks selected per query, forced ones included (16).
        window: w, the sliding window (512).
        num_initial, num_local: blocks always selected at the start and ending at the query
            (1 and 2 in the paper).
        group_size: heads (consecutive at dim −3) that share their selection (eq. 10).
        value_dim: d_v (default d).
        compress_key, compress_value: φ for keys and values; default :class:`BlockCompression`.

    The output's ``weights`` (with ``need_weights``) are the selection branch's token weights
    (…, M, N); every branch's weights are reported to :mod:`attnkit.hooks` by name
    (``compressed``, ``selected``, ``window``), and :meth:`branches` returns all of them.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})
    any_value_size: ClassVar[bool] = False  # values of value_dim features (head_dim)

    decodes_with_cache: ClassVar[bool] = True  # causal by construction: a step is its row
    takes_q_offset: ClassVar[bool] = True
    takes_facts: ClassVar[bool] = True  # reads whether k and v are known finite
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(
        self,
        head_dim: int,
        *,
        compress_block: int = 32,
        compress_stride: int = 16,
        select_block: int = 64,
        num_selected: int = 16,
        window: int = 512,
        num_initial: int = 1,
        num_local: int = 2,
        group_size: int = 1,
        value_dim: int | None = None,
        compress_key: nn.Module | None = None,
        compress_value: nn.Module | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.compress_block = arguments.positive_int(compress_block, "compress_block")
        self.compress_stride = arguments.positive_int(compress_stride, "compress_stride")
        self.select_block = arguments.positive_int(select_block, "select_block")
        self.num_selected = arguments.positive_int(num_selected, "num_selected")
        self.window = arguments.positive_int(window, "window")
        self.num_initial = arguments.nonnegative_int(num_initial, "num_initial")
        self.num_local = arguments.nonnegative_int(num_local, "num_local")
        self.group_size = arguments.positive_int(group_size, "group_size")
        self.value_dim = (
            self.head_dim if value_dim is None else arguments.positive_int(value_dim, "value_dim")
        )
        if self.compress_stride > self.compress_block:
            raise ValueError(
                f"compress_stride must be at most compress_block (blocks overlap or touch), got "
                f"stride {compress_stride} > block {compress_block}"
            )
        for name, given in (("compress_key", compress_key), ("compress_value", compress_value)):
            if given is not None and not isinstance(given, nn.Module):
                raise TypeError(f"{name} must be an nn.Module or None, got {type(given).__name__}")
        factory = {"device": device, "dtype": dtype}
        if compress_key is None:
            compress_key = BlockCompression(compress_block, head_dim, **factory)
        if compress_value is None:
            compress_value = BlockCompression(compress_block, self.value_dim, **factory)
        self.compress_key, self.compress_value = compress_key, compress_value
        self.gate = nn.Linear(head_dim, 3, **factory)
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 12, 4, seed=s) for s in (40, 41, 42))
        mask = torch.arange(12)[None, :] < torch.tensor([12, 9])[:, None]
        module = cls(
            4, compress_block=4, compress_stride=2, select_block=4, num_selected=2, window=3
        )
        return module, (q, k, v), {"mask": mask[:, None, None, :].expand(2, 2, 1, 12)}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.SPARSE]

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
        need_weights: bool, q_offset: int = 0, checked: bool = False, finite: bool = False,
    ) -> AttentionOutput:  # fmt: skip
        """NSA on inputs the template :meth:`HeadAttention.forward` validated (it refuses a
        bias: the part does not declare ``accepts_bias``)."""
        align = self.align
        chunked = type(align) is Softmax and align.fixed_temperature is not None
        if need_weights or not chunked or not (q.numel() and k.numel()):
            # (the template asks for the weights whenever someone listens to hooks)
            out = self._branches(q, k, v, mask, q_offset, need_weights)
            return AttentionOutput(out.context, out.selected_weights if need_weights else None)
        lead, q_, k_, v_, rows, pos, scale = self._placed(q, k, v, mask, q_offset)
        if not (finite or all_finite(k_, v_)):
            # the tiles read keys a query may not attend with weight 0 (0 · NaN = NaN): keys
            # that are not finite, where some query may read them, take the per-query gathers
            out = self._branches(q, k, v, mask, q_offset, False)
            return AttentionOutput(out.context, None)
        q, k, v = q_, k_, v_
        count, m = lead.numel(), q.shape[-2]
        sizes, factor = self._sizes(), scale / align.fixed_temperature
        fast = nsa_blocks.applies(q, k.shape[-2], q_offset, rows, sizes)
        if fast and not self._needs_grad(q, k, v):
            # inference: one selection group's compressed keys and gates at a time
            q, k, v = (x.reshape(count, *x.shape[-2:]) for x in (q, k, v))
            context = q.new_empty(count, m, self.value_dim)
            for c in range(0, count, self.group_size):
                s = slice(c, c + self.group_size)
                kc, vc = self._compress(k[s], v[s], None, pos)
                gates = torch.sigmoid(self.gate(q[s]))
                args = (q[s], k[s], v[s], kc, vc, gates, q_offset, sizes, factor)
                nsa_blocks.nsa_blocks(*args, out=context[s])
            return AttentionOutput(context.view(*lead, m, self.value_dim))
        if fast and nsa_trained.fuses(
            self.compress_key, self.compress_value, self.gate, k.shape[-2], sizes
        ):
            # training: the gates and φ inside the fused path's autograd function
            q, k, v = (x.reshape(count, *x.shape[-2:]) for x in (q, k, v))
            parts = (self.compress_key, self.compress_value, self.gate)
            context = nsa_trained.nsa_trained(q, k, v, *parts, q_offset, sizes, factor)
            return AttentionOutput(context.view(*lead, m, self.value_dim))
        kc, vc = self._compress(k, v, rows, pos)
        gates = torch.sigmoid(self.gate(q))
        flat = (x.reshape(count, *x.shape[-2:]) for x in (q, k, v, kc, vc, gates))
        rows3 = None if rows is None else rows.reshape(count, *rows.shape[-2:])
        if fast:
            context = nsa_blocks.nsa_blocks(*flat, q_offset, sizes, factor)
        else:
            context = nsa_chunked(*flat, rows3, q_offset, sizes, factor)
        return AttentionOutput(context.view(*lead, m, self.value_dim))

    def branches(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        q_offset: int = 0,
        token_weights: bool = True,
    ) -> NSABranches:
        """Every branch, its gate and its weights (:class:`NSABranches`); ``token_weights``
        False leaves the dense (…, M, N) token weights out unless someone listens."""
        if bias is not None:
            raise ValueError(
                "NativeSparseAttention takes no bias (it does not declare accepts_bias): its "
                "compressed branch scores blocks, not keys, so an additive (…, M, N) bias has "
                "no place there; use a position scheme that rotates q and k (rope) or none"
            )
        check_head_inputs(q, k, v, mask, None, "NativeSparseAttention")
        return self._branches(q, k, v, mask, q_offset, token_weights)

    def _branches(self, q, k, v, mask, q_offset, token_weights) -> NSABranches:
        """:meth:`branches` on validated inputs."""
        _, q, k, v, rows, pos, scale = self._placed(q, k, v, mask, q_offset)
        n = k.shape[-2]
        listening = hooks.listening()

        o_cmp, p_cmp = self._compressed(q, k, v, rows, pos, scale)
        blocks, available, o_slc, w_slc, idx_slc = self._selected(q, k, v, rows, pos, p_cmp, scale)
        o_win, w_win, idx_win = self._window(q, k, v, rows, pos, scale, q_offset)
        gates = torch.sigmoid(self.gate(q))  # (*lead, M, 3)
        context = gates[..., 0:1] * o_cmp + gates[..., 1:2] * o_slc + gates[..., 2:3] * o_win

        dense_slc = dense_win = None
        if token_weights or listening:
            dense_slc = _scatter(w_slc, idx_slc, n)
            dense_win = _scatter(w_win, idx_win, n)
        hooks.report(self, p_cmp, "compressed")
        hooks.report(self, dense_slc, "selected")
        hooks.report(self, dense_win, "window")
        return NSABranches(
            context, o_cmp, o_slc, o_win, gates, p_cmp, blocks, available, dense_slc, dense_win
        )

    def _needs_grad(self, *inputs: Tensor) -> bool:
        """Whether autograd records this call (an input or a parameter requires grad)."""
        return torch.is_grad_enabled() and (
            any(x.requires_grad for x in inputs) or any(p.requires_grad for p in self.parameters())
        )

    def _sizes(self) -> Sizes:
        return Sizes(
            self.compress_block, self.compress_stride, self.select_block, self.num_selected,
            self.window, self.num_initial, self.num_local, self.group_size,
        )  # fmt: skip

    def _placed(self, q, k, v, mask, q_offset):
        """Inputs of a valid per-head call checked against the part's sizes; -> (lead, q, k, v
        broadcast to lead (masked keys zeroed), rows, positions, scale)."""
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        arguments.nonnegative_int(q_offset, "q_offset")
        if q.shape[-1] != self.head_dim or v.shape[-1] != self.value_dim:
            raise ValueError(
                f"NativeSparseAttention(head_dim={self.head_dim}, value_dim={self.value_dim}) "
                f"got q {tuple(q.shape)} and v {tuple(v.shape)}"
            )
        if self.group_size > 1 and (len(lead) < 1 or lead[-1] % self.group_size):
            raise ValueError(
                f"group_size={self.group_size} shares the selection among heads at dim -3, "
                f"which needs H divisible by it; got q {tuple(q.shape)}"
            )
        m, n = q.shape[-2], k.shape[-2]
        q, k, v = (x.broadcast_to(*lead, *x.shape[-2:]) for x in (q, k, v))
        rows = row_mask(mask, lead, m, n)
        pos = query_positions(m, q_offset, q.device)  # (M,)
        k, v = sanitize(k, v, rows, q_offset + m - 1)
        return lead, q, k, v, rows, pos, 1.0 / math.sqrt(self.head_dim)

    # ---- branches ----------------------------------------------------------------------------

    def _compressed(self, q, k, v, rows, pos, scale) -> tuple[Tensor, Tensor]:
        """NSA eqs. 7-8: attention over the compressed blocks each query has wholly seen."""
        n, l, s = k.shape[-2], self.compress_block, self.compress_stride
        lead, m = q.shape[:-2], q.shape[-2]
        count = (n - l) // s + 1 if n >= l else 0
        if count == 0:
            return q.new_zeros(*lead, m, self.value_dim), q.new_zeros(*lead, m, 0)
        seen = self._seen(rows, pos, count)
        kc, vc = self._compress(k, v, rows, pos)
        e = torch.matmul(q, kc.transpose(-1, -2)) * scale
        p = self.align(e, seen).weights
        return torch.matmul(p, vc), p

    def _seen(self, rows, pos, count) -> Tensor:
        """(…, M', count): the compressed blocks each query has wholly seen (and may read)."""
        l, s = self.compress_block, self.compress_stride
        starts = torch.arange(count, device=pos.device) * s
        seen = (starts + l - 1)[None, :] <= pos[:, None]  # (M, count) causal
        if rows is not None:  # every key of the block may be attended by the row
            seen = seen & rows.unfold(-1, l, s).all(-1)
        return seen

    def _compress(self, k, v, rows, pos) -> tuple[Tensor, Tensor]:
        """NSA eq. 7: the compressed keys and values (…, C, d); those no query has seen are 0
        (nothing of the keys a mask excludes reaches them)."""
        n, l, s = k.shape[-2], self.compress_block, self.compress_stride
        count = (n - l) // s + 1 if n >= l else 0
        if count == 0:
            return k.new_zeros(*k.shape[:-2], 0, k.shape[-1]), v.new_zeros(
                *v.shape[:-2], 0, v.shape[-1]
            )
        kc = compress_blocks(self.compress_key, k, l, s)  # (*lead, count, d)
        vc = compress_blocks(self.compress_value, v, l, s)
        if rows is None:  # causal only: the blocks the last query has seen
            used = torch.arange(count, device=k.device) * s + l - 1 <= pos[-1]
            used = used[:, None]
        else:
            seen = self._seen(rows, pos, count)
            used = seen.broadcast_to(*k.shape[:-2], len(pos), count).any(-2)[..., None]
        return kc.where(used, 0.0), vc.where(used, 0.0)

    def _selected(self, q, k, v, rows, pos, p_cmp, scale):
        """NSA eqs. 9-12: the top blocks by compressed attention, attended at token level."""
        n, lb = k.shape[-2], self.select_block
        count = -(-n // lb)
        score = importance(p_cmp, n, self._sizes())  # eq. 9, (*lead, M, count)
        if self.group_size > 1:
            score = group_sum(score, self.group_size)  # eq. 10
        has_key = None
        if rows is not None:
            padded = torch.nn.functional.pad(rows, (0, count * lb - n), value=False)
            has_key = padded.unflatten(-1, (count, lb)).any(-1)
        blocks, available = rank_blocks(score, pos, has_key, self._sizes())  # eq. 11
        index = (blocks[..., None] * lb + torch.arange(lb, device=q.device)).flatten(-2)
        ok = (index < n) & available.repeat_interleave(lb, -1) & (index <= pos[:, None])
        index = index.clamp_max(n - 1)
        o, w = self._attend(q, k, v, rows, index, ok, scale)
        return blocks, available, o, w, index

    def _window(self, q, k, v, rows, pos, scale, q_offset):
        """NSA's sliding-window branch: keys p_t − w + 1 … p_t."""
        n, span = k.shape[-2], self.window
        # columns c of key p_t − w + 1 + c that some query can use (in [0, N)): no other is read
        first = max(0, span - 1 - (q_offset + len(pos) - 1))
        last = min(span, n + span - 1 - q_offset)
        columns = torch.arange(first, max(first, last), device=q.device)
        index = pos[:, None] - span + 1 + columns
        ok = (index >= 0) & (index < n)
        index = index.clamp(0, n - 1).broadcast_to(*q.shape[:-2], *index.shape)
        o, w = self._attend(q, k, v, rows, index, ok, scale)
        return o, w, index

    def _attend(self, q, k, v, rows, index, ok, scale) -> tuple[Tensor, Tensor]:
        """Softmax attention of each query over its own gathered keys ``index`` (*lead, M, T)
        where ``ok``: with the softmax alignment by :func:`gathered_softmax` (O(M·T·d) time,
        O(M·T) memory kept), with any other (e.g. an ablation's) by gathering every query's
        keys at once."""
        lead = q.shape[:-2]
        index = index.broadcast_to(*lead, *index.shape[-2:])
        ok = ok.broadcast_to(index.shape)
        if rows is not None:
            ok = ok & gather_mask(rows, index)
        align = self.align
        if type(align) is Softmax and align.fixed_temperature is not None:
            return gathered_softmax(q, k, v, index, ok, scale / align.fixed_temperature)
        kg, vg = gather_keys(k, index), gather_keys(v, index)  # (*lead, M, T, d)
        kg, vg = kg.where(ok[..., None], 0.0), vg.where(ok[..., None], 0.0)
        e = (q.unsqueeze(-2) * kg).sum(-1) * scale
        w = align(e, ok).weights
        return (w.unsqueeze(-1) * vg).sum(-2), w

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, compress_block={self.compress_block}, "
            f"compress_stride={self.compress_stride}, select_block={self.select_block}, "
            f"num_selected={self.num_selected}, window={self.window}, "
            f"group_size={self.group_size}"
        )
