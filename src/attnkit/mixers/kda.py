"""The Kimi Delta Attention layer (Kimi Team 2025, "Kimi Linear: An Expressive, Efficient
Attention Architecture", §3 and Figure 3) as a token mixer: equal to transformers'
``KimiLinearDeltaAttention`` (its torch path) with its weights copied.

From the layer input x (B, N, E), with H heads of d channels:

1. projections give q, k, v (H·d each);
2. a short causal depthwise convolution over [q, k, v], then SiLU
   (:class:`attnkit.mixers.ShortConv`);
3. q and k are L2-normalised per head, q scaled by d^−1/2; the writing strength
   β_t = σ(W_b x_t) (one per head) and the fine-grained decay
   g_t = −exp(A_log)·softplus(W_f^b W_f^a x_t + b_Δ) (one per channel of each head, through a
   rank-d projection);
4. the KDA rule per head, S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ,
   o_t = S_tᵀ q_t (:mod:`attnkit.linear_family.kda`: the chunkwise WY form for a sequence, the
   recurrence for a decoding step);
5. the output norm per head, norm first and a sigmoid gate: (w ⊙ RMSNorm(o)) ⊙ σ(W_g^b W_g^a x)
   (:class:`attnkit.mixers.GatedRMSNorm` with ``activation="sigmoid"``: the gate is a sigmoid
   here, as in the paper and transformers' ``KimiLinearRMSNormGated``), then the output
   projection.

The per-head part :class:`attnkit.linear_family.KimiDeltaAttention` reads β and g from the head's
key; this layer reads them from x through its own projections and calls the kernels directly.

Padding and caching: a key-padding mask removes a position entirely — its inputs do not reach
the convolution, β = 0 and g = 0 there (the state neither decays nor is written) and its output
is 0 — so a padded batch equals each sequence alone, also for the state kept for decoding.
transformers zeroes padded inputs only, so its state keeps decaying over a right padding (its
outputs at real positions agree). The cache (:class:`attnkit.mixers.MixerCache`) holds
``"conv"`` ((B, K − 1, 3 H d)) and ``"delta"`` (the state, (B, H, d, d), laid out as
transformers').
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.linear_family.deltanet import l2_normalize
from attnkit.linear_family.kda import kda_chunkwise, kda_recurrent
from attnkit.mixers.base import (
    REGISTRY,
    MixerCache,
    TokenMixer,
    check_state,
)
from attnkit.mixers.conv import ShortConv, zero_padding
from attnkit.mixers.gated_norm import GatedRMSNorm

__all__ = ["KimiDeltaAttentionMixer"]


@REGISTRY.register("kda")
class KimiDeltaAttentionMixer(TokenMixer):
    """The KDA layer of Kimi Linear: x (B, N, embed_dim) → (B, N, embed_dim) (see the module
    docstring).

    Args:
        embed_dim: E, the size of the residual stream.
        num_heads: H.
        head_dim: d, the size of a head (also the rank of the decay's and the gate's
            projections, as in Kimi Linear).
        conv_kernel: K, the short convolution's kernel.
        chunk_size: positions per chunk of the rule (any value gives the same outputs; it only
            trades memory for speed).
        eps: the output norm's epsilon.

    Initialised as transformers' ``KimiLinearDeltaAttention`` (flash-linear-attention's
    initialisation): A ∈ [1, 16] uniform, b_Δ = softplus⁻¹(Δ) with Δ log-uniform in
    [10⁻³, 10⁻¹], the norm weights 1, no biases.

    Cache states (:attr:`state_names`, :meth:`state_shapes`):

    - ``"conv"``: (B, K − 1, 3·H·d), the short convolution's last K − 1 real inputs
      ([q, k, v]), in x's dtype;
    - ``"delta"``: (B, H, d, d), the KDA state S of each head (rows: key channels, columns:
      value channels, as transformers' recurrent state), in x's dtype promoted to at least
      float32.
    """

    state_names: ClassVar[dict[str, str]] = {
        "conv": "(B, K − 1, 3·H·d): the short convolution's last K − 1 real inputs ([q, k, v])",
        "delta": "(B, H, d, d): the KDA state of each head (key channels × value channels)",
    }

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int,
        *,
        conv_kernel: int = 4,
        chunk_size: int = 64,
        eps: float = 1e-6,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        inner = num_heads * head_dim
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, inner, bias=False, **kw)
        self.k_proj = nn.Linear(embed_dim, inner, bias=False, **kw)
        self.v_proj = nn.Linear(embed_dim, inner, bias=False, **kw)
        self.conv = ShortConv(3 * inner, conv_kernel, bias=False, activation="silu", **kw)
        self.f_a_proj = nn.Linear(embed_dim, head_dim, bias=False, **kw)
        self.f_b_proj = nn.Linear(head_dim, inner, bias=False, **kw)
        self.A_log = nn.Parameter(torch.empty(num_heads, **kw).uniform_(1, 16).log())
        dt = torch.empty(inner, **kw).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(Δ)
        self.b_proj = nn.Linear(embed_dim, num_heads, bias=False, **kw)
        self.g_a_proj = nn.Linear(embed_dim, head_dim, bias=False, **kw)
        self.g_b_proj = nn.Linear(head_dim, inner, bias=False, **kw)
        self.o_norm = GatedRMSNorm(head_dim, eps=eps, activation="sigmoid", **kw)
        self.o_proj = nn.Linear(inner, embed_dim, bias=False, **kw)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"conv_kernel={self.conv.kernel_size}, chunk_size={self.chunk_size}"
        )

    def state_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        h, d = self.num_heads, self.head_dim
        return {"conv": self.conv.state_shape(batch), "delta": (batch, h, d, d)}

    @classmethod
    def from_transformers(cls, module: nn.Module, **overrides) -> KimiDeltaAttentionMixer:
        """The mixer equal to a transformers ``KimiLinearDeltaAttention`` ``module``, its weights
        copied (same device and dtype). ``overrides`` (e.g. ``chunk_size``) replace the sizes
        read from the module. Raises TypeError for another module and ValueError for an
        activation other than SiLU or a convolution bias, which this layer does not have."""
        if not all(hasattr(module, a) for a in ("forget_gate", "b_proj", "g_a_proj", "o_norm")):
            raise TypeError(
                f"module must be a transformers KimiLinearDeltaAttention, got "
                f"{type(module).__name__}"
            )
        if module.activation != "silu":
            raise ValueError(
                f"the short convolution's activation must be 'silu', got {module.activation!r}"
            )
        if module.conv1d.bias is not None:
            raise ValueError("a convolution bias is not part of this layer")
        sizes = {
            "embed_dim": module.hidden_size,
            "num_heads": module.num_heads,
            "head_dim": module.head_dim,
            "conv_kernel": module.conv_kernel_size,
            "eps": module.o_norm.variance_epsilon,
        }
        weight = module.q_proj.weight
        layer = cls(**(sizes | overrides), device=weight.device, dtype=weight.dtype)
        gate = module.forget_gate
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj"):
                getattr(layer, name).weight.copy_(getattr(module, name).weight)
            layer.conv.weight.copy_(module.conv1d.weight)
            layer.f_a_proj.weight.copy_(gate.f_a_proj.weight)
            layer.f_b_proj.weight.copy_(gate.f_b_proj.weight)
            layer.A_log.copy_(gate.A_log.reshape(-1))
            layer.dt_bias.copy_(gate.dt_bias)
            layer.o_norm.weight.copy_(module.o_norm.weight)
        return layer

    def mix(self, x: Tensor, keep: Tensor | None, cache: MixerCache | None) -> Tensor:
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        work = torch.promote_types(x.dtype, torch.float32)
        if cache is not None:
            check_state(self, cache, "delta", (b, h, d, d), work)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        qkv = self.conv(qkv, mask=keep, cache=cache).to(work)
        q, k, v = (t.view(b, n, h, d).transpose(1, 2) for t in qkv.split(h * d, -1))
        q = l2_normalize(q) / math.sqrt(d)
        k = l2_normalize(k)
        f = self.f_b_proj(self.f_a_proj(x)).to(work) + self.dt_bias.to(work)
        g = -torch.exp(self.A_log.to(work))[:, None] * F.softplus(f.view(b, n, h, d))
        beta = torch.sigmoid(self.b_proj(x).to(work))
        # a padded position neither decays nor writes the state
        g = zero_padding(g, keep).transpose(1, 2)  # (B, H, N, d)
        beta = zero_padding(beta, keep).transpose(1, 2).unsqueeze(-1)  # (B, H, N, 1)
        state = None if cache is None else cache.states.get("delta")
        if cache is not None and n == 1:
            o, state = kda_recurrent(q, k, v, beta, g, state)
        else:
            o, state = kda_chunkwise(q, k, v, beta, g, self.chunk_size, state)
        gate = self.g_b_proj(self.g_a_proj(x)).to(work).view(b, n, h, d)
        o = self.o_norm(o.transpose(1, 2), gate)
        y = self.o_proj(o.reshape(b, n, h * d).to(x.dtype))
        if cache is not None:
            cache.advance(n, delta=state)
        return zero_padding(y, keep)
