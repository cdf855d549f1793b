"""FMMformer (Nguyen, Suliafu, Osher, Chen and Wang, "FMMformer: Efficient and Flexible Transformer
via Decomposed Near-field and Far-field Attention", NeurIPS 2021; Soydaner 5.3): as the fast
multipole method splits an N-body sum, attention is split into a banded near field and a low-rank
far field, blended by learned weights:

    V̂ = w₁ D V + w₂ L V

- near field D: softmax attention restricted to the band |i − j| ≤ w (0 ≤ i − j ≤ w when causal),
  D_ij = exp(q_i·k_j/√d) / Σ_{|i−l|≤w} exp(q_i·k_l/√d), computed in blocks of c = max(w, 16)
  queries against the 3c keys around them: O(N·c·d);
- far field L: linear attention (Katharopoulos et al.; :mod:`attnkit.efficient.kernelized`) with
  the kernel φ(q)·φ(k) = Σ_l φ_l(q)·φ_l(k) of r feature maps (the paper's rank-r far field:
  the features are concatenated), O(N·r·m·d); causal by prefix sums;
- w₁, w₂: learned scalars (unconstrained, initialised to ``near_weight``, ``far_weight``).

With w ≥ N the band is everything, so w₁ = 1, w₂ = 0 is softmax attention.

Masks: padding masks are honoured (key padding (…, 1, N); padded queries, all-False rows, get
context 0); other per-query masks are refused (the far field sums over keys once for all
queries) — use ``causal=True`` for the causal form. Bias is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, hooks, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.efficient import kernelized as kz
from attnkit.efficient.feature_maps import causal_rows, check_causal, make_feature_map
from attnkit.efficient.landmarks import padding_masks, zero_rows
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.kernels.base import guarded_sum
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["FMMformer", "band_blocks"]


class _NegatedEluPlusOne(nn.Module):
    """φ(x) = elu(−x) + 1, positive: FMMformer's second far-field feature map."""

    def forward(self, x: Tensor) -> Tensor:
        return F.elu(-x) + 1


def band_blocks(
    m: int, n: int, bandwidth: int, causal: bool, device: torch.device
) -> tuple[int, Tensor, Tensor]:
    """The near field's blocking: queries in blocks of c ≥ w, block b seeing the keys of blocks
    b − 1, b, b + 1 (3c slots, slot s of block b is key j = (b − 1)c + s).

    Returns:
        c; the key index of each (block, row, slot) (nb, c, 3c), clamped into [0, N); and
        whether the pair is in the band |i − j| ≤ w (−w ≤ j − i ≤ 0 causal) with i < M and
        j < N, (nb, c, 3c).
    """
    w = min(bandwidth, max(m, n))  # a wider band adds only out-of-range keys
    c = max(w, min(16, max(m, n)), 1)  # blocks of ≥ 16 keep the matrix products efficient
    nb = -(-m // c)
    i = torch.arange(nb * c, device=device).reshape(nb, c, 1)
    j = (torch.arange(nb, device=device) - 1).reshape(nb, 1, 1) * c + torch.arange(
        3 * c, device=device
    )
    o = j - i
    inside = (o >= -w) & (o <= (0 if causal else w)) & (i < m) & (j >= 0) & (j < n)
    return c, j.clamp(0, n - 1).expand(nb, c, 3 * c), inside


def _windows(x: Tensor, c: int, nb: int) -> Tensor:
    """x (…, N, e) → (…, nb, 3c, e): for block b, rows (b − 1)c … (b + 2)c − 1 (0 outside)."""
    n = x.shape[-2]
    padded = F.pad(x, (0, 0, c, (nb + 2) * c - c - n))
    return padded.unfold(-2, 3 * c, c).transpose(-1, -2)


@REGISTRY.register("fmm")
class FMMformer(HeadAttention):
    """FMMformer attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with
    q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v); query i and key
    i are the same position (the band is over indices).

    Args:
        bandwidth: w, the near field's half-width (keys |i − j| ≤ w).
        feature_maps: the far field's feature maps, names in
            :data:`attnkit.efficient.feature_maps.FEATURE_MAPS`, ``"elu(-x)+1"`` (the paper's second
            map; ``("elu+1", "elu(-x)+1")`` is its rank-2 far field), or modules (r maps).
        causal: near field 0 ≤ i − j ≤ w and causal far field (needs M = N).
        near_weight, far_weight: initial w₁, w₂.
        chunk_size: block length of the causal far field's prefix sums.
    """

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    # causal=True: queries after a KV cache are the last rows of the causal sequence
    takes_q_offset: ClassVar[bool] = True

    def __init__(
        self,
        bandwidth: int = 8,
        feature_maps: Sequence[str | nn.Module] = ("elu+1",),
        *,
        causal: bool = False,
        near_weight: float = 0.5,
        far_weight: float = 0.5,
        chunk_size: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.bandwidth = arguments.nonnegative_int(bandwidth, "bandwidth")
        if isinstance(feature_maps, (str, nn.Module)) or not len(feature_maps):
            raise ValueError(
                f"feature_maps must be a non-empty sequence of names or modules, got "
                f"{feature_maps!r}"
            )
        self.phis = nn.ModuleList(
            _NegatedEluPlusOne() if p == "elu(-x)+1" else make_feature_map(p) for p in feature_maps
        )
        self.causal = arguments.boolean(causal, "causal")
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        kw = {"device": device, "dtype": dtype}
        self.near_weight = nn.Parameter(
            torch.tensor(arguments.finite_float(near_weight, "near_weight"), **kw)
        )
        self.far_weight = nn.Parameter(
            torch.tensor(arguments.finite_float(far_weight, "far_weight"), **kw)
        )
        self.align = Softmax()
        self.far_align = kz.KernelNormalized()

    @property
    def decodes_with_cache(self) -> bool:
        """Causal, a decoding step over the cached keys equals its rows of the causal pass."""
        return self.causal

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (61, 62, 63))
        mask = masks.from_lengths(torch.tensor([7, 3]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(1), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.LOCAL]

    def extra_repr(self) -> str:
        return f"bandwidth={self.bandwidth}, causal={self.causal}, chunk_size={self.chunk_size}"

    def features(self, x: Tensor) -> Tensor:
        """[φ_1(x), …, φ_r(x)] (…, L, Σ m_l): the far field's kernel is the sum of theirs."""
        return torch.cat([phi(x) for phi in self.phis], -1)

    def near_field(
        self, q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Banded softmax attention, block by block: (context (…, M, d_v), weights (…, nb, c, 3c)
        over each block's key slots, key index of each slot (nb, c, 3c)); ``keep`` (…, 1, N)
        is the key padding. O(M·c·d) time and O(M·c) memory for blocks of c = max(w, 16)."""
        m, n = q.shape[-2], k.shape[-2]
        c, j, inside = band_blocks(m, n, self.bandwidth, self.causal, q.device)
        nb = j.shape[0]
        qb = F.pad(q, (0, 0, 0, nb * c - m)).unflatten(-2, (nb, c))  # (…, nb, c, d)
        scores = qb @ _windows(k, c, nb).transpose(-1, -2) / math.sqrt(q.shape[-1])
        allowed = inside
        if keep is not None:
            allowed = inside & _windows(keep.transpose(-1, -2), c, nb).transpose(-1, -2)
        weights = self.align(scores, allowed).weights  # (…, nb, c, 3c)
        windows = _windows(v, c, nb)
        if torch.compiler.is_compiling() or bool(torch.isfinite(v).all()):
            context = weights @ windows
        else:  # a value outside the band (weight 0) is NaN or infinite: it must reach nothing
            context = guarded_sum(torch.matmul, weights, windows)
        context = context.flatten(-3, -2)[..., :m, :]
        return context, weights, j

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        q_offset: int,
    ) -> AttentionOutput:
        """The context w₁ D V + w₂ L V; with ``need_weights=True`` also the weights, the blend
        w₁ D + w₂ L (…, M, N), and the two fields' weights by name in ``extra``: ``near``, D
        (banded softmax), and ``far``, L (linear attention), each (…, M, N)."""
        who = type(self).__name__
        rows = causal_rows(self, q, k, v, q_offset, mask=mask, bias=bias, need_weights=need_weights)
        if rows is not None:  # queries after a KV cache: the last rows of the causal sequence
            return rows
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if self.causal:
            check_causal(q, k, who)
        m, n = q.shape[-2], k.shape[-2]
        query_keep, key_row = padding_masks(mask, torch.Size((*lead, m, n)), who)
        # padded keys hold zeros and rows without a key are set to 0 (the template)
        key_keep = None if key_row is None else key_row.transpose(-1, -2)  # (…, N, 1)
        near, band, slots = self.near_field(q, k, v, key_row)
        fq, fk = self.features(q), self.features(k)
        if self.causal:
            far = kz.causal_feature_attention(fq, fk, v, key_keep, self.chunk_size)
        else:
            far = kz.feature_attention(fq, fk, v, key_keep)
        context = self.near_weight * near + self.far_weight * far
        if not need_weights:
            return AttentionOutput(context)
        band, slots = band.flatten(-3, -2)[..., :m, :], slots.flatten(0, 1)[:m]
        dense = band.new_zeros(*band.shape[:-1], n)
        near_w = dense.scatter_add(-1, slots.expand_as(band), band)
        far_w = kz.dense_feature_weights(self.far_align, fq, fk, key_keep, self.causal)
        near_w, far_w = zero_rows(near_w, query_keep), zero_rows(far_w, query_keep)
        blended = self.near_weight * near_w + self.far_weight * far_w
        hooks.report(self, near_w, "near")
        hooks.report(self, far_w, "far")
        return AttentionOutput(context, blended, extra={"near": near_w, "far": far_w})
