"""The lightning attention layer of MiniMax-01 (MiniMax 2025, "MiniMax-01: Scaling Foundation
Models with Lightning Attention", §2.2; Qin et al. 2024, "Lightning Attention-2") as a token
mixer: equal to transformers' ``MiniMaxLightningAttention`` with its weights copied.

From the layer input x (B, N, E), with H heads of d channels:

1. one projection gives q, k and v, then SiLU (its rows per head: [q_h, k_h, v_h]);
2. lightning attention per head, S_t = λ_h S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t, with MiniMax's
   fixed decays λ_h (:class:`attnkit.linear_family.LightningAttention`, which depend on the
   layer's place l of L in its stack), neither scaled nor normalised;
3. an RMSNorm over all H·d channels together, gated by a sigmoid σ(W_g x)
   (:class:`attnkit.mixers.GatedRMSNorm` with ``activation="sigmoid"``), and the output
   projection.

Lightning Attention-2 tiles the sequence in blocks (MiniMax's ``block_size``, 256); the chunks
of the chunkwise form are those blocks, and their size only trades memory for speed (64 by
default, which runs faster on a CPU than 256; :meth:`LightningAttentionMixer.from_transformers`
keeps it).

Padding and caching: a key-padding mask removes a position entirely — its q, k, v are 0 and the
state does not decay there — and its output is 0, so a padded batch equals each sequence alone,
also for the state kept for decoding. transformers zeroes padded q, k, v only, so its state keeps
decaying over padding (at real positions the outputs agree for right and left padding). The
cache (:class:`attnkit.mixers.MixerCache`) holds ``"lightning"`` (the state, (B, H, d, d), as
transformers' ``MiniMaxCache`` linear cache).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.linear_family.base import Inputs
from attnkit.linear_family.lightning import LightningAttention
from attnkit.mixers.base import (
    REGISTRY,
    MixerCache,
    TokenMixer,
    check_state,
)
from attnkit.mixers.conv import zero_padding
from attnkit.mixers.gated_norm import GatedRMSNorm

__all__ = ["LightningAttentionMixer"]


@REGISTRY.register("lightning")
class LightningAttentionMixer(TokenMixer):
    """The lightning attention layer of MiniMax-01: x (B, N, embed_dim) → (B, N, embed_dim)
    (see the module docstring).

    Args:
        embed_dim: E, the size of the residual stream.
        num_heads: H.
        head_dim: d (default E / H).
        layer_idx, num_layers: the layer's place in its stack, which sets the decays
            (:func:`attnkit.linear_family.lightning.lightning_slopes`).
        chunk_size: positions per block (any value gives the same outputs).
        eps: the output norm's epsilon.

    Cache state (:attr:`state_names`, :meth:`state_shapes`; no convolution):

    - ``"lightning"``: (B, H, d, d), the state S of each head (key channels × value channels,
      as transformers' ``MiniMaxCache`` linear cache), in x's dtype promoted to at least
      float32.
    """

    state_names: ClassVar[dict[str, str]] = {
        "lightning": "(B, H, d, d): the state of each head (key channels × value channels)",
    }

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int | None = None,
        *,
        layer_idx: int = 0,
        num_layers: int = 1,
        chunk_size: int = 64,
        eps: float = 1e-6,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim {embed_dim} must be a multiple of num_heads {num_heads} when "
                    "head_dim is not given"
                )
            head_dim = embed_dim // num_heads
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        inner = num_heads * head_dim
        kw = {"device": device, "dtype": dtype}
        self.attention = LightningAttention(
            head_dim, num_heads, layer_idx=layer_idx, num_layers=num_layers,
            chunk_size=chunk_size, **kw,
        )  # fmt: skip
        self.qkv_proj = nn.Linear(embed_dim, 3 * inner, bias=False, **kw)
        self.norm = GatedRMSNorm(inner, eps=eps, activation="sigmoid", **kw)
        self.output_gate = nn.Linear(embed_dim, inner, bias=False, **kw)
        self.out_proj = nn.Linear(inner, embed_dim, bias=False, **kw)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}"

    def state_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        h, d = self.num_heads, self.head_dim
        return {"lightning": (arguments.positive_int(batch, "batch"), h, d, d)}

    @classmethod
    def from_transformers(cls, module: nn.Module, **overrides) -> LightningAttentionMixer:
        """The mixer equal to a transformers ``MiniMaxLightningAttention`` ``module``, its
        weights copied (same device and dtype); its decays are computed in float64 from the
        module's layer_idx and num_hidden_layers (transformers keeps float32 buffers).
        ``overrides`` (e.g. ``chunk_size``) replace the sizes read from the module. Raises
        TypeError for another module and ValueError for an activation other than SiLU."""
        if not all(hasattr(module, a) for a in ("qkv_proj", "output_gate", "slope_rate")):
            raise TypeError(
                f"module must be a transformers MiniMaxLightningAttention, got "
                f"{type(module).__name__}"
            )
        if type(module.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            raise ValueError(
                f"the activation of q, k, v must be SiLU, got {type(module.act_fn).__name__}"
            )
        weight = module.qkv_proj.weight
        sizes = {
            "embed_dim": weight.shape[1],
            "num_heads": module.num_attention_heads,
            "head_dim": module.head_dim,
            "layer_idx": module.layer_idx,
            "num_layers": module.num_hidden_layers,
            "eps": module.norm.variance_epsilon,
        }
        layer = cls(**(sizes | overrides), device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            for name in ("qkv_proj", "output_gate", "out_proj"):
                getattr(layer, name).weight.copy_(getattr(module, name).weight)
            layer.norm.weight.copy_(module.norm.weight)
        return layer

    def mix(self, x: Tensor, keep: Tensor | None, cache: MixerCache | None) -> Tensor:
        b, n, _ = x.shape
        h, d = self.num_heads, self.head_dim
        work = torch.promote_types(x.dtype, torch.float32)
        if cache is not None:
            check_state(self, cache, "lightning", (b, h, d, d), work)
        qkv = zero_padding(F.silu(self.qkv_proj(x)).to(work), keep)
        q, k, v = qkv.view(b, n, h, 3 * d).transpose(1, 2).split(d, -1)  # (B, H, N, d) each
        g = self.attention.log_decay.to(work)
        state = None if cache is None else cache.states.get("lightning")
        if state is not None and n == 1 and keep is None:
            # one decoding step: S ← λ S + k vᵀ, o = Sᵀ q (the recurrent form, inlined)
            state = g.exp() * state + k.transpose(-1, -2) @ v
            o = q @ state
        else:
            g = g.expand(b, h, n, 1)
            if keep is not None:  # a padded position does not decay the state
                zero = torch.zeros((), dtype=work, device=x.device)
                g = torch.where(keep[:, None, :, None], g, zero)
            form = "recurrent" if cache is not None and n == 1 else "chunkwise"
            o, state = self.attention.run(Inputs(q, k, v, g), form, state)
        o = self.norm(o.transpose(1, 2).reshape(b, n, h * d), self.output_gate(x).to(work))
        y = self.out_proj(o.to(x.dtype))
        if cache is not None:
            cache.advance(n, lightning=state)
        return zero_padding(y, keep)
