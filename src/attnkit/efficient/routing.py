"""Routing attention (Roy, Saffar, Vaswani and Grangier, "Efficient Content-Based Sparse
Attention with Routing Transformers", TACL 2021; Soydaner 5.2): online k-means routes queries and
keys to clusters, and each query attends only to the keys of its own cluster.

Queries and keys are normalised to unit length for routing, q̂ = q/‖q‖, k̂ = k/‖k‖, and assigned to
the nearest centroid μ_c (the largest q̂·μ_c, i.e. the smallest ‖q̂ − μ_c‖ for unit vectors).
Query i attends key j iff c(q_i) = c(k_j) (with the scores and softmax of scaled dot-product
attention on the unnormalised q, k). In training the centroids follow the vectors routed to them
by an exponential moving average (the paper's online mini-batch k-means),

    μ_c ← λ μ_c + (1 − λ) · mean{x̂ routed to c},    then μ_c ← μ_c / ‖μ_c‖,

computed without gradients. A query whose cluster holds no key gets weights 0 and context 0.
This nearest-centroid form (``balanced=False``) is evaluated densely under the routing mask
(exact; its clusters have unequal sizes).

**Balanced routing** (``balanced=True``, the form the paper evaluates): every cluster takes the
k = ⌈n / C⌉ queries and the k keys nearest its centroid (top-k of q̂·μ_c over the n real
queries, and of k̂·μ_c over the real keys), so clusters have equal sizes, a token may sit in
several clusters or in none, and attention is computed per cluster on the gathered blocks,

    X'_i = mean over the clusters c holding query i of Σ_{j ∈ K_c} softmax_j(q_i·k_j/√d) v_j,

at cost C·k_q·k_k·d ≈ M·N·d / C: it falls as the number of clusters grows. A query in no
cluster (or whose clusters hold no key it may attend) gets weights 0 and context 0. Which tokens
a cluster takes reads every query and key, so the balanced form does not decode step by step
(and a causal mask restricts attention inside the clusters only, as in the paper's language
models).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.core import Attention
from attnkit.efficient.gather import pairs
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["RoutingAttention"]


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


@REGISTRY.register("routing")
@arguments.deprecated_names(d="head_dim")
class RoutingAttention(HeadAttention):
    """Routing Transformer attention, a per-head part ``part(q, k, v, *, mask, bias,
    need_weights)`` with q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v).

    Args:
        head_dim: d, the query/key size (of the centroids); ``d=`` is its old name, accepted
            with a DeprecationWarning until the next release.
        n_clusters: number of k-means centroids (1 gives full attention).
        decay: λ of the centroids' moving average, in [0, 1).
        seed: seed of the initial (random unit) centroids.
        balanced: route by balanced top-k (each cluster takes its ⌈n/C⌉ nearest queries and
            keys, attention on the gathered blocks) instead of by nearest centroid.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})

    # in training the centroids move with every real query: a padded query must be named as
    # one (an all-False mask row), which multi-head self-attention does for key padding
    mixes_queries: ClassVar[bool] = True

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(
        self,
        head_dim: int,
        n_clusters: int = 4,
        *,
        decay: float = 0.999,
        seed: int = 0,
        balanced: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(head_dim, "head_dim")
        arguments.positive_int(n_clusters, "n_clusters")
        arguments.nonnegative_int(seed, "seed")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise ValueError(f"decay must be a number in [0, 1), got {decay!r}")
        self.head_dim, self.n_clusters, self.decay = head_dim, n_clusters, float(decay)
        self.balanced = arguments.boolean(balanced, "balanced")
        g = torch.Generator().manual_seed(seed)
        centroids = _unit(torch.randn(n_clusters, head_dim, generator=g))
        self.register_buffer("centroids", centroids.to(device=device, dtype=dtype))
        self.attention = Attention("scaled_dot", "softmax")
        self.align = Softmax()

    @property
    def decodes_with_cache(self) -> bool:
        """A step equals its causal rows under nearest-centroid routing; balanced routing
        chooses a cluster's members among all tokens."""
        return not self.balanced

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (4, 5, 6))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(4, n_clusters=2), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.AlignmentKind.SPARSE]

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, n_clusters={self.n_clusters}, decay={self.decay}, "
            f"balanced={self.balanced}"
        )

    def route(self, x: Tensor) -> Tensor:
        """The cluster (…, L) of each vector of x (…, L, d): its nearest centroid."""
        return (_unit(x) @ self.centroids.to(x.dtype).T).argmax(-1)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"RoutingAttention(head_dim={self.head_dim}) got q with {q.shape[-1]} features"
            )
        cq, ck = self.route(q), self.route(k)
        if self.balanced:
            context, weights = self._balanced(q, k, v, mask, bias, need_weights)
            if self.training:
                self._update(q, k, cq, ck, mask)
            return AttentionOutput(context, weights)
        if self.training:
            self._update(q, k, cq, ck, mask)
        same = cq.unsqueeze(-1) == ck.unsqueeze(-2)  # (…, M, N): the routing mask
        full_mask = same if mask is None else same & mask
        out = self.attention(q, k, v, mask=full_mask, bias=bias, need_weights=need_weights)
        return AttentionOutput(out.context, out.weights if need_weights else None)

    @torch.no_grad()
    def _update(self, q: Tensor, k: Tensor, cq: Tensor, ck: Tensor, mask: Tensor | None) -> None:
        """μ_c ← λ μ_c + (1 − λ) mean of the unit vectors routed to c (real queries and keys
        only)."""
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        q, k = q.broadcast_to(*lead, *q.shape[-2:]), k.broadcast_to(*lead, *k.shape[-2:])
        cq, ck = cq.broadcast_to(q.shape[:-1]), ck.broadcast_to(k.shape[:-1])
        x = [_unit(q).reshape(-1, self.head_dim), _unit(k).reshape(-1, self.head_dim)]
        c = [cq.reshape(-1), ck.reshape(-1)]
        if mask is not None:  # padding (a key no query may attend, a query that may attend
            # no key) does not move the centroids, whatever it holds
            full = mask.broadcast_to(*lead, q.shape[-2], k.shape[-2])
            for i, ok in enumerate((full.any(-1), full.any(-2))):
                x[i], c[i] = x[i][ok.reshape(-1)], c[i][ok.reshape(-1)]
        x, c = torch.cat(x), torch.cat(c)
        sums = torch.zeros_like(self.centroids).index_add_(0, c, x.to(self.centroids.dtype))
        counts = torch.bincount(c, minlength=self.n_clusters).to(sums.dtype)[:, None]
        moved = self.decay * self.centroids + (1 - self.decay) * sums / counts.clamp_min(1)
        self.centroids.copy_(torch.where(counts > 0, _unit(moved), self.centroids))

    def _balanced(self, q, k, v, mask, bias, need_weights):
        """Balanced top-k routing: per cluster the ⌈n/C⌉ nearest real queries and keys,
        attention inside each gathered block, contexts averaged over a query's clusters."""
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        m, n, c, nl = q.shape[-2], k.shape[-2], self.n_clusters, len(lead)
        q, k = q.broadcast_to(*lead, m, q.shape[-1]), k.broadcast_to(*lead, n, k.shape[-1])
        v = v.broadcast_to(*lead, n, v.shape[-1])
        mu = self.centroids.to(q.dtype)
        if mask is None:
            q_ok = torch.ones(*lead, m, dtype=torch.bool, device=q.device)
            k_ok = torch.ones(*lead, n, dtype=torch.bool, device=q.device)
        else:  # padding: a query that may attend no key, a key no query may attend
            full = mask.broadcast_to(*lead, m, n)
            q_ok, k_ok = full.any(-1), full.any(-2)
        members = []
        for x, ok in ((q, q_ok), (k, k_ok)):
            near = (_unit(x) @ mu.T).transpose(-1, -2)  # (*L, C, L_x): affinity to each centroid
            near = near.detach().masked_fill(~ok.unsqueeze(-2), float("-inf"))
            size = (ok.sum(-1) + c - 1) // c  # ⌈n/C⌉ per item
            top = int(size.max()) if size.numel() else 0
            index = near.topk(max(top, 1), dim=-1).indices  # (*L, C, k)
            slot_ok = torch.arange(index.shape[-1], device=q.device) < size[..., None, None]
            members.append((index, slot_ok))
        (qi, q_slot), (ki, k_slot) = members
        qg = q.gather(-2, qi.flatten(-2)[..., None].expand(*qi.shape[:-2], -1, q.shape[-1]))
        kg = k.gather(-2, ki.flatten(-2)[..., None].expand(*ki.shape[:-2], -1, k.shape[-1]))
        vg = v.gather(-2, ki.flatten(-2)[..., None].expand(*ki.shape[:-2], -1, v.shape[-1]))
        qg, kg, vg = (t.unflatten(-2, (c, -1)) for t in (qg, kg, vg))  # (*L, C, k, ·)
        allowed = q_slot[..., :, None] & k_slot[..., None, :]  # (*L, C, k_q, k_k)
        rows, cols = qi[..., :, None], ki[..., None, :]
        if mask is not None:
            allowed = allowed & pairs(mask, rows, cols, nl)
        scores = torch.einsum("...xd,...yd->...xy", qg, kg) / q.shape[-1] ** 0.5
        if bias is not None:
            scores = scores + pairs(bias, rows, cols, nl)
        allowed = allowed.broadcast_to(scores.shape)
        weights = self.align(scores, allowed).weights  # (*L, C, k_q, k_k)
        held = (allowed.any(-1) & q_slot).to(q.dtype)  # a query's clusters that give it keys
        share = held.new_zeros(*lead, m).scatter_add(-1, qi.flatten(-2), held.flatten(-2))
        share = 1 / share.clamp_min(1)  # 1 / (number of clusters averaged) per query
        weights = (
            weights
            * held[..., None]
            * share.gather(-1, qi.flatten(-2)).unflatten(-1, (c, -1))[..., None]
        )
        out = torch.einsum("...xy,...yd->...xd", weights, vg).flatten(-3, -2)
        index = qi.flatten(-2)[..., None].expand(*lead, -1, v.shape[-1])
        context = out.new_zeros(*lead, m, v.shape[-1]).scatter_add(-2, index, out)
        dense = None
        if need_weights:
            flat = (qi[..., :, None] * n + ki[..., None, :]).flatten(-3)
            dense = weights.new_zeros(*lead, m * n).scatter_add(-1, flat, weights.flatten(-3))
            dense = dense.unflatten(-1, (m, n))
        return context, dense
