"""Perceiver-style latent cross-attention (Jaegle, Gimeno, Brock, Zisserman, Vinyals and
Carreira, "Perceiver: General Perception with Iterative Attention", ICML 2021; the decoder of
Perceiver IO, Jaegle et al. 2022; Soydaner 5.3).

A learned latent array Z₀ (n × d), n ≪ N, cross-attends to the N inputs X, then latent
self-attention blocks refine it (pre-LayerNorm Transformer blocks, as in the paper):

    Z ← Z₀ + CrossAttn(LN(Z₀), LN(X)),   Z ← Z + MLP(LN(Z))
    Z ← Z + SelfAttn(LN(Z)),             Z ← Z + MLP(LN(Z))      (``num_self_blocks`` times)

The cross-attention costs O(n·N) and the latent blocks O(n²), so the whole encoder is linear in
N. Optionally (``query_dim``) a decoder cross-attention reads the latents with output queries
(Perceiver IO): out = CrossAttn(LN(Q), LN(Z)), O(n·O). Without positional features of the inputs
the latents are invariant to permutations of the inputs.

Each attention is an :class:`attnkit.MultiHeadAttention`. A key-padding mask (B, 1, N) removes
padded inputs from the cross-attention; for an item whose every input is padding no attention
has anything to attend to and every weight is 0 (the latents are then the learned Z₀ passed
through the MLPs).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.multihead import MultiHeadAttention

__all__ = ["PerceiverEncoder", "PerceiverOutput"]


class PerceiverOutput(NamedTuple):
    """The latents (B, n, d), the decoded output (B, O, query_dim) when queries were given, and
    on request the weights: cross (B, H, n, N), one (B, H, n, n) per latent self-attention block,
    decoder (B, H, O, n)."""

    latents: Tensor
    decoded: Tensor | None = None
    cross_weights: Tensor | None = None
    self_weights: tuple[Tensor, ...] = ()
    decoder_weights: Tensor | None = None

    @property
    def representation(self) -> Tensor:
        return self.latents if self.decoded is None else self.decoded

    def named_weights(self) -> dict[str, Tensor]:
        named = {"cross": self.cross_weights, "decoder": self.decoder_weights}
        named |= {f"self{i}": w for i, w in enumerate(self.self_weights)}
        return {k: w for k, w in named.items() if w is not None}


def _mlp(d: int, d_ff: int, kw: dict) -> nn.Sequential:
    return nn.Sequential(
        nn.LayerNorm(d, **kw), nn.Linear(d, d_ff, **kw), nn.GELU(), nn.Linear(d_ff, d, **kw)
    )


@REGISTRY.register("perceiver")
class PerceiverEncoder(nn.Module):
    """A learned latent array cross-attending to the inputs, then latent self-attention.

    Args:
        latent_dim: d, the size of each latent.
        input_dim: the size of each input (keys and values of the cross-attention).
        num_latents: n, the number of latents.
        num_heads: heads of every attention (d and ``query_dim`` divisible by it).
        num_self_blocks: latent self-attention blocks after the cross-attention.
        d_ff: hidden size of the MLPs (default d).
        query_dim: give it to build the decoder cross-attention (queries of this size).

    ``forward(x, mask=None, queries=None, need_weights=False)``: x (B, N, input_dim),
    key-padding mask (B, 1, N), queries (B, O, query_dim) → :class:`PerceiverOutput`.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        latent_dim: int,
        input_dim: int,
        num_latents: int,
        num_heads: int = 1,
        num_self_blocks: int = 1,
        d_ff: int | None = None,
        *,
        query_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.latent_dim = arguments.positive_int(latent_dim, "latent_dim")
        self.input_dim = arguments.positive_int(input_dim, "input_dim")
        self.num_latents = arguments.positive_int(num_latents, "num_latents")
        arguments.nonnegative_int(num_self_blocks, "num_self_blocks")
        self.query_dim = arguments.optional_positive_int(query_dim, "query_dim")
        d = latent_dim
        d_ff = d if d_ff is None else arguments.positive_int(d_ff, "d_ff")
        kw = {"device": device, "dtype": dtype}
        # Latents initialised from a truncated normal (std 0.02), as in the paper's code base.
        self.latents = nn.Parameter(
            nn.init.trunc_normal_(torch.empty(num_latents, d, **kw), 0, 0.02, -2, 2)
        )
        self.latent_norm = nn.LayerNorm(d, **kw)
        self.input_norm = nn.LayerNorm(input_dim, **kw)
        self.cross = MultiHeadAttention(d, num_heads, kdim=input_dim, vdim=input_dim, **kw)
        self.cross_mlp = _mlp(d, d_ff, kw)
        self.self_norms = nn.ModuleList(nn.LayerNorm(d, **kw) for _ in range(num_self_blocks))
        self.self_attentions = nn.ModuleList(
            MultiHeadAttention(d, num_heads, **kw) for _ in range(num_self_blocks)
        )
        self.self_mlps = nn.ModuleList(_mlp(d, d_ff, kw) for _ in range(num_self_blocks))
        if query_dim is None:
            self.decoder = None
        else:
            self.query_norm = nn.LayerNorm(query_dim, **kw)
            self.decoder_norm = nn.LayerNorm(d, **kw)
            self.decoder = MultiHeadAttention(query_dim, num_heads, kdim=d, vdim=d, **kw)

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([7, 4]), 7)
        module = cls(8, 6, 3, 2, 1, query_dim=4)
        queries = example_tensor(2, 2, 4, seed=61)
        return module, (example_tensor(2, 7, 6, seed=60),), {"mask": mask, "queries": queries}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SPECIALIZED]

    def extra_repr(self) -> str:
        return (
            f"latent_dim={self.latent_dim}, input_dim={self.input_dim}, "
            f"num_latents={self.num_latents}, query_dim={self.query_dim}"
        )

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        queries: Tensor | None = None,
        need_weights: bool = False,
    ) -> PerceiverOutput:
        who = type(self).__name__
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"{who}: x must be a floating tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.input_dim:
            raise ValueError(
                f"{who}: x must be (B, N, {self.input_dim}), got shape {tuple(x.shape)}"
            )
        b = x.shape[0]
        any_input = None
        if mask is not None:
            if isinstance(mask, Tensor) and mask.dim() >= 2 and mask.shape[-2] != 1:
                raise ValueError(
                    f"{who} takes a key-padding mask (B, 1, N) over the inputs (the queries are "
                    f"the latents), got shape {tuple(mask.shape)}"
                )
            masks.check(mask, torch.Size((b, 1, x.shape[1])))
            # (B, 1, 1): an item with no real input attends to nothing anywhere (weights 0).
            any_input = mask.broadcast_to(b, 1, x.shape[1]).any(-1, keepdim=True)
        if queries is not None and self.decoder is None:
            raise ValueError(f"{who} was built without query_dim: it has no decoder for queries")
        if queries is not None and (
            queries.dim() != 3 or queries.shape[0] != b or queries.shape[-1] != self.query_dim
        ):
            raise ValueError(
                f"{who}: queries must be (B, O, {self.query_dim}) with B = {b}, got shape "
                f"{tuple(queries.shape)}"
            )
        z0 = self.latents.expand(b, -1, -1)
        cross = self.cross(
            self.latent_norm(z0), self.input_norm(x), mask=mask, need_weights=need_weights
        )
        z = z0 + cross.context
        z = z + self.cross_mlp(z)
        self_weights = []
        for norm, attention, mlp in zip(
            self.self_norms, self.self_attentions, self.self_mlps, strict=True
        ):
            out = attention(norm(z), mask=any_input, need_weights=need_weights)
            z = z + out.context
            z = z + mlp(z)
            self_weights.append(out.weights)
        if queries is None:
            decoded = decoder_weights = None
        else:
            out = self.decoder(
                self.query_norm(queries),
                self.decoder_norm(z),
                mask=any_input,
                need_weights=need_weights,
            )
            decoded, decoder_weights = out.context, out.weights
        weights = tuple(self_weights) if need_weights else ()
        return PerceiverOutput(z, decoded, cross.weights, weights, decoder_weights)
