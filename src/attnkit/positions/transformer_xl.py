"""Transformer-XL (Dai et al. 2019): the relative positional encoding with its global biases u, v
(section 3.3) and the segment-level recurrence with state reuse (section 3.2)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, inputs, masks
from attnkit.core import attention
from attnkit.positions.base import REGISTRY, Positioned, PositionScheme, check_qk
from attnkit.positions.music import skew
from attnkit.positions.sinusoidal import sinusoid_table

__all__ = ["TransformerXL", "TransformerXLLayer", "XLRelative"]


@REGISTRY.register("transformer_xl")
class XLRelative(PositionScheme):
    """A^rel_ij = q_iᵀk_j (a) + q_iᵀ W_R R_{i−j} (b) + uᵀk_j (c) + vᵀ W_R R_{i−j} (d)
    (Dai et al. 3.3; with q_i = W_q E_{x_i}, k_j = W_{k,E} E_{x_j}, per head):

    (a) + (c) = (q_i + u)ᵀ k_j, so the scheme returns the queries q + u for the score, and
    (b) + (d) = (q_i + v)ᵀ W_R R_{i−j} as a bias, times ``scale``. R holds the sinusoids of
    the relative distance (no learned positions), W_R is learned, u and v are learned per head.
    The bias is computed over the M + N − 1 distances and :func:`~attnkit.positions.music.skew`-ed
    (Dai et al. appendix B computes it the same way).

    Args:
        head_dim: d. num_heads: H.
        d_r: the size of the sinusoids R (default H·d, the model size).
        scale: factor of the bias (default 1/√d, matching the default scaled-dot score).
    """

    translation_invariant = True  # reads only i − j

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        d_r: int | None = None,
        *,
        scale: float | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.d_r = head_dim * num_heads if d_r is None else arguments.positive_int(d_r, "d_r")
        if self.d_r % 2:
            raise ValueError(f"d_r must be even (sine/cosine pairs), got {self.d_r}")
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        kw = {"device": device, "dtype": dtype}
        self.w_r = nn.Linear(self.d_r, num_heads * head_dim, bias=False, **kw)  # W_{k,R}
        self.u = nn.Parameter(torch.zeros(num_heads, 1, head_dim, **kw))
        self.v = nn.Parameter(torch.zeros(num_heads, 1, head_dim, **kw))
        nn.init.normal_(self.u, std=0.02)
        nn.init.normal_(self.v, std=0.02)

    # for_heads: u, v and W_R per head of head_dim features.
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}

    def relative_keys(self, distances: Tensor, dtype: torch.dtype) -> Tensor:
        """W_R R_d per head: (R,) distances -> (H, R, d)."""
        r = sinusoid_table(distances.to(torch.float64), self.d_r).to(dtype)
        w = self.w_r.weight.to(dtype)
        return (r @ w.T).unflatten(-1, (self.num_heads, self.head_dim)).transpose(0, 1)

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_qk(
            q, k, "transformer_xl", num_heads=self.num_heads, q_offset=q_offset, k_offset=k_offset
        )
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"transformer_xl was built for head_dim = {self.head_dim}, got q {tuple(q.shape)}"
            )
        m, n = q.shape[-2], k.shape[-2]
        top = q_offset + m - 1 - k_offset  # the largest i − j
        dist = torch.arange(top, top - (m + n - 1), -1, device=q.device)
        rel = (q + self.v.to(q.dtype)) @ self.relative_keys(dist, q.dtype).transpose(-1, -2)
        return Positioned(q + self.u.to(q.dtype), k, skew(rel, n) * self.scale)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, d_r={self.d_r}"


def _segment(x: object, name: str, embed_dim: int) -> Tensor:
    """A segment (B, M, D) with D = ``embed_dim``."""
    x = inputs.tensor(x, name, min_dim=3)
    if x.dim() != 3 or x.shape[-1] != embed_dim:
        raise ValueError(
            f"{name} must be (B, M, D) with D = embed_dim = {embed_dim}, got shape {tuple(x.shape)}"
        )
    return x


def _memory(memory: object, h: Tensor, name: str) -> None:
    """A memory (B, P, D) that can precede the segment h (B, M, D): same B, D, dtype, device."""
    if memory is None:
        return
    memory = inputs.tensor(memory, name, min_dim=3)
    b, _, d = h.shape
    if memory.dim() != 3 or memory.shape[0] != b or memory.shape[-1] != d:
        raise ValueError(
            f"{name} must be (B, P, D) = ({b}, P, {d}) to precede the segment of shape "
            f"{tuple(h.shape)}, got shape {tuple(memory.shape)}"
        )
    inputs.same_kind(("segment", h), (name, memory))


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class TransformerXLLayer(nn.Module):
    """One Transformer-XL layer (Dai et al. 3.2-3.3): relative multi-head self-attention over
    [SG(memory) ∘ h] (the memory's states are keys and values, not queries), then the
    position-wise feed-forward; post-norm residuals, as in the paper.

    Args:
        embed_dim: D. num_heads: H (dividing D). d_ff: feed-forward size (default 4D).
        dropout: on the sublayer outputs.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim = {embed_dim} is not divisible by num_heads = {num_heads}")
        kw = {"device": device, "dtype": dtype}
        d_ff = 4 * embed_dim if d_ff is None else arguments.positive_int(d_ff, "d_ff")
        self.position = XLRelative(embed_dim // num_heads, num_heads, **kw)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
        self.kv_proj = nn.Linear(embed_dim, 2 * embed_dim, bias=False, **kw)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
        self.ff = nn.Sequential(
            nn.Linear(embed_dim, d_ff, **kw), nn.ReLU(), nn.Linear(d_ff, embed_dim, **kw)
        )
        self.norm1 = nn.LayerNorm(embed_dim, **kw)
        self.norm2 = nn.LayerNorm(embed_dim, **kw)
        self.drop = nn.Dropout(arguments.probability(dropout, "dropout"))

    def forward(
        self, h: Tensor, memory: Tensor | None = None, mask: Tensor | None = None
    ) -> Tensor:
        """h (B, M, D) the segment, memory (B, P, D) the earlier states (already detached) or
        None; mask (M, P + M) boolean, default causal aligned at the end (query i sees the
        memory and keys up to itself). Returns (B, M, D)."""
        _segment(h, "h", self.embed_dim)
        _memory(memory, h, "memory")
        context = h if memory is None else torch.cat([memory, h], dim=-2)
        h = self.norm1(h + self.drop(self.relative_attention(h, context, mask)))
        return self.norm2(h + self.drop(self.ff(h)))

    def relative_attention(self, h: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        """The relative multi-head attention of the segment h (B, M, D), the queries, over
        context (B, P + M, D) = [memory ∘ h], the keys and values; after the output projection,
        (B, M, D). mask as :meth:`forward`."""
        split = (self.num_heads, self.embed_dim // self.num_heads)
        q = self.q_proj(h).unflatten(-1, split).transpose(-2, -3)
        k, v = (
            t.unflatten(-1, split).transpose(-2, -3) for t in self.kv_proj(context).chunk(2, dim=-1)
        )
        p = context.shape[-2] - h.shape[-2]
        if mask is None:
            mask = masks.causal(h.shape[-2], context.shape[-2], device=h.device)
        q, k, bias = self.position(q, k, q_offset=p)[:3]
        out = attention(q, k, v, score="scaled_dot", mask=mask, bias=bias).context
        return self.out_proj(out.transpose(-2, -3).flatten(-2))


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class TransformerXL(nn.Module):
    """A stack of :class:`TransformerXLLayer` with the segment-level recurrence (Dai et al. 3.2):
    layer n of segment τ + 1 attends over [SG(h^{n−1}_τ) ∘ h^{n−1}_{τ+1}], the cached states
    of the layer below (stop-gradient), so that the context grows by one segment per layer.

    ``forward(x, memory)`` returns ``(y, new_memory)``: memory is a list with one (B, P, D) tensor
    per layer (the inputs of that layer at the P preceding positions) or None for the first
    segment; the new memory keeps the last ``mem_len`` positions, detached.

    Args:
        layers: the number of layers. embed_dim, num_heads, d_ff, dropout: as the layer.
        mem_len: the number of positions kept per layer.
    """

    def __init__(
        self,
        layers: int,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        mem_len: int,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        arguments.positive_int(layers, "layers")
        self.mem_len = arguments.nonnegative_int(mem_len, "mem_len")
        self.layers = nn.ModuleList(
            TransformerXLLayer(
                embed_dim, num_heads, d_ff, dropout=dropout, device=device, dtype=dtype
            )
            for _ in range(layers)
        )

    def forward(
        self, x: Tensor, memory: list[Tensor] | None = None, *, mask: Tensor | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """x (B, M, D); memory as returned by the previous segment (or None); mask (M, P + M)
        overrides the causal one (e.g. to limit how far back a single pass may look)."""
        _segment(x, "x", self.layers[0].embed_dim)
        if memory is not None:
            if not isinstance(memory, (list, tuple)):
                raise TypeError(
                    f"memory must be a list of (B, P, D) tensors, one per layer, or None; got "
                    f"{type(memory).__name__}"
                )
            if len(memory) != len(self.layers):
                raise ValueError(
                    f"memory has {len(memory)} entries but the stack has {len(self.layers)} "
                    "layers; pass the memory the previous segment returned"
                )
            for n, mem in enumerate(memory):
                _memory(mem, x, f"memory[{n}]")
        new_memory = []
        h = x
        for n, layer in enumerate(self.layers):
            mem = None if memory is None else memory[n]
            full = h if mem is None else torch.cat([mem, h], dim=-2)
            keep = max(full.shape[-2] - self.mem_len, 0)  # the last mem_len positions
            new_memory.append(full[..., keep:, :].detach())
            h = layer(h, mem, mask)
        return h, new_memory
