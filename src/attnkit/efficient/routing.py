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
The attention is evaluated densely under the routing mask here (exact; a sorted, block-sparse
evaluation would make its cost follow the clusters' sizes).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.attention import Attention
from attnkit.efficient.lsh import HeadOutput, check_head_inputs
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["RoutingAttention"]


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


@REGISTRY.register("routing")
class RoutingAttention(nn.Module):
    """Routing Transformer attention, a per-head part ``part(q, k, v, *, mask, bias,
    need_weights)`` with q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v).

    Args:
        d: query/key size (of the centroids).
        n_clusters: number of k-means centroids (1 gives full attention).
        decay: λ of the centroids' moving average, in [0, 1).
        seed: seed of the initial (random unit) centroids.
    """

    decodes_with_cache: ClassVar[bool] = True  # a step equals its causal rows
    # in training the centroids move with every real query: a padded query must be named as
    # one (an all-False mask row), which multi-head self-attention does for key padding
    mixes_queries: ClassVar[bool] = True

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(
        self,
        d: int,
        n_clusters: int = 4,
        *,
        decay: float = 0.999,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(d, "d")
        arguments.positive_int(n_clusters, "n_clusters")
        arguments.nonnegative_int(seed, "seed")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise ValueError(f"decay must be a number in [0, 1), got {decay!r}")
        self.d, self.n_clusters, self.decay = d, n_clusters, float(decay)
        g = torch.Generator().manual_seed(seed)
        centroids = _unit(torch.randn(n_clusters, d, generator=g))
        self.register_buffer("centroids", centroids.to(device=device, dtype=dtype))
        self.attention = Attention("scaled_dot", "softmax")

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (4, 5, 6))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(4, n_clusters=2), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.AlignmentKind.SPARSE]

    def extra_repr(self) -> str:
        return f"d={self.d}, n_clusters={self.n_clusters}, decay={self.decay}"

    def route(self, x: Tensor) -> Tensor:
        """The cluster (…, L) of each vector of x (…, L, d): its nearest centroid."""
        return (_unit(x) @ self.centroids.to(x.dtype).T).argmax(-1)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        need_weights: bool = False,
    ) -> HeadOutput:
        arguments.boolean(need_weights, "need_weights")
        check_head_inputs(q, k, v, mask, bias, "RoutingAttention")
        if q.shape[-1] != self.d:
            raise ValueError(f"RoutingAttention(d={self.d}) got q with {q.shape[-1]} features")
        cq, ck = self.route(q), self.route(k)
        same = cq.unsqueeze(-1) == ck.unsqueeze(-2)  # (…, M, N): the routing mask
        if self.training:
            self._update(q, k, cq, ck, mask)
        full_mask = same if mask is None else same & mask
        # the core's Attention reports the weights to a listener itself
        out = self.attention(q, k, v, mask=full_mask, bias=bias, need_weights=need_weights)
        return HeadOutput(out.context, out.weights if need_weights else None)

    @torch.no_grad()
    def _update(self, q: Tensor, k: Tensor, cq: Tensor, ck: Tensor, mask: Tensor | None) -> None:
        """μ_c ← λ μ_c + (1 − λ) mean of the unit vectors routed to c (real queries and keys
        only)."""
        lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        q, k = q.broadcast_to(*lead, *q.shape[-2:]), k.broadcast_to(*lead, *k.shape[-2:])
        cq, ck = cq.broadcast_to(q.shape[:-1]), ck.broadcast_to(k.shape[:-1])
        x = [_unit(q).reshape(-1, self.d), _unit(k).reshape(-1, self.d)]
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
