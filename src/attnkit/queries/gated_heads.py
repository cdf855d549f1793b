"""Gated heads: the Gated Attention Network, GaAN (Zhang, Shi, Xie, Ma, King and Yeung, "GaAN:
Gated Attention Networks for Learning on Large and Spatiotemporal Graphs", UAI 2018; Soydaner 5):
multi-head attention in which a gate per head, computed from the query and a summary of its
neighbours, controls how much of each head's output is used.

For a query (node) x_i with neighbours (keys) z_j, j ∈ N_i (the mask's allowed keys), K heads:

- head k: w_ij^(k) = softmax_j ⟨W_xa^(k) x_i, W_za^(k) z_j⟩ and o_i^(k) = Σ_j w_ij^(k) W_v^(k) z_j;
- gates: g_i = σ(W_g [x_i ; max_{j∈N_i} W_m z_j ; mean_{j∈N_i} z_j] + b_g) ∈ (0, 1)^K, the max
  taken feature by feature over the projected neighbours (GaAN's gate network ψ_g);
- output: y_i = W_o [x_i ; g_i^(1) o_i^(1) ; … ; g_i^(K) o_i^(K)] + b_o (GaAN eq. 1 with gates).

A query with no neighbour gets zero pools, zero head outputs and y_i = W_o [x_i ; 0] + b_o.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["GatedHeadAttention", "GatedHeadOutput"]


class GatedHeadOutput(NamedTuple):
    """output (B, M, d_out); weights (B, K, M, N) per head; gates (B, M, K)."""

    output: Tensor
    weights: Tensor
    gates: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("gated_heads")
@arguments.renamed(heads="num_heads", d_head="head_dim")
class GatedHeadAttention(nn.Module):
    """GaAN's gated multi-head attention of queries x (B, M, d_x) over keys z (B, N, d_z).

    Args:
        d_x: query size; d_z: key (neighbour) size.
        num_heads: K.
        head_dim: each head's attention and value size.
        d_m: size of the projected neighbours that are max-pooled for the gates.
        d_out: output size (default d_x).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("z",)}

    def __init__(
        self,
        d_x: int,
        d_z: int,
        num_heads: int,
        head_dim: int,
        d_m: int,
        d_out: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(d_x=d_x, d_z=d_z, num_heads=num_heads, head_dim=head_dim, d_m=d_m)
        d_out = d_x if d_out is None else arguments.positive_int(d_out, "d_out")
        self.d_x, self.d_z, self.num_heads, self.head_dim = d_x, d_z, num_heads, head_dim
        kw = {"device": device, "dtype": dtype}
        self.query = nn.Linear(d_x, num_heads * head_dim, bias=False, **kw)  # W_xa, all heads
        self.key = nn.Linear(d_z, num_heads * head_dim, bias=False, **kw)  # W_za
        self.value = nn.Linear(d_z, num_heads * head_dim, bias=False, **kw)  # W_v
        self.pool = nn.Linear(d_z, d_m, **kw)  # W_m
        self.gate = nn.Linear(d_x + d_m + d_z, num_heads, **kw)  # W_g, b_g
        self.out = nn.Linear(d_x + num_heads * head_dim, d_out, **kw)  # W_o, b_o
        self.attention = Attention("dot", "softmax")

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)
        x, z = example_tensor(2, 3, 4, seed=41), example_tensor(2, 6, 5, seed=42)
        return cls(4, 5, num_heads=2, head_dim=3, d_m=4), (x, z), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HEAD, tx.Scoring.MULTIPLICATIVE]

    def extra_repr(self) -> str:
        return (
            f"d_x={self.d_x}, d_z={self.d_z}, num_heads={self.num_heads}, head_dim={self.head_dim}"
        )

    def forward(self, x: Tensor, z: Tensor, mask: Tensor | None = None) -> GatedHeadOutput:
        """x (B, M, d_x), z (B, N, d_z); mask True = j is a neighbour of i: (B, M, N), or
        (B, 1, N) from :func:`attnkit.masks.from_lengths` for padding."""
        for name, t, d in (("x", x, self.d_x), ("z", z, self.d_z)):
            if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[-1] != d:
                raise ValueError(
                    f"GatedHeadAttention: {name} must be (B, L, {d}), got "
                    f"{getattr(t, 'shape', type(t).__name__)}"
                )
        if x.shape[0] != z.shape[0]:
            raise ValueError(f"x {tuple(x.shape)} and z {tuple(z.shape)} differ in batch size")
        b, m, n = x.shape[0], x.shape[1], z.shape[1]
        allowed = torch.ones(b, m, n, dtype=torch.bool, device=x.device)
        if mask is not None:
            masks.check(mask, torch.Size((b, m, n)))
            allowed = mask.broadcast_to(b, m, n)
            z = torch.where(allowed.any(1)[..., None], z, 0.0)  # padding reaches nothing
        kh, dh = self.num_heads, self.head_dim  # explicit sizes: B = 0 leaves no -1 to infer
        q = self.query(x).reshape(b, m, kh, dh).transpose(1, 2)  # (B, K, M, head_dim)
        k = self.key(z).reshape(b, n, kh, dh).transpose(1, 2)
        v = self.value(z).reshape(b, n, kh, dh).transpose(1, 2)
        heads = self.attention(q, k, v, mask=allowed[:, None], need_weights=True)
        # the gate network: max-pool of projected neighbours, mean of the neighbours
        some = allowed.any(-1, keepdim=True)  # (B, M, 1)
        projected = self.pool(z)[:, None].expand(b, m, n, -1)
        lowest = torch.finfo(projected.dtype).min
        pooled = projected.masked_fill(~allowed[..., None], lowest).amax(2)
        pooled = torch.where(some, pooled, 0.0)
        count = allowed.sum(-1, keepdim=True).clamp_min(1).to(z.dtype)
        mean = (allowed.to(z.dtype) @ z) / count
        gates = torch.sigmoid(self.gate(torch.cat([x, pooled, mean], -1)))  # (B, M, K)
        gated = heads.context * gates.transpose(1, 2)[..., None]  # (B, K, M, head_dim)
        y = self.out(torch.cat([x, gated.transpose(1, 2).flatten(2)], -1))
        return GatedHeadOutput(y, heads.weights, gates)
