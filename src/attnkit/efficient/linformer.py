"""Linformer (Wang, Li, Khabsa, Fang and Ma, "Linformer: Self-Attention with Linear Complexity",
2020; Soydaner 5.3, Brauwers 3.1): keys and values are projected along the sequence to k rows by
learned matrices E, F (k × n), and softmax attention runs over the k projected keys:

    head = softmax(Q (E K)ᵀ / √d) (F V)          (Linformer eq. 7)

O(M·k·d) instead of O(M·N·d). The projections are of a fixed maximum length n: a sequence of
N ≤ n positions uses the first N columns of E and F (the usual convention for shorter inputs);
a longer one is refused. E and F are shared by all heads (one pair) or one pair per head
(``num_heads=H``), and E = F with ``share_kv=True`` (the paper's key-value sharing).

Masks: E mixes positions, so a mask that differs between queries (causal, windows) cannot be
honoured and is refused. A key padding mask is honoured exactly: padded keys and values are set
to 0 before the projection, so E K = E[:, real] K[real] — the same as projecting the sequence
with the padded positions removed by E with those columns removed; for padding at the end
(lengths) that is the Linformer of the truncated sequence. A padded query (a mask row with no
key) gets context 0.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.efficient.landmarks import padding_masks
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["Linformer"]


@REGISTRY.register("linformer")
@arguments.renamed(heads="num_heads")
class Linformer(HeadAttention):
    """Linformer attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with
    q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v), N ≤ ``max_len``.

    Args:
        max_len: n, the longest key sequence (E and F are k × n).
        k: the projected length.
        num_heads: None to share E and F across heads (and any leading dims); H for one pair per
            head, applied to dim −3 of k and v (B, H, N, d), as MultiHeadAttention passes them.
        share_kv: use one matrix for keys and values (E = F).

    Weights (…, M, k) are over the k projected keys (there are no per-key weights: E and F mix
    the keys differently). Bias is refused (no (M, N) scores are formed).
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"max_len": "max_len"}

    # capabilities (attnkit.head.HeadAttention)
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding"})

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(
        self,
        max_len: int,
        k: int = 64,
        *,
        num_heads: int | None = None,
        share_kv: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.max_len = arguments.positive_int(max_len, "max_len")
        self.k = arguments.positive_int(k, "k")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        self.share_kv = arguments.boolean(share_kv, "share_kv")
        shape = (
            (self.k, self.max_len) if num_heads is None else (self.num_heads, self.k, self.max_len)
        )
        kw = {"device": device, "dtype": dtype}
        # Xavier-normal, as a linear map from n positions to k
        std = math.sqrt(2 / (self.k + self.max_len))
        self.e_proj = nn.Parameter(torch.randn(shape, **kw) * std)
        self.f_proj = None if share_kv else nn.Parameter(torch.randn(shape, **kw) * std)
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (21, 22, 23))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(max_len=8, k=3, num_heads=2), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.GLOBAL]

    def extra_repr(self) -> str:
        return (
            f"max_len={self.max_len}, k={self.k}, num_heads={self.num_heads}, "
            f"share_kv={self.share_kv}"
        )

    def project(self, x: Tensor, proj: Tensor) -> Tensor:
        """proj[…, :, :N] x: (…, N, d) → (…, k, d), per head when ``num_heads`` is set."""
        p = proj[..., : x.shape[-2]].to(x.dtype)
        if self.num_heads is None:
            return p @ x
        if x.dim() < 3 or x.shape[-3] != self.num_heads:
            raise ValueError(
                f"Linformer(num_heads={self.num_heads}) needs inputs (…, H={self.num_heads}, N, "
                f"d), got shape {tuple(x.shape)}"
            )
        return p @ x  # (H, k, N) broadcasts over (…, H, N, d)

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
        who = type(self).__name__
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        n = k.shape[-2]
        if n > self.max_len:
            raise ValueError(
                f"{who}(max_len={self.max_len}) got {n} keys (k of shape {tuple(k.shape)}): its "
                "projections E, F are fixed to max_len positions"
            )
        # padded keys hold zeros (the template), so E and F mix in nothing from them
        query_keep, _ = padding_masks(mask, torch.Size((*lead, q.shape[-2], n)), who)
        pk = self.project(k, self.e_proj)
        pv = self.project(v, self.e_proj if self.f_proj is None else self.f_proj)
        scores = (q * q.shape[-1] ** -0.5) @ pk.transpose(-1, -2)  # scale (M, d), not (M, k)
        # A query that may attend no key (padding, or no real key at all) attends nothing.
        weights = self.align(scores, query_keep).weights
        return AttentionOutput(weights @ pv, weights)
