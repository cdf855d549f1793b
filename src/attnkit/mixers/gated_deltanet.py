"""The Gated DeltaNet layer (Yang, Kautz and Hatamizadeh 2024, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", §3.4 and Figure 1) as Qwen3-Next builds it, as a token mixer: equal to
transformers' ``Qwen3NextGatedDeltaNet`` with its weights copied.

From the layer input u (B, N, E), with H_k query/key heads of d_k and H_v = r·H_k value heads of
d_v (grouped value heads: value head h reads query/key head h // r):

1. projections give q, k (H_k·d_k each), v and the gate z (H_v·d_v each), and per value head
   the writing strength's logit b and the decay's input a;
2. a short causal depthwise convolution over [q, k, v], then SiLU
   (:class:`attnkit.mixers.ShortConv`);
3. q and k are L2-normalised per head, q scaled by d_k^−1/2; β_t = σ(b_t) and
   g_t = −exp(A_log)·softplus(a_t + b_Δ) (one per value head);
4. the gated delta rule per value head, S_t = e^{g_t} (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,
   o_t = S_tᵀ q_t (Yang et al. eq. 10);
5. the gated RMSNorm per value head, norm first: (w ⊙ RMSNorm(o)) ⊙ SiLU(z)
   (:class:`attnkit.mixers.GatedRMSNorm`), then the output projection.

The rule runs on the kernels of :mod:`attnkit.linear_family.deltanet` (the WY chunkwise form for
a sequence, the recurrence for a decoding step). The per-head part
:class:`attnkit.linear_family.GatedDeltaNet` cannot be used as it is: it reads β and g from the
head's key, while here they are the layer's own projections of the input; the mixer calls the
kernels with its β and g directly.

Weights: transformers stores ``in_proj_qkvz`` and ``in_proj_ba`` with the rows of each key head's
group interleaved ([q_i, k_i, v_i, z_i] for key head i); here their rows are in blocks
([q, k, v, z] and [b, a], each head-major), so that the convolution reads one contiguous slice.
:meth:`GatedDeltaNetMixer.from_transformers` reorders the rows; the outputs are the same.

Padding and caching: a key-padding mask removes a position entirely — its inputs do not reach the
convolution, β = 0 and g = 0 there (the state neither decays nor is written) and its output is 0
— so a padded batch equals each sequence alone, also for the state kept for decoding.
transformers zeroes padded inputs only, so its state keeps decaying over a right padding (its
outputs at real positions agree). The cache (:class:`attnkit.mixers.MixerCache`) holds
``"conv"`` ((B, K − 1, 2 H_k d_k + H_v d_v)) and ``"delta"`` (the state, (B, H_v, d_k, d_v),
laid out as transformers').
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.linear_family.deltanet import delta_chunkwise, delta_recurrent, l2_normalize
from attnkit.mixers.base import (
    REGISTRY,
    MixerCache,
    TokenMixer,
    check_state,
)
from attnkit.mixers.conv import ShortConv, zero_padding
from attnkit.mixers.gated_norm import GatedRMSNorm

__all__ = ["GatedDeltaNetMixer"]


@REGISTRY.register("gated_deltanet")
class GatedDeltaNetMixer(TokenMixer):
    """The Gated DeltaNet layer of Qwen3-Next: x (B, N, embed_dim) → (B, N, embed_dim) (see
    the module docstring).

    Args:
        embed_dim: E, the size of the residual stream.
        num_heads: H_k, the query/key heads.
        head_dim: d_k, the size of a query/key head.
        num_v_heads: H_v, the value heads (a multiple of H_k; default H_k).
        head_v_dim: d_v, the size of a value head (default d_k).
        conv_kernel: K, the short convolution's kernel.
        chunk_size: positions per chunk of the delta rule (any value gives the same outputs;
            it only trades memory for speed).
        eps: the norm's epsilon.

    Initialised as transformers' ``Qwen3NextGatedDeltaNet``: A ∈ [0.01, 16] uniform, b_Δ = 1,
    the norm weights 1, no biases.

    Cache states (:attr:`state_names`, :meth:`state_shapes`):

    - ``"conv"``: (B, K − 1, 2·H_k·d_k + H_v·d_v), the short convolution's last K − 1 real
      inputs ([q, k, v]), in x's dtype;
    - ``"delta"``: (B, H_v, d_k, d_v), the delta rule's state S of each value head (as
      transformers' recurrent state), in x's dtype promoted to at least float32.
    """

    state_names: ClassVar[dict[str, str]] = {
        "conv": "(B, K − 1, 2·H_k·d_k + H_v·d_v): the short convolution's last K − 1 real "
        "inputs ([q, k, v])",
        "delta": "(B, H_v, d_k, d_v): the delta rule's state of each value head",
    }

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int,
        *,
        num_v_heads: int | None = None,
        head_v_dim: int | None = None,
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
        self.num_v_heads = num_heads if num_v_heads is None else num_v_heads
        arguments.positive_int(self.num_v_heads, "num_v_heads")
        self.head_v_dim = head_dim if head_v_dim is None else head_v_dim
        arguments.positive_int(self.head_v_dim, "head_v_dim")
        if self.num_v_heads % num_heads:
            raise ValueError(
                f"num_v_heads {self.num_v_heads} must be a multiple of num_heads {num_heads} "
                "(each query/key head serves num_v_heads / num_heads value heads)"
            )
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        self.key_dim = num_heads * head_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        kw = {"device": device, "dtype": dtype}
        self.in_proj_qkvz = nn.Linear(
            embed_dim, 2 * self.key_dim + 2 * self.value_dim, bias=False, **kw
        )
        self.in_proj_ba = nn.Linear(embed_dim, 2 * self.num_v_heads, bias=False, **kw)
        self.conv = ShortConv(
            2 * self.key_dim + self.value_dim, conv_kernel, bias=False, activation="silu", **kw
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads, **kw))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, **kw).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(self.head_v_dim, eps=eps, order="norm_first", **kw)
        self.out_proj = nn.Linear(self.value_dim, embed_dim, bias=False, **kw)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"num_v_heads={self.num_v_heads}, head_v_dim={self.head_v_dim}, "
            f"conv_kernel={self.conv.kernel_size}, chunk_size={self.chunk_size}"
        )

    def state_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {
            "conv": self.conv.state_shape(batch),
            "delta": (batch, self.num_v_heads, self.head_dim, self.head_v_dim),
        }

    @classmethod
    def from_transformers(cls, module: nn.Module, **overrides) -> GatedDeltaNetMixer:
        """The mixer equal to a transformers ``Qwen3NextGatedDeltaNet`` ``module``, its weights
        copied (the projections' rows reordered into blocks; same device and dtype).
        ``overrides`` (e.g. ``chunk_size``) replace the sizes read from the module."""
        if not hasattr(module, "in_proj_qkvz") or not hasattr(module, "in_proj_ba"):
            raise TypeError(
                f"module must be a transformers Qwen3NextGatedDeltaNet, got {type(module).__name__}"
            )
        sizes = {
            "embed_dim": module.hidden_size,
            "num_heads": module.num_k_heads,
            "head_dim": module.head_k_dim,
            "num_v_heads": module.num_v_heads,
            "head_v_dim": module.head_v_dim,
            "conv_kernel": module.conv_kernel_size,
            "eps": module.norm.variance_epsilon,
        }
        weight = module.in_proj_qkvz.weight
        layer = cls(**(sizes | overrides), device=weight.device, dtype=weight.dtype)
        hk, dk, dv = module.num_k_heads, module.head_k_dim, module.head_v_dim
        r = module.num_v_heads // hk
        grouped = weight.view(hk, 2 * dk + 2 * r * dv, -1)  # per key head: q, k, v, z
        q, k, v, z = grouped.split([dk, dk, r * dv, r * dv], 1)
        ba = module.in_proj_ba.weight.view(hk, 2 * r, -1)  # per key head: b, a
        with torch.no_grad():
            blocks = [t.reshape(-1, t.shape[-1]) for t in (q, k, v, z)]
            layer.in_proj_qkvz.weight.copy_(torch.cat(blocks, 0))
            layer.in_proj_ba.weight.copy_(
                torch.cat([t.reshape(-1, t.shape[-1]) for t in ba.split(r, 1)], 0)
            )
            layer.conv.weight.copy_(module.conv1d.weight)
            if module.conv1d.bias is not None:
                raise ValueError("a convolution bias is not part of this layer")
            layer.dt_bias.copy_(module.dt_bias)
            layer.A_log.copy_(module.A_log)
            layer.norm.weight.copy_(module.norm.weight)
            layer.out_proj.weight.copy_(module.out_proj.weight)
        return layer

    def mix(self, x: Tensor, keep: Tensor | None, cache: MixerCache | None) -> Tensor:
        b, n, _ = x.shape
        hk, dk, hv, dv = self.num_heads, self.head_dim, self.num_v_heads, self.head_v_dim
        r = hv // hk
        work = torch.promote_types(x.dtype, torch.float32)
        if cache is not None:
            check_state(self, cache, "delta", (b, hv, dk, dv), work)
        qkv, z = self.in_proj_qkvz(x).split([2 * self.key_dim + self.value_dim, self.value_dim], -1)
        beta, a = self.in_proj_ba(x).to(work).split(hv, -1)
        qkv = self.conv(qkv, mask=keep, cache=cache).to(work)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        # value heads as (H_k, r) so that a query/key head broadcasts over its value heads
        q = l2_normalize(q.view(b, n, hk, 1, dk).permute(0, 2, 3, 1, 4)) / math.sqrt(dk)
        k = l2_normalize(k.view(b, n, hk, 1, dk).permute(0, 2, 3, 1, 4))
        v = v.view(b, n, hk, r, dv).permute(0, 2, 3, 1, 4)
        beta = torch.sigmoid(beta)
        g = -torch.exp(self.A_log.to(work)) * F.softplus(a + self.dt_bias.to(work))
        # a padded position neither decays nor writes the state
        beta, g = (
            zero_padding(t, keep).view(b, n, hk, r).permute(0, 2, 3, 1).unsqueeze(-1)
            for t in (beta, g)
        )
        state = None if cache is None else cache.states.get("delta")
        if state is not None:
            state = state.view(b, hk, r, dk, dv)
        if cache is not None and n == 1:
            o, state = delta_recurrent(q, k, v, beta, g, state)
        else:
            o, state = delta_chunkwise(q, k, v, beta, g, self.chunk_size, state)
        o = o.permute(0, 3, 1, 2, 4).reshape(b, n, hv, dv)
        o = self.norm(o, z.view(b, n, hv, dv).to(work)).reshape(b, n, self.value_dim)
        y = self.out_proj(o.to(x.dtype))
        if cache is not None:
            cache.advance(n, delta=state.reshape(b, hv, dk, dv))
        return zero_padding(y, keep)
