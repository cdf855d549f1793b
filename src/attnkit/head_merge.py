"""The gated merge of attention heads (Zhang et al. 2018, GaAN; Galassi IV-D1).

Multi-head attention usually merges its heads by concatenation and a projection,
concat(O^1 … O^H) W^O (Brauwers eq. 40). The gated merge scales each head's output by a gate
in [0, 1] computed from the query position and a summary of the keys it attends,

    g_i = σ(W_g [x_i ; max_j (W_m k_j) ; mean_j k_j] + b_g) ∈ [0, 1]^H,
    y_i = concat(g_i^1 O_i^1 … g_i^H O_i^H) W^O (+ b^O),

so a head can be switched off where it does not help (GaAN eq. 5, with the max-pool over
projected keys and the mean of the keys as in the paper; without keys the gate sees x_i only).
The heads' outputs come from any multi-head attention, e.g.
:func:`attnkit.regularisers.head_parts`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments

__all__ = ["GatedHeadMerge", "GatedMergeOutput"]


class GatedMergeOutput(NamedTuple):
    """output (B, M, E); gates (B, M, H)."""

    output: Tensor
    gates: Tensor


class GatedHeadMerge(nn.Module):
    """y_i = concat_h(g_i^h O_i^h) W^O with GaAN's gates g_i (Zhang et al. 2018).

    Args:
        embed_dim: E, the query size and the output size.
        num_heads: H; head_dim: d, each head's output size (default E/H).
        kdim: the key size; gives the gate the max-pool of W_m k_j and the mean of k_j over the
            keys (None: the gate sees the query only).
        d_pool: the size of W_m k_j (default kdim).
        bias: biases in W^O.
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int | None = None,
        *,
        kdim: int | None = None,
        d_pool: int | None = None,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim = {embed_dim} is not divisible by num_heads = {num_heads}; "
                    "give head_dim"
                )
            head_dim = embed_dim // num_heads
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.kdim = arguments.optional_positive_int(kdim, "kdim")
        if self.kdim is None and d_pool is not None:
            raise TypeError("d_pool is the size of the pooled keys: it needs kdim")
        arguments.boolean(bias, "bias")
        kw = {"device": device, "dtype": dtype}
        gate_in = embed_dim
        if self.kdim is not None:
            self.d_pool = self.kdim if d_pool is None else arguments.positive_int(d_pool, "d_pool")
            self.pool = nn.Linear(self.kdim, self.d_pool, **kw)  # W_m
            gate_in += self.d_pool + self.kdim
        self.gate = nn.Linear(gate_in, num_heads, **kw)  # W_g, b_g
        self.out_proj = nn.Linear(num_heads * self.head_dim, embed_dim, bias=bias, **kw)  # W^O

    def gates(self, query: Tensor, key: Tensor | None = None, mask: Tensor | None = None) -> Tensor:
        """g (B, M, H) from the query (B, M, E) and, with ``kdim``, the keys (B, N, kdim);
        ``mask`` (B, N) or (B, 1, N), True = a real key, keeps padding out of the pools."""
        feats = [query]
        if self.kdim is not None:
            if key is None:
                raise ValueError("this gated merge was built with kdim: pass key (B, N, kdim)")
            if key.dim() != 3 or key.shape[-1] != self.kdim or key.shape[0] != query.shape[0]:
                raise ValueError(
                    f"key must be (B, N, kdim) = ({query.shape[0]}, N, {self.kdim}), got "
                    f"{tuple(key.shape)}"
                )
            b, n, _ = key.shape
            if mask is None:
                keep = torch.ones(b, n, 1, dtype=torch.bool, device=key.device)
            else:
                if mask.dtype != torch.bool or mask.numel() != b * n:
                    raise ValueError(
                        f"mask must be boolean (B, N) or (B, 1, N) = ({b}, {n}), got "
                        f"{tuple(mask.shape)} {mask.dtype}"
                    )
                keep = mask.reshape(b, n, 1)
            pooled = self.pool(key).masked_fill(~keep, float("-inf")).amax(dim=1)
            pooled = torch.where(torch.isfinite(pooled), pooled, torch.zeros_like(pooled))
            count = keep.sum(dim=1).clamp_min(1).to(key.dtype)
            mean = torch.where(keep, key, torch.zeros((), dtype=key.dtype)).sum(dim=1) / count
            m = query.shape[-2]
            feats += [pooled.unsqueeze(1).expand(-1, m, -1), mean.unsqueeze(1).expand(-1, m, -1)]
        elif key is not None:
            raise ValueError("this gated merge was built without kdim: it takes no key")
        return torch.sigmoid(self.gate(torch.cat(feats, dim=-1)))

    def combine(self, heads: Tensor, gates: Tensor) -> Tensor:
        """concat_h(g^h O^h) W^O for heads (B, H, M, d) and gates (B, M, H)."""
        scaled = heads * gates.transpose(-1, -2).unsqueeze(-1)
        return self.out_proj(scaled.transpose(-2, -3).flatten(-2))

    def forward(
        self,
        query: Tensor,
        heads: Tensor,
        key: Tensor | None = None,
        *,
        mask: Tensor | None = None,
    ) -> GatedMergeOutput:
        """Merge heads (B, H, M, d) for the queries (B, M, E) (and keys (B, N, kdim))."""
        if query.dim() != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query must be (B, M, E) with E = {self.embed_dim}, got {tuple(query.shape)}"
            )
        expected = (query.shape[0], self.num_heads, query.shape[1], self.head_dim)
        if tuple(heads.shape) != expected:
            raise ValueError(f"heads must be (B, H, M, d) = {expected}, got {tuple(heads.shape)}")
        g = self.gates(query, key, mask)
        return GatedMergeOutput(self.combine(heads, g), g)
