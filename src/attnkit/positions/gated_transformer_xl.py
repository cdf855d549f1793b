"""GTrXL, the gated Transformer-XL (Parisotto et al., "Stabilizing Transformers for Reinforcement
Learning", 2019): the Transformer-XL layer with its layer norms moved onto the sublayer inputs
(the identity map reordering) and GRU-type gates in place of the residual connections.

Layer l, with E⁽ˡ⁻¹⁾ (B, M, D) the segment and M⁽ˡ⁻¹⁾ (B, P, D) the memory of earlier states:

    Ȳ⁽ˡ⁾ = RelativeMultiHeadAttention(LayerNorm([SG(M⁽ˡ⁻¹⁾) ∘ E⁽ˡ⁻¹⁾]))
    Y⁽ˡ⁾ = g⁽ˡ⁾_MHA(E⁽ˡ⁻¹⁾, ReLU(Ȳ⁽ˡ⁾))
    Ē⁽ˡ⁾ = f⁽ˡ⁾(LayerNorm(Y⁽ˡ⁾))                       (the position-wise feed-forward)
    E⁽ˡ⁾ = g⁽ˡ⁾_MLP(Y⁽ˡ⁾, ReLU(Ē⁽ˡ⁾))

with the GRU-type gate g(x, y) of the stream x and the sublayer output y:

    r = σ(W_r y + U_r x)
    z = σ(W_z y + U_z x − b_g)
    ĥ = tanh(W_g y + U_g (r ⊙ x))
    g(x, y) = (1 − z) ⊙ x + z ⊙ ĥ

A gate bias b_g > 0 makes z small at initialisation, so that each gate — and the layer — starts
close to the identity map (Parisotto et al.: this speeds up learning). The relative attention,
the feed-forward network and the two layer norms are those of
:class:`attnkit.positions.TransformerXLLayer`, applied in the order above.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.positions.transformer_xl import (
    TransformerXL,
    TransformerXLLayer,
    _memory,
    _segment,
)

__all__ = ["GRUGate", "GatedTransformerXL", "GatedTransformerXLLayer"]


@arguments.renamed(d_model="embed_dim")
class GRUGate(nn.Module):
    """g(x, y) = (1 − z) ⊙ x + z ⊙ ĥ (module docstring): x the residual stream, y the sublayer
    output, both (…, D).

    Args:
        embed_dim: D.
        gate_bias: the initial b_g (learned; > 0 starts the gate near the identity, z ≈ σ(−b_g)).
    """

    def __init__(self, embed_dim: int, gate_bias: float = 2.0, *, device=None, dtype=None) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        gate_bias = arguments.finite_float(gate_bias, "gate_bias")
        kw = {"device": device, "dtype": dtype}
        self.W_r = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
        self.U_r = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
        self.W_z = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
        self.U_z = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
        self.W_g = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
        self.U_g = nn.Linear(embed_dim, embed_dim, bias=False, **kw)
        self.b_g = nn.Parameter(torch.full((embed_dim,), gate_bias, **kw))

    def update(self, x: Tensor, y: Tensor) -> Tensor:
        """z = σ(W_z y + U_z x − b_g), how much of x is replaced."""
        return torch.sigmoid(self.W_z(y) + self.U_z(x) - self.b_g)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        r = torch.sigmoid(self.W_r(y) + self.U_r(x))
        z = self.update(x, y)
        candidate = torch.tanh(self.W_g(y) + self.U_g(r * x))
        return (1 - z) * x + z * candidate


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class GatedTransformerXLLayer(nn.Module):
    """One GTrXL layer (module docstring): pre-norm relative attention over [SG(memory) ∘ h]
    and feed-forward, each merged into the stream by a :class:`GRUGate`.

    Args:
        embed_dim: D. num_heads: H (dividing D). d_ff: feed-forward size (default 4D).
        gate_bias: the initial b_g of both gates.
        dropout: on the sublayer outputs.

    ``forward(h, memory=None, mask=None)`` as :meth:`TransformerXLLayer.forward`.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        gate_bias: float = 2.0,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        # its norm1 and norm2 serve as the pre-attention and pre-feed-forward layer norms
        self.xl = TransformerXLLayer(embed_dim, num_heads, d_ff, dropout=dropout, **kw)
        self.embed_dim = self.xl.embed_dim
        self.gate_attention = GRUGate(embed_dim, gate_bias, **kw)  # g_MHA
        self.gate_ff = GRUGate(embed_dim, gate_bias, **kw)  # g_MLP

    def forward(
        self, h: Tensor, memory: Tensor | None = None, mask: Tensor | None = None
    ) -> Tensor:
        """h (B, M, D) the segment E⁽ˡ⁻¹⁾, memory (B, P, D) (already detached) or None; mask
        (M, P + M) boolean, default causal aligned at the end. Returns E⁽ˡ⁾ (B, M, D)."""
        _segment(h, "h", self.embed_dim)
        _memory(memory, h, "memory")
        xl = self.xl
        context = xl.norm1(h if memory is None else torch.cat([memory, h], dim=-2))
        queries = context[..., context.shape[-2] - h.shape[-2] :, :]
        y_bar = xl.drop(xl.relative_attention(queries, context, mask))
        y = self.gate_attention(h, torch.relu(y_bar))
        e_bar = xl.drop(xl.ff(xl.norm2(y)))
        return self.gate_ff(y, torch.relu(e_bar))


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class GatedTransformerXL(TransformerXL):
    """A stack of :class:`GatedTransformerXLLayer` with Transformer-XL's segment-level recurrence
    (each layer's memory holds its inputs at the last ``mem_len`` positions, detached); see
    :class:`TransformerXL` for ``forward(x, memory)``.

    Args:
        layers: the number of layers. embed_dim, num_heads, d_ff, mem_len and dropout: as
            :class:`TransformerXL`.
        gate_bias: the initial b_g of every gate.
    """

    def __init__(
        self,
        layers: int,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        mem_len: int,
        gate_bias: float = 2.0,
        dropout: float = 0.0,
        device=None,
        dtype=None,
    ) -> None:
        kw = {"device": device, "dtype": dtype}
        super().__init__(layers, embed_dim, num_heads, d_ff, mem_len=mem_len, dropout=dropout, **kw)
        self.layers = nn.ModuleList(
            GatedTransformerXLLayer(
                embed_dim, num_heads, d_ff, gate_bias=gate_bias, dropout=dropout, **kw
            )
            for _ in range(layers)
        )
