"""The output gate of gated attention: a sigmoid gate on the attention's output, before the
output projection (Qiu et al. 2025, "Gated Attention for Large Language Models: Non-linearity,
Sparsity, and Attention-Sink-Free", arXiv 2505.06708; the full-attention layers of Qwen3-Next).

For a layer input x_i (the query token) and the concatenated heads' context o_i = concat_h
Attn_h(…)_i (H·d features), the layer's output is

    y_i = (o_i ⊙ σ(x_i W_g + b_g)) W^O,

with the gate either **elementwise** (W_g of E × H·d: one gate per head and channel, the
paper's best variant, G1 in its Table 1, and Qwen3-Next's) or **headwise** (W_g of E × H: one
scalar per head, broadcast over its d channels). The gate reads the query token, so it adds a
query-dependent non-linearity between W^V and W^O (which otherwise compose into one low-rank
map) and lets a head output nearly nothing: the paper finds the sigmoid gate sparse and the
attention sink gone.

Like the q/k chain (:mod:`attnkit.qk_chain`), the gate is a step of the multi-head layer:
``ak.MultiHeadAttention(..., gate="elementwise")`` holds an :class:`OutputGate`.
:class:`attnkit.modern.GatedAttention` is that layer with the gate on by default, registered as
a mechanism, and builds Qwen3-Next's attention from transformers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import arguments

__all__ = ["GATE_KINDS", "OutputGate"]

#: The gate's kinds: one gate per head and channel, or one per head.
GATE_KINDS = ("elementwise", "headwise")


class OutputGate(nn.Module):
    """o ⊙ σ(x W_g + b_g) on the concatenated heads o (…, M, H·d), read from the query tokens
    x (…, M, E).

    Args:
        embed_dim: E, the size of the tokens the gate reads.
        num_heads: H.
        head_dim: d, each head's context size.
        kind: ``"elementwise"`` (W_g: E → H·d) or ``"headwise"`` (W_g: E → H, each head's
            scalar gate shared by its d channels).
        bias: a bias b_g.
        device, dtype: of the parameters.

    W_g starts Xavier-uniform and b_g at 0 (gates near ½), as the layer's own projections.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int,
        kind: str = "elementwise",
        *,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        if not isinstance(kind, str) or kind not in GATE_KINDS:
            raise ValueError(f"kind must be one of {', '.join(GATE_KINDS)}, got {kind!r}")
        self.kind = kind
        arguments.boolean(bias, "bias")
        out = num_heads * head_dim if kind == "elementwise" else num_heads
        self.proj = nn.Linear(embed_dim, out, bias=bias, device=device, dtype=dtype)
        nn.init.xavier_uniform_(self.proj.weight)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, num_heads={self.num_heads}, head_dim={self.head_dim}"

    def gates(self, x: Tensor) -> Tensor:
        """σ(x W_g + b_g): (…, M, H·d) elementwise, (…, M, H) headwise."""
        if x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"OutputGate reads tokens of {self.embed_dim} features, got shape {tuple(x.shape)}"
            )
        return torch.sigmoid(self.proj(x))

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        """The gated context (…, M, H·d) for tokens x (…, M, E) and context (…, M, H·d)."""
        width = self.num_heads * self.head_dim
        if context.shape[-1] != width:
            raise ValueError(
                f"OutputGate gates {self.num_heads} heads of {self.head_dim} features "
                f"({width}), got a context of shape {tuple(context.shape)}"
            )
        g = self.gates(x)
        if self.kind == "elementwise":
            return context * g
        return (context.unflatten(-1, (self.num_heads, self.head_dim)) * g[..., None]).flatten(-2)
