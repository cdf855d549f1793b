"""Gated attention: a sigmoid gate on the attention's output, before the output projection
(Qiu et al. 2025, "Gated Attention for Large Language Models: Non-linearity, Sparsity, and
Attention-Sink-Free", arXiv 2505.06708; the full-attention layers of Qwen3-Next).

For a layer input x_i (the query token) and the concatenated heads' context o_i = concat_h
Attn_h(…)_i (H·d features), the layer's output is

    y_i = (o_i ⊙ σ(x_i W_g + b_g)) W^O,

with the gate either **elementwise** (W_g of E × H·d: one gate per head and channel, the
paper's best variant, G1 in its Table 1, and Qwen3-Next's) or **headwise** (W_g of E × H: one
scalar per head, broadcast over its d channels). The gate reads the query token, so it adds a
query-dependent non-linearity between W^V and W^O (which otherwise compose into one low-rank
map) and lets a head output nearly nothing — the paper finds the sigmoid gate sparse and the
attention sink gone.

:class:`OutputGate` is the gate; ``ak.MultiHeadAttention(..., gate="elementwise")`` holds one
(see its ``gate`` argument). :func:`from_transformers` builds the layer equal to transformers'
``Qwen3NextAttention`` with its weights: QK-norm per head (RMSNorm, gains 1 + w), then partial
rotary embeddings in the rotate-half layout, grouped-query attention and the elementwise gate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.positions.rope_scaling import ScaledRotary
from attnkit.qk_chain import HeadNorm

__all__ = ["GATE_KINDS", "OutputGate", "from_transformers"]

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


def from_transformers(module: nn.Module) -> Any:
    """The :class:`attnkit.MultiHeadAttention` equal to transformers' ``Qwen3NextAttention``
    ``module``, with its weights (copied, in their dtype and on their device).

    Qwen3-Next's ``q_proj`` makes, per head, the d query features followed by the d gate
    features; they become W^Q and the elementwise gate's W_g. Its q/k RMSNorms scale by
    1 + w (zero-centred gains), copied as HeadNorm gains 1 + w; its rotary embedding turns the
    first ``partial_rotary_factor`` · d features in the rotate-half layout (``ScaledRotary``
    with ``layout="halves"``). The layer is called as ``mha(x, mask=...)`` with a causal mask
    (and key padding), and decodes with an :class:`attnkit.kv_cache.LayerCache`.

    Raises:
        TypeError: ``module`` is not a ``Qwen3NextAttention``.
        ValueError: a rotary scaling other than the default (not built here).
    """
    import attnkit as ak

    if type(module).__name__ != "Qwen3NextAttention":
        raise TypeError(
            f"from_transformers builds from transformers' Qwen3NextAttention, got "
            f"{type(module).__name__}"
        )
    config = module.config
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"from_transformers: rope_type {rope.get('rope_type')!r} is not built; only the "
            "default rotary embedding (partial_rotary_factor allowed) is"
        )
    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, module.head_dim
    embed = config.hidden_size
    weight = module.o_proj.weight
    bias = module.q_proj.bias is not None
    norm = HeadNorm(d, eps=module.q_norm.eps, device=weight.device, dtype=weight.dtype)
    mha = ak.MultiHeadAttention(
        embed,
        heads,
        num_kv_heads=kv_heads,
        head_dim=d,
        bias=bias,
        dropout=float(config.attention_dropout),
        position=ScaledRotary(
            float(rope.get("rope_theta", 10000.0)),
            fraction=float(rope.get("partial_rotary_factor", 1.0)),
            layout="halves",
        ),
        qk=[norm, "position"],
        gate="elementwise",
        device=weight.device,
        dtype=weight.dtype,
    )
    with torch.no_grad():
        # q_proj rows per head: [query (d) | gate (d)]
        q_rows = module.q_proj.weight.unflatten(0, (heads, 2, d))
        mha.in_proj_weight.copy_(
            torch.cat([q_rows[:, 0].flatten(0, 1), module.k_proj.weight, module.v_proj.weight])
        )
        mha.gate.proj.weight.copy_(q_rows[:, 1].flatten(0, 1))
        if bias:
            q_bias = module.q_proj.bias.unflatten(0, (heads, 2, d))
            mha.in_proj_bias.copy_(
                torch.cat([q_bias[:, 0].flatten(), module.k_proj.bias, module.v_proj.bias])
            )
            mha.gate.proj.bias.copy_(q_bias[:, 1].flatten())
            mha.out_proj.bias.copy_(module.o_proj.bias)
        mha.out_proj.weight.copy_(module.o_proj.weight)
        norm.q_weight.copy_(1 + module.q_norm.weight)
        norm.k_weight.copy_(1 + module.k_norm.weight)
    return mha.train(module.training)
