"""Reformer's LSH attention (Kitaev, Kaiser and Levskaya, 2020; Brauwers 3.1 and Soydaner 5.2 on
the Reformer): queries attend only to keys hashed into the same bucket, found by sorting by bucket
and attending within a chunk and the chunk before it; several hash rounds are combined exactly.

Hashing is angular LSH with a random rotation R (d × b/2): h(x) = argmax([xR ; −xR]) (Reformer
eq. 2 of Sec. 2). Round r gives each query i a set P_i^(r) = {j : h_r(q_i) = h_r(k_j), j sorted
into the same chunk as i or the one before}. The rounds are combined as attention over the union
P_i = ∪_r P_i^(r) (Reformer eq. 4 and its appendix): each round is normalised on its own (its log
normaliser z_r), a pair attended in n_ij rounds has its logit lowered by log n_ij, and the rounds
are mixed with weights exp(z_r − z). So the result is softmax attention restricted to P_i
exactly, and it approaches full attention as more rounds cover more pairs.

Shared QK (``k=None``): keys are the normalised queries k_j = q_j / ‖q_j‖ and a position does not
attend to itself unless it has no other key (its logit is lowered by 10⁵, as the paper does).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.efficient._shared import masked_logsumexp
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.kernels.base import guarded_sum
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["LSHAttention"]

_SELF_PENALTY = 1e5  # Reformer: a position attends to itself only when nothing else is there


def _rows(x: Tensor | None, lead: torch.Size, m: int, n: int) -> Tensor | None:
    """A mask or bias broadcast to (Z, M' , N) with M' = 1 when it does not vary over queries."""
    if x is None:
        return None
    rows = m if x.dim() >= 2 and x.shape[-2] == m and m != 1 else 1
    return x.broadcast_to(*lead, m, n)[..., :rows, :].reshape(-1, rows, n)


def _pairs(x: Tensor, qi: Tensor, kj: Tensor) -> Tensor:
    """x (Z, M', N) at pairs (qi[..., :, None], kj[..., None, :]), qi (Z, C, c), kj (Z, C, w)."""
    rows, n = x.shape[1:]
    i = qi if rows > 1 else torch.zeros_like(qi)
    index = (i[..., :, None] * n + kj[..., None, :]).flatten(1)
    return x.flatten(1).gather(1, index).reshape(*kj.shape[:2], qi.shape[-1], kj.shape[-1])


@REGISTRY.register("lsh")
@arguments.deprecated_names(d="head_dim")
class LSHAttention(HeadAttention):
    """Reformer LSH attention, a per-head part: ``part(q, k, v, *, mask, bias, need_weights)``
    with q (B, …, M, d), k (B, …, N, d) or None (shared QK: k_j = q_j / ‖q_j‖), v (B, …, N, d_v).

    Args:
        head_dim: d, the query/key size (the rotations are d × n_buckets/2); ``d=`` is its
            old name, accepted with a DeprecationWarning until the next release.
        n_buckets: number of hash buckets, 1 or even.
        n_rounds: hash rounds (each with its own rotation).
        chunk_size: length c of the chunks of the bucket-sorted sequence; a query attends keys of
            its own bucket in its chunk and the chunk before it.
        seed: seed of the rotations drawn at construction. In training mode fresh rotations are
            drawn on every call (as the paper); in eval mode the stored ones are used, so results
            are reproducible.

    A key that no query may attend and a query that may attend no key (padding) are sorted
    after all others, so padding equals truncation (for padded self-attention pass the mask
    (B, N, N) = key padding ∧ query padding). Any boolean mask and float bias (…, M, N) are
    honoured on the pairs.
    Weights (B, …, M, N) are the exact weights of the union of the rounds; they are formed
    densely only when requested or captured.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    takes_facts: ClassVar[bool] = True  # values known finite are not scanned

    def __init__(
        self,
        head_dim: int,
        n_buckets: int = 8,
        n_rounds: int = 2,
        chunk_size: int = 32,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(head_dim, "head_dim")
        arguments.positive_int(n_buckets, "n_buckets")
        arguments.positive_int(n_rounds, "n_rounds")
        arguments.positive_int(chunk_size, "chunk_size")
        arguments.nonnegative_int(seed, "seed")
        if n_buckets > 1 and n_buckets % 2:
            raise ValueError(
                f"n_buckets must be 1 or even (angular LSH hashes to argmax over [xR; −xR]), "
                f"got {n_buckets}"
            )
        self.head_dim, self.n_buckets = head_dim, n_buckets
        self.n_rounds, self.chunk_size = n_rounds, chunk_size
        g = torch.Generator().manual_seed(seed)
        rot = torch.randn(n_rounds, head_dim, max(n_buckets // 2, 1), generator=g)
        self.register_buffer("rotations", rot.to(device=device, dtype=dtype))
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (1, 2, 3))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(
            2, 2, 1, 7
        )  # (B, H, 1, N)
        return cls(4, n_buckets=2, n_rounds=2, chunk_size=3), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.SPARSE]

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, n_buckets={self.n_buckets}, n_rounds={self.n_rounds}, "
            f"chunk_size={self.chunk_size}"
        )

    def hash(self, x: Tensor, rotations: Tensor | None = None) -> Tensor:
        """Buckets (n_rounds, …, L) of x (…, L, d): argmax([xR ; −xR]) per round."""
        rot = self.rotations if rotations is None else rotations
        if self.n_buckets == 1:
            return torch.zeros(rot.shape[0], *x.shape[:-1], dtype=torch.long, device=x.device)
        proj = torch.einsum("...ld,rdb->r...lb", x, rot.to(x.dtype))
        return torch.cat([proj, -proj], -1).argmax(-1)

    # The template's holes (attnkit.head.HeadAttention.forward validates, refuses by
    # capability, zeroes the keys no query attends and, with a mask, those that are not
    # finite, and reports the weights).

    def keys_and_values(self, q, k, v):
        """Shared QK (``k=None``): the keys are the normalised queries k_j = q_j / ‖q_j‖ (and
        the values the keys when ``v`` is None too); :meth:`attend` is told ``shared``."""
        shared = k is None
        if shared and isinstance(q, Tensor) and q.dim() >= 1 and q.is_floating_point():
            k = q / q.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
        v = k if v is None else v
        if (
            shared
            and isinstance(q, Tensor)
            and isinstance(v, Tensor)
            and min(q.dim(), v.dim()) >= 2
            and q.shape[-2] != v.shape[-2]
        ):
            raise ValueError(
                f"LSHAttention with shared QK (k=None) needs v with one row per query: q "
                f"{tuple(q.shape)}, v {tuple(v.shape)}"
            )
        return k, v, {"shared": shared}

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
        need_weights: bool, shared: bool = False, checked: bool = False, finite: bool = False,
    ) -> AttentionOutput:  # fmt: skip
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"LSHAttention(head_dim={self.head_dim}) got q with {q.shape[-1]} features"
            )
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        m, n, d = q.shape[-2], k.shape[-2], q.shape[-1]
        qz = q.broadcast_to(*lead, m, d).reshape(-1, m, d)
        kz = k.broadcast_to(*lead, n, d).reshape(-1, n, d)
        vz = v.broadcast_to(*lead, n, v.shape[-1]).reshape(-1, n, v.shape[-1])
        maskz, biasz = _rows(mask, lead, m, n), _rows(bias, lead, m, n)
        rot = self.rotations
        if self.training:
            rot = torch.randn(rot.shape, device=rot.device, dtype=rot.dtype)
        if qz.shape[0] == 0:  # an empty batch: nothing to hash (shapes of 0 elements are ambiguous)
            context = qz.new_zeros(0, m, v.shape[-1])
            weights = qz.new_zeros(0, m, n) if need_weights else None
        else:
            context, weights = self._attend(
                qz, kz, vz, maskz, biasz, rot, shared, need_weights, finite
            )
        context = context.reshape(*lead, m, v.shape[-1])
        if weights is not None:
            weights = weights.reshape(*lead, m, n)
        return AttentionOutput(context, weights)

    def _attend(self, q, k, v, mask, bias, rot, shared, need_weights, finite=False):
        if mask is None and bias is None and not need_weights:
            fast = _attend_unmasked(self, q, k, v, rot, shared, finite)
            if fast is not None:
                return fast, None
        z, m, n = q.shape[0], q.shape[1], k.shape[1]
        c, rounds, dev = self.chunk_size, rot.shape[0], q.device
        n_chunks = -(-m // c)
        width = n_chunks * c
        key_ok = torch.ones(z, n, dtype=torch.bool, device=dev)
        query_ok = torch.ones(z, m, dtype=torch.bool, device=dev)
        if mask is not None:
            # keys no query may attend and queries that may attend no key are padding: they
            # are sorted after all others, so that padding equals truncation
            key_ok = mask.any(1)
            query_ok = mask.any(2).expand(z, m)
        bq, bk = self.hash(q, rot), self.hash(k, rot)  # (R, Z, M), (R, Z, N)
        bq = torch.where(query_ok, bq, self.n_buckets)
        bk = torch.where(key_ok, bk, self.n_buckets)
        pos_q = torch.arange(m, device=dev)
        pos_k = torch.arange(n, device=dev)
        q_order = (bq * m + pos_q).argsort(-1)  # stable by position within a bucket
        k_order = (bk * n + pos_k).argsort(-1)
        # rank → chunk id of every position, for counting in how many rounds a pair is attended
        q_chunk = torch.empty_like(q_order).scatter_(-1, q_order, pos_q.expand_as(q_order) // c)
        k_chunk = torch.empty_like(k_order).scatter_(-1, k_order, pos_k.expand_as(k_order) // c)

        def padded(order, length):
            real = torch.arange(width, device=dev) < length
            order = F.pad(order, (0, max(width - length, 0)))[..., :width]
            return order, real.expand_as(order)

        qo, q_real = padded(q_order, m)  # (R, Z, W)
        ko, k_real = padded(k_order, n)
        qi = qo.reshape(rounds, z, n_chunks, c)
        kc = ko.reshape(rounds, z, n_chunks, c)
        kc_real = k_real.reshape(rounds, z, n_chunks, c)
        first = torch.zeros_like(kc[:, :, :1])
        # keys of the chunk before (none before the first chunk) and of the own chunk
        kj = torch.cat([torch.cat([first, kc[:, :, :-1]], 2), kc], -1)  # (R, Z, C, 2c)
        before = torch.cat([torch.zeros_like(kc_real[:, :, :1]), kc_real[:, :, :-1]], 2)
        kj_real = torch.cat([before, kc_real], -1)

        scale = q.shape[-1] ** -0.5
        probs, lse, ctx = [], [], []
        for r in range(rounds):
            qr = q.gather(1, qi[r].flatten(1)[..., None].expand(-1, -1, q.shape[-1]))
            qr = qr.unflatten(1, (n_chunks, c))
            kr = k.gather(1, kj[r].flatten(1)[..., None].expand(-1, -1, k.shape[-1]))
            kr = kr.unflatten(1, (n_chunks, 2 * c))
            vr = v.gather(1, kj[r].flatten(1)[..., None].expand(-1, -1, v.shape[-1]))
            vr = vr.unflatten(1, (n_chunks, 2 * c))
            e = torch.einsum("zcid,zcjd->zcij", qr, kr) * scale
            qb = bq[r].gather(1, qi[r].flatten(1)).reshape(z, n_chunks, c)
            kb = bk[r].gather(1, kj[r].flatten(1)).reshape(z, n_chunks, 2 * c)
            ok = (qb[..., :, None] == kb[..., None, :]) & kj_real[r][..., None, :]
            ok = ok & q_real[r].reshape(z, n_chunks, c)[..., :, None]
            ok = ok & key_ok.gather(1, kj[r].flatten(1)).reshape(z, n_chunks, 1, 2 * c)
            if mask is not None:
                ok = ok & _pairs(mask, qi[r], kj[r])
            if bias is not None:
                e = e + _pairs(bias, qi[r], kj[r])
            if shared:
                e = e - _SELF_PENALTY * (qi[r][..., :, None] == kj[r][..., None, :]).to(e.dtype)
            # n_ij: the rounds s in which j is in i's bucket and in i's chunk or the one before
            n_ij = torch.zeros_like(e)
            for s in range(rounds):
                same = bq[s].gather(1, qi[r].flatten(1)).reshape(z, n_chunks, c, 1) == bk[s].gather(
                    1, kj[r].flatten(1)
                ).reshape(z, n_chunks, 1, 2 * c)
                cq = q_chunk[s].gather(1, qi[r].flatten(1)).reshape(z, n_chunks, c, 1)
                ck = k_chunk[s].gather(1, kj[r].flatten(1)).reshape(z, n_chunks, 1, 2 * c)
                n_ij = n_ij + (same & ((ck == cq) | (ck == cq - 1))).to(e.dtype)
            e = e - torch.where(ok, n_ij, 1.0).log()
            p = self.align(e, ok).weights  # softmax within the round's set
            lse.append(masked_logsumexp(e, ok, -1))  # the round's log normaliser z_r (Z, C, c)
            # padded values are zeroed (0 × NaN would leak into the sum)
            v_ok = key_ok.gather(1, kj[r].flatten(1)).reshape(z, n_chunks, 2 * c, 1)
            vr = torch.where(kj_real[r][..., None] & v_ok, vr, 0.0)
            if not finite:
                # a value in another bucket may hold NaN or inf: it must not reach the rows
                # that give it weight 0 (finite: stated by the caller, or with a mask the
                # template zeroed every such value)
                ctx.append(guarded_sum(_weighted, p, vr))
            else:
                ctx.append(_weighted(p, vr))
            probs.append(p)
        # queries are in a different order in every round: un-sort each round's normaliser and
        # context back to positions (the first m sorted entries are the real queries), then mix
        inverse = q_order.argsort(-1)  # (R, Z, M)
        z_pos = torch.stack(
            [lse[r].reshape(z, width)[:, :m].gather(1, inverse[r]) for r in range(rounds)]
        )
        c_pos = torch.stack(
            [
                ctx[r]
                .reshape(z, width, v.shape[-1])[:, :m]
                .gather(1, inverse[r][..., None].expand(-1, -1, v.shape[-1]))
                for r in range(rounds)
            ]
        )
        has = torch.isfinite(z_pos)
        total = masked_logsumexp(z_pos, has, 0)  # log normaliser over the union of the rounds
        mix = torch.where(has, (z_pos - torch.where(has, total, 0.0)).exp(), 0.0)  # (R, Z, M)
        out = (mix[..., None] * c_pos).sum(0)
        weights = None
        if need_weights:
            weights = q.new_zeros(z, m * n)
            for r in range(rounds):
                mix_sorted = F.pad(mix[r].gather(1, q_order[r]), (0, width - m))
                w = mix_sorted.reshape(z, n_chunks, c, 1) * probs[r]  # (Z, C, c, 2c)
                index = qi[r][..., :, None] * n + kj[r][..., None, :]
                weights = weights.scatter_add(1, index.flatten(1), w.flatten(1))
            weights = weights.reshape(z, m, n)
        return out, weights


def _weighted(p: Tensor, v: Tensor) -> Tensor:
    return torch.einsum("zcij,zcjd->zcid", p, v)


def _sorted(bucket: Tensor, length: int) -> Tensor:
    """The order (…, L) that sorts positions by (bucket, position)."""
    pos = torch.arange(length, device=bucket.device)
    return (bucket * length + pos).argsort(-1)


def _attend_unmasked(
    part: LSHAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rot: Tensor,
    shared: bool,
    finite: bool = False,
) -> Tensor | None:
    """The context of :meth:`LSHAttention._attend` without mask, bias or weights, each round's
    chunk attention in one autograd node (:class:`_Round`) that keeps only its weights: the
    same pairs and logits, a few passes over the (Z, C, c, 2c) score tile instead of one per
    mask and correction. None (use the general path) when a value is not finite (not looked
    for when ``finite``: the caller stated so), or with
    shared QK when the keys sort differently from the queries (rounding in a near tie)."""
    if not finite and not bool(torch.isfinite(v).all()):
        return None  # weight 0 must mean no influence: the general path guards the sums
    z, m, n, d = q.shape[0], q.shape[1], k.shape[1], q.shape[-1]
    c, rounds = part.chunk_size, rot.shape[0]
    n_chunks = -(-m // c)
    width = n_chunks * c
    bq, bk = part.hash(q, rot), part.hash(k, rot)  # (R, Z, M), (R, Z, N)
    q_order, k_order = _sorted(bq, m), _sorted(bk, n)
    self_diag = shared and m == n and torch.equal(q_order, k_order)
    if shared and not self_diag:
        return None
    dev = q.device
    slot_q = F.pad(q_order, (0, width - m))  # (R, Z, W) position in each sorted slot
    # keys: one chunk of padding in front (the chunk before the first), then the sorted keys
    slot_k = F.pad(k_order, (c, max(width - n, 0)))[..., : width + c]
    real_k = F.pad(torch.ones(n, dtype=torch.bool, device=dev), (c, max(width - n, 0)))
    real_k = real_k[: width + c]
    base_q = (torch.arange(z, device=dev) * m)[:, None]
    base_k = (torch.arange(z, device=dev) * n)[:, None]
    window = torch.arange(2 * c, device=dev) + torch.arange(n_chunks, device=dev)[:, None] * c
    kj = slot_k[..., window]  # (R, Z, C, 2c): the keys of the chunk before and of the own chunk
    kj_real = real_k[window]  # (C, 2c)
    flat_q, flat_k, flat_v = q.reshape(z * m, d), k.reshape(z * n, d), v.reshape(z * n, -1)
    codes = None
    if rounds > 1:  # (bucket, chunk) per position and round, for n_ij
        chunk_q = torch.empty_like(q_order).scatter_(
            -1, q_order, torch.arange(m, device=dev).expand_as(q_order) // c
        )
        chunk_k = torch.empty_like(k_order).scatter_(
            -1, k_order, torch.arange(n, device=dev).expand_as(k_order) // c
        )
        span = n_chunks + 2
        codes = ((bq * span + chunk_q).to(q.dtype), (bk * span + chunk_k).to(q.dtype))
    scale = d**-0.5
    contexts, lses = [], []
    for r in range(rounds):
        qi = (slot_q[r] + base_q).flatten()
        ki = (kj[r] + base_k[:, :, None]).flatten()
        qs = flat_q.index_select(0, qi).view(z, n_chunks, c, d) * scale
        ks = flat_k.index_select(0, ki).view(z, n_chunks, 2 * c, d)
        vs = flat_v.index_select(0, ki).view(z, n_chunks, 2 * c, -1)
        sq = bq[r].gather(1, slot_q[r]).view(z, n_chunks, c, 1)
        sk = bk[r].gather(1, kj[r].flatten(1)).view(z, n_chunks, 1, 2 * c)
        ok = (sq == sk) & kj_real[:, None, :]
        if width > m:  # padded query slots attend every key (their rows are dropped)
            ok[:, -1, c - (width - m) :] = True
        log_n = None
        if codes is not None:
            count = None
            for s in range(rounds):
                if s == r:
                    continue
                cq = codes[0][s].gather(1, slot_q[r]).view(z, n_chunks, c, 1)
                ck = codes[1][s].gather(1, kj[r].flatten(1)).view(z, n_chunks, 1, 2 * c)
                gap = cq - ck  # 0 or 1: the same bucket, in the chunk or the one after
                hit = (gap == 0) | (gap == 1)
                count = hit.to(q.dtype) if count is None else count + hit
            log_n = torch.log1p(count)
        ctx, lse = _Round.apply(qs, ks, vs, ok, log_n, self_diag, rounds > 1)
        contexts.append(ctx.reshape(z, width, -1)[:, :m])
        lses.append(None if lse is None else lse.reshape(z, width)[:, :m])
    inverse = q_order.argsort(-1)  # (R, Z, M) sorted slot of each position
    if rounds == 1:
        return _unsort(contexts[0], inverse[0])
    c_pos = torch.stack([_unsort(contexts[r], inverse[r]) for r in range(rounds)])
    z_pos = torch.stack([lses[r].gather(1, inverse[r]) for r in range(rounds)])
    has = torch.isfinite(z_pos)
    total = masked_logsumexp(z_pos, has, 0)
    mix = torch.where(has, (z_pos - torch.where(has, total, 0.0)).exp(), 0.0)  # (R, Z, M)
    return (mix[..., None] * c_pos).sum(0)


def _unsort(x: Tensor, inverse: Tensor) -> Tensor:
    """Rows of x (Z, M, e) in sorted order back to positions (``inverse``: (Z, M))."""
    z, m, e = x.shape
    flat = (inverse + (torch.arange(z, device=x.device) * m)[:, None]).flatten()
    return x.reshape(z * m, e).index_select(0, flat).view(z, m, e)


def _round_weights(qs: Tensor, ks: Tensor, ok: Tensor, log_n: Tensor | None, self_diag: bool):
    """Weights (…, c, 2c) of one round's chunks and whether each row has a key: scores
    qs ksᵀ (qs scaled), lowered by log n_ij and, for shared QK, by the self penalty on the own
    chunk's diagonal, softmax over the allowed pairs."""
    e = qs @ ks.transpose(-1, -2)
    if log_n is not None:
        e = e - log_n
    if self_diag:
        c = qs.shape[-2]
        penalty = torch.zeros(c, 2 * c, dtype=e.dtype, device=e.device)
        penalty[:, c:].fill_diagonal_(_SELF_PENALTY)
        e = e - penalty
    e = torch.where(ok, e, torch.finfo(e.dtype).min)
    return e, torch.softmax(e, -1)


class _Round(torch.autograd.Function):
    """One hash round's chunk attention: context (…, c, d_v) and, when asked, the log
    normaliser (…, c) (−inf for a row with no key); keeps only the weights for backward."""

    @staticmethod
    def forward(ctx, qs, ks, vs, ok, log_n, self_diag, want_lse):
        with torch.no_grad():
            e, p = _round_weights(qs, ks, ok, log_n, self_diag)
            has = ok.any(-1, keepdim=True)
            if not bool(has.all()):  # a query with no key in its round: context 0
                p = p.masked_fill(~has, 0)
            lse = None
            if want_lse:
                top = e.amax(-1)
                lse = torch.where(has.squeeze(-1), top - p.amax(-1).log(), -torch.inf)
            out = p @ vs
        ctx.save_for_backward(qs, ks, vs, p, out)
        ctx.round = (ok, log_n, self_diag)
        if lse is None:
            return out, None
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        qs, ks, vs, p, out = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiate a recomputation
            return (*_round_grads(ctx, qs, ks, vs, d_out, d_lse), None, None, None, None)
        delta = (d_out * out).sum(-1, keepdim=True)
        if d_lse is not None:
            delta = delta - d_lse.unsqueeze(-1)
        de = (d_out @ vs.transpose(-1, -2)).sub_(delta).mul_(p)
        d_qs = de @ ks if ctx.needs_input_grad[0] else None
        d_ks = de.transpose(-1, -2) @ qs if ctx.needs_input_grad[1] else None
        d_vs = p.transpose(-1, -2) @ d_out if ctx.needs_input_grad[2] else None
        return d_qs, d_ks, d_vs, None, None, None, None


def _round_grads(ctx, qs, ks, vs, d_out, d_lse):
    """Gradients of a round with their own graph (for second derivatives)."""
    ok, log_n, self_diag = ctx.round
    inputs = [qs, ks, vs]  # as saved: connected to the graph of the forward pass
    with torch.enable_grad():
        e, p = _round_weights(*inputs[:2], ok, log_n, self_diag)
        has = ok.any(-1, keepdim=True)
        p = torch.where(has, p, 0)
        outs, grads = [p @ inputs[2]], [d_out]
        if d_lse is not None:
            lse = torch.logsumexp(e, -1)
            outs.append(torch.where(has.squeeze(-1), lse, 0))
            grads.append(d_lse)
        wanted = [x for x in inputs if x.requires_grad]
        found = iter(torch.autograd.grad(outs, wanted, grads, create_graph=True, allow_unused=True))
    return [next(found) if x.requires_grad else None for x in inputs]
