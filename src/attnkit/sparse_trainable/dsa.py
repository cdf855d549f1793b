"""DeepSeek Sparse Attention, DSA (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", sec. 2.1): a lightning indexer scores every
preceding key cheaply, and the main attention reads only the top-k keys of each query.

    I_{t,s} = Σ_{j=1}^{H^I} w^I_{t,j} · ReLU(q^I_{t,j} · k^I_s)                  (eq. 1)
    u_t = Attn(h_t, {c_s | I_{t,s} ∈ Top-k(I_{t,:})})                            (eq. 2)

with H^I indexer heads of size d^I, q^I_{t,j} and w^I_{t,j} from the query token and k^I_s from
the key token (one indexer key shared by the indexer heads).

Cost, with T = min(k, N) keys per query: the main attention is scaled-dot softmax over the
selected keys (:mod:`attnkit.sparse_trainable._selected`), on the CPU through PyTorch's fused
kernel with the selection as a mask over each chunk's causal keys (forward and backward; as
many scores as causal attention, no per-query gather), elsewhere over (query, key block) pairs
tiled by key block with a hand-written backward (a block of l' keys that holds a selected key
is scored whole, so the work is the touched blocks' keys, between T and the causal prefix);
O(M·k) is kept. Selections spread over the whole prefix (as from an untrained indexer) touch
nearly every block, so on either path the main attention scores about as many keys as causal
attention; queries before position T read all of their keys (no top-k is taken). The
indexer is dense but small (ReLU instead of softmax): O(M·N·H^I·d^I) time over each query
block's causal prefix (half of causal attention's scoring at the defaults H^I·d^I = 64 = d),
plus an O(N) partial selection of the top-k per query (one ``torch.topk`` of k + 1, which
settles ties at the border without another pass: :func:`top_set`, :func:`top_mask`); it runs
without autograd a block of queries at a time (O(block·N) memory). Without autograd on the
CPU nothing of size (M, k) exists: each chunk's index scores become the chunk's selection
mask in place and are attended at once. In training the indexer's scores at the selected keys
are read from the selection's blocks, and the backward of its training signal runs densely
per chunk of queries as matrix products over the chunk's causal keys (the signal scattered
there; O(M·N·H^I·d^I) time as the indexer's forward, O(M·T) memory kept, O(chunk·N)
transient). With k ≥ N (the default 2048 at shorter lengths) every term is quadratic: the
part is full causal attention. With a bias, an
alignment other than a fixed-temperature softmax, or weights requested, the selected keys are
gathered per query
(:mod:`attnkit.sparse_trainable._gathered`).

Training (sec. 2.1, "sparse training stage"): the indexer is trained by the KL divergence from
the main attention to its own distribution over the selected keys,
L^I = Σ_t D_KL(p_{t,S_t} ‖ Softmax(I_{t,S_t})), and its inputs are detached from the model's
graph ("we detach the indexer input from the computational graph for separate optimization").
Here the indexer's gradient is λ·∂L^I/∂I (L^I a mean over query rows), delivered when the
backward pass runs through the part's output (``indexer_loss_weight`` = λ; 0 trains nothing),
and nothing of L^I reaches q, k or v: the gradients of the output with respect to the inputs are
exactly those of the sparse attention. :func:`indexer_loss` computes L^I itself.

In the per-head slot the indexer reads the head's q_t and k_s (the paper reads the hidden state
h_t, which a per-head part never sees). Selection is shared by consecutive groups of
``group_size`` heads (their index scores summed; V3.2 shares it over all heads of its MQA form).
"""

from __future__ import annotations

import itertools
import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput
from attnkit.sparse_trainable._gathered import gathered_softmax
from attnkit.sparse_trainable._select import (
    all_finite,
    gather_keys,
    group_sum,
    query_positions,
    row_mask,
    sanitize,
    top_mask,
    top_set,
)
from attnkit.sparse_trainable._selected import (
    fused_applies,
    fused_chunks,
    masked_softmax,
    selected_softmax,
)

__all__ = ["DeepSeekSparseAttention", "LightningIndexer", "indexer_loss"]


#: selected keys (count · rows · k) per fused call of the inference path
ATTEND_ELEMENTS = 1 << 20
#: index scores (count · rows · N) per block of the selection
INDEX_ELEMENTS = 1 << 22
#: entries (count · rows · k) per slice of the indexer's gradient
GRADIENT_ELEMENTS = 1 << 16


@arguments.renamed(heads="num_heads")
class LightningIndexer(nn.Module):
    """DSA eq. 1: I_{t,s} = Σ_j w_{t,j} ReLU(q^I_{t,j} · k^I_s) for q (…, M, d), k (…, N, d)
    -> (…, M, N).

    Args:
        dim: d, the size of the inputs.
        num_heads: H^I, the indexer heads.
        head_dim: d^I.
    """

    def __init__(
        self, dim: int, num_heads: int = 4, head_dim: int = 16, *, device=None, dtype=None
    ):
        super().__init__()
        self.dim = arguments.positive_int(dim, "dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        factory = {"device": device, "dtype": dtype}
        self.query = nn.Linear(dim, num_heads * head_dim, bias=False, **factory)
        self.key = nn.Linear(dim, head_dim, bias=False, **factory)
        self.weight = nn.Linear(dim, num_heads, bias=False, **factory)

    def project(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q^I (…, M, H^I, d^I), w^I (…, M, H^I) and k^I (…, N, d^I)."""
        qi = self.query(q).unflatten(-1, (self.num_heads, self.head_dim))
        return qi, self.weight(q), self.key(k)

    @staticmethod
    def scores(qi: Tensor, wi: Tensor, ki: Tensor) -> Tensor:
        """Eq. 1 from the projections of :meth:`project` -> (…, M, N): one batched matmul for
        the (…, M·H^I, N) dot products, reduced over the heads at once (nothing of size
        M·N·d^I is formed)."""
        dots = torch.relu_(qi.flatten(-3, -2) @ ki.transpose(-1, -2))  # (…, M·H^I, N)
        dots = dots.unflatten(-2, qi.shape[-3:-1])  # (…, M, H^I, N)
        return (wi.unsqueeze(-2) @ dots).squeeze(-2)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return self.scores(*self.project(q, k))


def _head_scores(
    qi: Tensor, wi: Tensor, ki: Tensor, out: Tensor | None = None, add: bool = True
) -> Tensor:
    """Eq. 1 for one head's block of queries: q^I (H^I, b, d^I) and w^I (H^I, b, 1) head-major,
    k^I (L, d^I) -> (b, L), written into ``out`` (or added to it). One matmul for the
    (H^I·b, L) dot products, each head's (b, L) slab then made ReLU and weighted in place
    (faster than a batched (1, H^I) @ (H^I, L) per query)."""
    h, b = qi.shape[:2]
    dots = torch.relu_(qi.reshape(h * b, -1) @ ki.transpose(0, 1)).view(h, b, -1)
    first = 0
    if out is None:
        out, first = dots[0].mul_(wi[0]), 1
    elif not add:
        out, first = torch.mul(dots[0], wi[0], out=out), 1
    for j in range(first, h):
        out.addcmul_(dots[j], wi[j])
    return out


def indexer_loss(index_scores: Tensor, main_weights: Tensor, available: Tensor) -> Tensor:
    """L^I as a mean over query rows: D_KL(p ‖ Softmax(I)) over the selected keys of each row.

    Args:
        index_scores: (…, M, T) I_{t,s} at the selected keys.
        main_weights: (…, M, T) the main attention's weights p there (rows sum to 1 or 0).
        available: (…, M, T) bool, the selected keys the row may attend.

    Returns:
        A scalar; rows with no key count as 0 and are not in the mean.
    """
    log_q = torch.log_softmax(index_scores.masked_fill(~available, float("-inf")), -1)
    p = main_weights
    terms = torch.where(available & (p > 0), p * (p.clamp_min(1e-300).log() - log_q), 0.0)
    rows = available.any(-1)
    return terms.sum(-1).sum() / rows.sum().clamp_min(1)


def _indexer_gradient(selected: Tensor, w: Tensor, weight: float) -> Tensor:
    """λ·∂L^I/∂I at the selected keys, (softmax(I) − p)·λ / rows, written over ``selected``
    (I (…, M, T), −inf where not available): p and softmax(I) are 0 there, rows without a key
    give 0. A slice of rows at a time (the passes over it stay in cache)."""
    mx = selected.amax(-1, keepdim=True)
    rows = max(1, int((mx > float("-inf")).sum()))
    mx.clamp_min_(torch.finfo(mx.dtype).min)  # a row without a key: exp(−inf) = 0 throughout
    tiny = torch.finfo(mx.dtype).tiny
    m = selected.shape[-2]
    step = max(1, GRADIENT_ELEMENTS // max(1, selected[..., :1, :].numel()))
    for a in range(0, m, step):
        x = selected[..., a : a + step, :]
        x.sub_(mx[..., a : a + step, :]).exp_()
        x.div_(x.sum(-1, keepdim=True).clamp_min_(tiny))
        x.sub_(w[..., a : a + step, :]).mul_(weight / rows)
    return selected


class _TrainIndexer(torch.autograd.Function):
    """Returns the context unchanged; its backward hands the indexer's projections q^I, w^I,
    k^I the gradient of eq. 1 for ``grad`` (∂L/∂I at the selected keys ``keys``, (count, M, T)),
    evaluated densely a chunk of queries at a time: the chunk's ∂L/∂I scattered over its
    causal keys (summed over a group's heads, whose I is their sum), then with
    D_j = ∂L/∂I · 1[q^I_j · k^I > 0] (H^I, b, L):

        ∂L/∂w_j = Σ_s ∂L/∂I_s ReLU(q^I_j · k^I_s),
        ∂L/∂q^I_j = w_j D_j k^I,   ∂L/∂k^I = Σ_j D_jᵀ w_j q^I_j

    as matrix products over the chunk (no per-query gather, no scatter of key gradients)."""

    @staticmethod
    def forward(ctx, context, qi, wi, ki, keys, grad, group_size, q_offset):
        ctx.save_for_backward(qi, wi, ki, keys, grad)
        ctx.group_size, ctx.q_offset = group_size, q_offset
        return context.view_as(context)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, upstream):
        qi, wi, ki, keys, grad = ctx.saved_tensors
        count, m, t = keys.shape
        h_i, n = qi.shape[-2], ki.shape[-2]
        qi_t = qi.reshape(count, m, h_i, qi.shape[-1]).transpose(1, 2)  # (count, H^I, M, d^I)
        wi_t = wi.reshape(count, m, h_i).transpose(1, 2).unsqueeze(-1)  # (count, H^I, M, 1)
        ki3 = ki.reshape(count, n, ki.shape[-1])
        dqi = torch.zeros_like(qi_t)
        dwi = torch.zeros(count, h_i, m, dtype=wi.dtype, device=wi.device)
        dki = torch.zeros_like(ki3)
        finite_q, finite_w = torch.isfinite(qi_t), torch.isfinite(wi_t)
        if not (bool(finite_q.all()) and bool(finite_w.all())):
            # a query whose index scores are not finite has no available key and no gradient
            # (∂L/∂I = 0 there); zeroed, its q^I and w^I add 0, not 0 · NaN, to the others'
            qi_t, wi_t = qi_t.where(finite_q, 0.0), wi_t.where(finite_w, 0.0)
        g = ctx.group_size
        for first_head in range(0, count, g):
            group = range(first_head, first_head + g)
            for a, b, end in fused_chunks(m, n, ctx.q_offset):
                # an unavailable entry (gradient 0) may name any key, also one past the chunk's
                # end: clamped into the buffer, it adds its 0 there
                width = min(n, max(end, t))
                dense = grad.new_zeros(b - a, width)
                for c in group:
                    dense.scatter_add_(1, keys[c, a:b].clamp_max(width - 1), grad[c, a:b])
                dense = dense[:, :end]
                for c in group:
                    qc = qi_t[c, :, a:b].reshape(h_i * (b - a), -1)
                    kc = ki3[c, :end]
                    # ReLU(q^I_j · k^I) in place, then 1[q^I_j · k^I > 0] as its sign: float
                    # passes in place (a comparison into bool is several times slower)
                    d = torch.relu_(qc @ kc.transpose(0, 1)).view(h_i, b - a, end)
                    d = d.sign_().mul_(dense).view(h_i * (b - a), end)  # D_j
                    w = wi_t[c, :, a:b]
                    dk_rows = (d @ kc).view(h_i, b - a, -1)  # D_j k^I
                    q3 = qc.view(h_i, b - a, -1)
                    # Σ_s ∂L/∂I_s ReLU(q^I_j · k^I_s) = Σ_s D_j (q^I_j · k^I_s) = q^I_j · D_j k^I
                    dwi[c, :, a:b] = (q3 * dk_rows).sum(-1)
                    dqi[c, :, a:b] = dk_rows * w
                    dki[c, :end] += d.transpose(0, 1) @ (q3 * w).flatten(0, 1)
        dqi = dqi.transpose(1, 2).reshape(qi.shape)
        dwi = dwi.transpose(1, 2).reshape(wi.shape)
        return upstream, dqi, dwi, dki.view(ki.shape), None, None, None, None


@REGISTRY.register("deepseek_sparse")
class DeepSeekSparseAttention(HeadAttention):
    """DeepSeek Sparse Attention (module docstring), a causal per-head part
    ``part(q, k, v, *, mask, bias, need_weights, q_offset)`` with q (B, …, H, M, d),
    k (B, …, H, N, d), v (B, …, H, N, d_v): query i sits at position ``q_offset + i`` and reads
    its top-k keys among j ≤ q_offset + i. With k ≥ N it is full causal attention.

    Args:
        head_dim: d.
        top_k: keys per query (2048 in the paper).
        indexer_heads, indexer_dim: H^I and d^I of the lightning indexer.
        group_size: heads (consecutive at dim −3) that share their selection.
        indexer_loss_weight: λ of the indexer's KL loss (see the module docstring).
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})

    decodes_with_cache: ClassVar[bool] = True
    takes_q_offset: ClassVar[bool] = True
    takes_facts: ClassVar[bool] = True  # reads whether k and v are known finite
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(
        self,
        head_dim: int,
        *,
        top_k: int = 2048,
        indexer_heads: int = 4,
        indexer_dim: int = 16,
        group_size: int = 1,
        indexer_loss_weight: float = 1.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.top_k = arguments.positive_int(top_k, "top_k")
        self.group_size = arguments.positive_int(group_size, "group_size")
        arguments.positive_int(indexer_heads, "indexer_heads")  # named here, not as the
        arguments.positive_int(indexer_dim, "indexer_dim")  # indexer's num_heads/head_dim
        self.indexer_loss_weight = arguments.finite_float(
            indexer_loss_weight, "indexer_loss_weight", nonnegative=True
        )
        self.indexer = LightningIndexer(
            head_dim, indexer_heads, indexer_dim, device=device, dtype=dtype
        )
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (50, 51, 52))
        mask = torch.arange(7)[None, :] < torch.tensor([7, 5])[:, None]
        module = cls(4, top_k=3, indexer_heads=2, indexer_dim=3)
        return module, (q, k, v), {"mask": mask[:, None, None, :].expand(2, 2, 1, 7)}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.SPARSE]

    def index_scores(self, q: Tensor, k: Tensor) -> Tensor:
        """I (…, M, N) from the detached inputs, summed over each head group."""
        scores = self.indexer(q.detach(), k.detach())
        return group_sum(scores, self.group_size) if self.group_size > 1 else scores

    # The template's hole (attnkit.head.HeadAttention.forward validates, refuses by capability,
    # zeroes the keys no query attends and those that are not finite where a mask is given,
    # and reports the weights).
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
        need_weights: bool, q_offset: int = 0, checked: bool = False, finite: bool = False,
    ) -> AttentionOutput:  # fmt: skip
        arguments.nonnegative_int(q_offset, "q_offset")
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"DeepSeekSparseAttention(head_dim={self.head_dim}) got q {tuple(q.shape)}"
            )
        if self.group_size > 1 and (len(lead) < 1 or lead[-1] % self.group_size):
            raise ValueError(
                f"group_size={self.group_size} shares the selection among heads at dim -3, "
                f"which needs H divisible by it; got q {tuple(q.shape)}"
            )
        m, n = q.shape[-2], k.shape[-2]
        q, k, v = (x.broadcast_to(*lead, *x.shape[-2:]) for x in (q, k, v))
        rows = row_mask(mask, lead, m, n)
        pos = query_positions(m, q_offset, q.device)
        # keys after the last query are read by none (the template zeroed those no row of the
        # mask attends)
        k, v = sanitize(k, v, None, q_offset + m - 1)

        qi, wi, ki = self.indexer.project(q.detach(), k.detach())
        trains = any(x.requires_grad for x in (qi, wi, ki))
        trains = bool(self.indexer_loss_weight) and torch.is_grad_enabled() and trains
        align = self.align
        fast = (
            bias is None
            and not need_weights
            and type(align) is Softmax
            and align.fixed_temperature is not None
            and q.numel()
            and v.numel()
            # the tiles read keys a query may not attend with weight 0 (0 · NaN = NaN): keys
            # that are not finite take the per-query gathers (with a mask, the template has
            # zeroed every key that is not finite)
            and (finite or all_finite(k, v))
        )
        count = lead.numel()
        scale = 1.0 / math.sqrt(self.head_dim) / align.fixed_temperature if fast else 0.0
        if fast and not torch.is_grad_enabled() and fused_applies(q, v):
            # inference on the CPU: each chunk of queries is scored, selected as a mask over its
            # causal keys and attended at once (no (…, M, k) selection, no index list)
            context = self._infer(q, k, v, qi, wi, ki, rows, pos, scale)
            return AttentionOutput(context.view(*lead, m, v.shape[-1]), None)
        if fast and not torch.is_grad_enabled():
            # inference elsewhere: each block of queries is attended as soon as it is selected,
            # so that no (…, M, k) selection is held
            flat_k, flat_v = (x.reshape(count, *x.shape[-2:]) for x in (k, v))
            context = q.new_empty(count, m, v.shape[-1])
            # selection blocks gathered into runs of ~ATTEND_ELEMENTS selected keys
            rows_per_run = max(1, ATTEND_ELEMENTS // max(1, count * min(self.top_k, n)))
            run: list = []

            def attend(run: list) -> None:
                a, b = run[0][0].start, run[-1][0].stop
                keys_run, ok_run = (torch.cat([r[i] for r in run], -2) for i in (1, 2))
                qb = q[..., a:b, :].reshape(count, b - a, q.shape[-1])
                flat = (x.reshape(count, *x.shape[-2:]) for x in (keys_run, ok_run))
                part, _ = selected_softmax(qb, flat_k, flat_v, *flat, q_offset + a, scale)
                context[:, a:b] = part

            for block in self._select_blocks(qi, wi, ki, rows, pos):
                run.append(block)
                if block[0].stop - run[0][0].start >= rows_per_run:
                    attend(run)
                    run = []
            if run:
                attend(run)
            return AttentionOutput(context.view(*lead, m, v.shape[-1]), None)
        keys, ok, selected = self._select(qi, wi, ki, rows, pos, trains)  # (*lead, M, T)
        if fast:  # key-block tiles: no per-query gather; the weights only for the indexer's loss
            flat = (x.reshape(count, *x.shape[-2:]) for x in (q, k, v, keys, ok))
            context, w = selected_softmax(*flat, q_offset, scale, want_weights=trains)
            context = context.view(*lead, m, v.shape[-1])
            w = None if w is None else w.view(keys.shape)
        else:
            picked = None
            if bias is not None:
                picked = torch.gather(bias.broadcast_to(*lead, m, n), -1, keys).where(ok, 0.0)
            context, w = self._attend(q, k, v, keys, ok, picked)

        if trains:
            with torch.no_grad():
                grad = _indexer_gradient(selected, w.detach(), self.indexer_loss_weight)
            flat = (x.reshape(count, m, keys.shape[-1]) for x in (keys, grad))
            context = _TrainIndexer.apply(
                context, qi, wi, ki, *flat, self.group_size, int(pos[0]) if m else 0
            )

        dense = None
        if need_weights:
            dense = w.new_zeros(*lead, m, n).scatter_add(-1, keys, w)
        return AttentionOutput(context, dense)

    def _infer(
        self, q: Tensor, k: Tensor, v: Tensor, qi: Tensor, wi: Tensor, ki: Tensor,
        rows: Tensor | None, pos: Tensor, scale: float,
    ) -> Tensor:  # fmt: skip
        """Eq. 2 without autograd on the CPU -> context (count, M, d_v): per group of heads
        and chunk of queries, the group's index scores over the chunk's causal keys become
        the selection's additive mask in place (:func:`top_mask`) and each head of the group
        attends through PyTorch's fused kernel under it."""
        lead, m, n = q.shape[:-2], q.shape[-2], k.shape[-2]
        count, g = lead.numel(), self.group_size
        t = min(self.top_k, n)
        q3, k3, v3 = (x.reshape(count, *x.shape[-2:]) for x in (q, k, v))
        h_i = qi.shape[-2]
        qi_t = qi.reshape(count, m, h_i, qi.shape[-1]).transpose(1, 2)  # (count, H^I, M, d^I)
        wi_t = wi.reshape(count, m, h_i).transpose(1, 2).unsqueeze(-1)  # (count, H^I, M, 1)
        ki3 = ki.reshape(count, n, ki.shape[-1])
        heads = list(itertools.product(*(range(x) for x in lead)))
        columns = torch.arange(n, device=q.device)
        context = q.new_empty(count, m, v.shape[-1])
        q_offset = int(pos[0]) if m else 0
        for first_head in range(0, count, g):
            group = range(first_head, first_head + g)
            for a, b, end in fused_chunks(m, n, q_offset):
                total = None
                for c in group:
                    total = _head_scores(qi_t[c, :, a:b], wi_t[c, :, a:b], ki3[c, :end], total)
                # keys after a row's position are not available; with a mask, each head's own
                # (the group's sum then copied for every head but the last)
                first = 0 if rows is not None else min(end, int(pos[a]) + 1)
                late = columns[first:end] > pos[a:b, None]
                for i, c in enumerate(group if rows is not None else group[:1]):
                    index = total if i == len(group) - 1 or rows is None else total.clone()
                    banned = late
                    if rows is not None:
                        part = rows[heads[c]]
                        part = part[a:b, :end] if part.shape[0] == m else part[:, :end]
                        banned = late | ~part
                    index[:, first:].masked_fill_(banned, float("-inf"))
                    mask, has = top_mask(index, t)
                    for h in group if rows is None else (c,):
                        context[h, a:b] = masked_softmax(
                            q3[h, a:b], k3[h, :end], v3[h, :end], mask, has, scale
                        )
        return context

    def _select(
        self, qi: Tensor, wi: Tensor, ki: Tensor, rows: Tensor | None, pos: Tensor,
        values: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
        """Eq. 2's Top-k: the keys (*lead, M, T) of each query by the group-summed index scores
        among the keys it may attend, whether each is available, and with ``values`` the scores
        there (−inf where not available; else None). Evaluated in blocks of queries without
        autograd, so that only a block's (…, b, N) scores exist at a time."""
        lead, m, n = ki.shape[:-2], qi.shape[-3], ki.shape[-2]
        t = min(self.top_k, n)
        keys = torch.empty(*lead, m, t, dtype=torch.long, device=qi.device)
        ok = torch.empty(*lead, m, t, dtype=torch.bool, device=qi.device)
        picked = qi.new_empty(*lead, m, t) if values else None
        for sl, top, available, at in self._select_blocks(qi, wi, ki, rows, pos, values):
            keys[..., sl, :], ok[..., sl, :] = top, available
            if picked is not None:
                picked[..., sl, :] = at
        return keys, ok, picked

    def _select_blocks(
        self, qi: Tensor, wi: Tensor, ki: Tensor, rows: Tensor | None, pos: Tensor,
        values: bool = False,
    ):  # fmt: skip
        """:meth:`_select` a block of queries at a time: yields (rows slice, keys (*lead, b, T),
        available (*lead, b, T), the scores there or None), without autograd."""
        lead, m, n = ki.shape[:-2], qi.shape[-3], ki.shape[-2]
        count, g, h_i = lead.numel(), self.group_size, qi.shape[-2]
        t = min(self.top_k, n)
        columns = torch.arange(n, device=qi.device)
        step = max(1, min(m, INDEX_ELEMENTS // max(1, count * n)))
        with torch.no_grad():
            qi_t = qi.reshape(count, m, h_i, qi.shape[-1]).transpose(1, 2)  # (count, H^I, M, d^I)
            wi_t = wi.reshape(count, m, h_i).transpose(1, 2).unsqueeze(-1)  # (count, H^I, M, 1)
            ki3 = ki.reshape(count, n, ki.shape[-1])
        # queries that may read at most t keys (position < t) take all of them: keys 0 … t − 1
        # (those they may not read unavailable), the set a stable sort puts first
        short = max(0, min(m, t - int(pos[0]))) if m else 0
        starts = [*range(0, short, step), *range(short, m, step)]
        ends = [min(short, a + step) if a < short else min(m, a + step) for a in starts]
        for s, e in zip(starts, ends, strict=True):
            sl = slice(s, e)
            with torch.no_grad():
                # causal: the block's queries read no key after its last position
                end = max(t, min(n, int(pos[sl][-1]) + 1))
                index = qi.new_empty(count, e - s, end)
                for first_head in range(0, count, g):  # a group's sum, one copy per head
                    total = index[first_head]
                    for i, c in enumerate(range(first_head, first_head + g)):
                        _head_scores(qi_t[c, :, sl], wi_t[c, :, sl], ki3[c, :end], total, i > 0)
                    index[first_head + 1 : first_head + g] = total
                index = index.view(*lead, e - s, end)
                allowed = columns[:end] <= pos[sl, None]
                if rows is not None:
                    part = rows[..., sl, :] if rows.shape[-2] == m else rows
                    allowed = allowed & part[..., :end]
                allowed = allowed.broadcast_to(index.shape)
                if s < short:
                    top = columns[:t].expand(*index.shape[:-1], t)
                    available = allowed[..., :t] & (index[..., :t] > float("-inf"))
                else:
                    # the set, in any order (the attention and the indexer's loss read it so).
                    # Causal alone, the keys up to the block's first position are every row's:
                    # only the columns after it are masked, in place
                    # (with a mask every key a row may not read is at −inf: not available)
                    first = 0 if rows is not None else int(pos[sl][0]) + 1
                    index[..., first:].masked_fill_(~allowed[..., first:], float("-inf"))
                    top, at = top_set(index, t)
                    available = at > float("-inf")
                    yield sl, top, available, at
                    continue
                at = None
                if values:
                    at = torch.gather(index, -1, top).masked_fill_(~available, float("-inf"))
            yield sl, top, available, at

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, ok: Tensor, picked: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Eq. 2's attention over the selected keys -> context (*lead, M, d_v) and weights
        (*lead, M, T). With the softmax alignment (a fixed temperature τ folded into the scale
        and the bias), by :func:`gathered_softmax`: O(M·T·d) time, O(M·T) memory kept; with any
        other alignment (e.g. an ablation's), by gathering every query's keys at once."""
        scale = 1.0 / math.sqrt(self.head_dim)
        align = self.align
        if type(align) is Softmax and align.fixed_temperature is not None:
            tau = align.fixed_temperature
            if picked is not None and tau != 1.0:
                picked = picked / tau
            return gathered_softmax(q, k, v, keys, ok, scale / tau, picked)
        kg, vg = gather_keys(k, keys), gather_keys(v, keys)
        kg, vg = kg.where(ok[..., None], 0.0), vg.where(ok[..., None], 0.0)
        e = (q.unsqueeze(-2) * kg).sum(-1) * scale
        if picked is not None:
            e = e + picked
        w = align(e, ok).weights
        return (w.unsqueeze(-1) * vg).sum(-2), w

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, top_k={self.top_k}, group_size={self.group_size}, "
            f"indexer_loss_weight={self.indexer_loss_weight:g}"
        )
