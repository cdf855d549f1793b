"""Sparse Sinkhorn attention and SortCut (Tay, Bahri, Yang, Metzler and Juan, ICML 2020;
Soydaner 5.2): the keys are cut into blocks of b, a learned sorting network scores block against
block, Sinkhorn balancing turns the scores into a (nearly) doubly stochastic soft permutation P,
and each query block attends to its own key block and to the block sorted to its place.

- Block summaries: s_j = Σ_{t ∈ block j} k_t (the paper's sum pooling ψ).
- Sorting network: R_ij = (W₁ s_i) · (W₂ s_j) / √d (a bilinear form in place of the paper's
  feed-forward net with N_B outputs, so that any number of blocks can be sorted).
- Sinkhorn balancing in log space (paper eq. 5-6): S⁰ = R/τ, then alternately subtract the row
  and the column log-sum-exp, ``n_iter`` times, ending with rows; P = exp(S). In training Gumbel
  noise is added to R (as the paper) and P is a soft, differentiable permutation.
- Sorted keys and values: the block sorted to place i holds, slot by slot, the P-weighted mean
  of the keys (values) in that slot of every block: k̃_{i,t} = Σ_j P_ij k_{j,t} / Σ_j P_ij.
- Sinkhorn attention: query block i attends to [k_{i,·} ; k̃_{i,·}] (local and sorted).
- SortCut (``sortcut=n``): every query attends only to the first n sorted blocks (no local
  block), a fixed-size, content-selected memory.

Padding keys (a key-padding mask (…, 1, N)) are left out of the summaries, of the balancing (a
block with no real key is neither sorted nor sorted to) and of the slot means, so padding equals
truncation. Masks that vary over queries and additive biases cannot be honoured on mixed keys and
are refused. The weights (…, M, N) attribute each sorted slot's weight to the original keys it
mixes, so that context = weights @ v exactly.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.efficient._shared import masked_logsumexp as _logsumexp
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["SinkhornAttention", "sinkhorn"]


def sinkhorn(scores: Tensor, ok: Tensor, n_iter: int) -> Tensor:
    """Log-space Sinkhorn balancing of (…, n, n) ``scores`` over the entries where ``ok``:
    alternately normalise rows and columns, ending with rows; returns log P (−inf off ``ok``)."""
    s = scores.masked_fill(~ok, float("-inf"))
    for _ in range(n_iter):
        s = s - _logsumexp(s, ok, -1).unsqueeze(-1).masked_fill(~ok.any(-1, keepdim=True), 0.0)
        s = s - _logsumexp(s, ok, -2).unsqueeze(-2).masked_fill(~ok.any(-2, keepdim=True), 0.0)
    s = s - _logsumexp(s, ok, -1).unsqueeze(-1).masked_fill(~ok.any(-1, keepdim=True), 0.0)
    return s


@REGISTRY.register("sinkhorn")
@arguments.deprecated_names(d="head_dim")
class SinkhornAttention(HeadAttention):
    """Sparse Sinkhorn attention (and SortCut), a per-head part ``part(q, k, v, *, mask, bias,
    need_weights)`` with q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v).

    Args:
        head_dim: d, the query/key size; ``d=`` is its old name, accepted with a
            DeprecationWarning until the next release.
        block_size: b, the length of the blocks that are sorted.
        sortcut: None for Sinkhorn attention (local + sorted block); an int n ≥ 1 for SortCut
            (every query attends to the first n sorted blocks only).
        n_iter: Sinkhorn iterations, ≥ 1.
        temperature: τ > 0 of the balancing.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    # capabilities (attnkit.head.HeadAttention)
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(
        self,
        head_dim: int,
        block_size: int = 16,
        *,
        sortcut: int | None = None,
        n_iter: int = 8,
        temperature: float = 0.75,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(head_dim, "head_dim")
        arguments.positive_int(block_size, "block_size")
        arguments.optional_positive_int(sortcut, "sortcut")
        arguments.positive_int(n_iter, "n_iter")
        arguments.finite_float(temperature, "temperature")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.head_dim, self.block_size, self.sortcut = head_dim, block_size, sortcut
        self.n_iter, self.temperature = n_iter, float(temperature)
        kw = {"device": device, "dtype": dtype}
        self.sort_query = nn.Linear(head_dim, head_dim, bias=False, **kw)
        self.sort_key = nn.Linear(head_dim, head_dim, bias=False, **kw)
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (7, 8, 9))
        mask = masks.from_lengths(torch.tensor([7, 4]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(4, block_size=2), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.LOCAL]

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, block_size={self.block_size}, sortcut={self.sortcut}, "
            f"n_iter={self.n_iter}, temperature={self.temperature}"
        )

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
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"SinkhornAttention(head_dim={self.head_dim}) got q with {q.shape[-1]} features"
            )
        m, n, dv = q.shape[-2], k.shape[-2], v.shape[-1]
        d = self.head_dim
        qz = q.broadcast_to(*lead, m, d).reshape(-1, m, d)
        kz = k.broadcast_to(*lead, n, d).reshape(-1, n, d)
        vz = v.broadcast_to(*lead, n, dv).reshape(-1, n, dv)
        z = qz.shape[0]
        valid = torch.ones(z, n, dtype=torch.bool, device=q.device)
        if mask is not None:
            valid = mask.broadcast_to(*lead, 1, n).reshape(z, n)
        context, weights = self._attend(qz, kz, vz, valid, need_weights)
        context = context.reshape(*lead, m, dv)
        return AttentionOutput(context, None if weights is None else weights.reshape(*lead, m, n))

    def _attend(self, q, k, v, valid, want_weights):
        z, m, n = q.shape[0], q.shape[1], k.shape[1]
        b = self.block_size
        nb = max(-(-m // b), -(-n // b))  # blocks of queries and of keys, padded alike
        qb = F.pad(q, (0, 0, 0, nb * b - m)).unflatten(1, (nb, b))
        ok = F.pad(valid, (0, nb * b - n)).reshape(z, nb, b)  # real key slots
        kb = torch.where(ok[..., None], F.pad(k, (0, 0, 0, nb * b - n)).unflatten(1, (nb, b)), 0)
        vb = torch.where(ok[..., None], F.pad(v, (0, 0, 0, nb * b - n)).unflatten(1, (nb, b)), 0)
        block_ok = ok.any(-1)  # (Z, nb)
        summary = kb.sum(2)  # ψ: sum pooling of each block's real keys
        r = self.sort_query(summary) @ self.sort_key(summary).transpose(-1, -2)
        r = r / math.sqrt(self.head_dim)
        if self.training:  # Gumbel noise: sampling a permutation
            u = torch.rand_like(r).clamp(1e-9, 1 - 1e-9)
            r = r - torch.log(-torch.log(u))
        pair_ok = block_ok[:, :, None] & block_ok[:, None, :]
        p = sinkhorn(r / self.temperature, pair_ok, self.n_iter).exp()  # (Z, nb, nb), 0 off
        # slot means: k̃_{i,t} = Σ_j P_ij k_{j,t} / Σ_j P_ij over the real slots
        mix = p[..., None] * ok[:, None, :, :].to(p.dtype)  # (Z, i, j, t)
        denom = mix.sum(2)  # (Z, i, t)
        sorted_ok = denom > 0
        mix = mix / torch.where(sorted_ok, denom, 1.0)[:, :, None, :]
        ks = torch.einsum("zijt,zjtd->zitd", mix, kb)
        vs = torch.einsum("zijt,zjtd->zitd", mix, vb)
        scale = self.head_dim**-0.5
        if self.sortcut is None:
            keys = torch.cat([kb, ks], 2)  # (Z, nb, 2b, d): own block and sorted block
            vals = torch.cat([vb, vs], 2)
            key_ok = torch.cat([ok, sorted_ok], 2)
        else:
            cut = min(self.sortcut, nb)
            keys = ks[:, :cut].flatten(1, 2).unsqueeze(1).expand(-1, nb, -1, -1)
            vals = vs[:, :cut].flatten(1, 2).unsqueeze(1).expand(-1, nb, -1, -1)
            key_ok = sorted_ok[:, :cut].reshape(z, 1, cut * b).expand(-1, nb, -1)
        e = torch.einsum("zisd,zitd->zist", qb, keys) * scale
        a = self.align(e, key_ok[:, :, None, :]).weights  # (Z, nb, b, keys)
        context = torch.einsum("zist,zitd->zisd", a, vals).flatten(1, 2)[:, :m]
        weights = None
        if want_weights:  # attribute each sorted slot to the keys it mixes
            if self.sortcut is None:
                local, through = a[..., :b], a[..., b:]
                w = torch.einsum("zisy,zijy->zisjy", through, mix) + _block_diagonal(local, nb)
            else:
                through = a.reshape(z, nb, b, cut, b)
                w = torch.einsum("ziscy,zcjy->zisjy", through, mix[:, :cut])
            weights = w.reshape(z, nb * b, nb * b)[:, :m, :n]
        return context, weights


def _block_diagonal(local: Tensor, nb: int) -> Tensor:
    """(Z, nb, b, b) block weights as (Z, nb, b, nb, b), zero off the diagonal blocks."""
    eye = torch.eye(nb, dtype=local.dtype, device=local.device)
    return local[:, :, :, None, :] * eye[None, :, None, :, None]
