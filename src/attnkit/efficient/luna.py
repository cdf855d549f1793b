"""Luna: linear unified nested attention (Ma, Kong, Wang, Zhou, May, Ma and Zettlemoyer, "Luna:
Linear Unified Nested Attention", NeurIPS 2021; Soydaner 5.3).

Softmax attention over N inputs is nested into two attentions through an extra sequence P of a
fixed length l (Luna eqs. 3-4):

    pack:    P' = Attn(P, X)      (l queries attend to the N inputs: (l × N) weights)
    unpack:  Y  = Attn(X, P')     (the N inputs attend to the l packed vectors: (N × l) weights)

each an :class:`attnkit.MultiHeadAttention` (any score, alignment or per-head part plugs in), so
time and memory are O(l·N) instead of O(N²). The layer returns Y and P'; P' is the next layer's P
(the first layer's P is a learned l × d parameter, as in the paper). A full Luna layer adds the
residuals and layer norms around this: X' = LN(Y + X), P'' = LN(P' + P), then a feed-forward.

Masks: a key-padding mask (B, 1, N) over X applies to the pack step (the padded inputs are never
packed); the padded inputs' own rows attend to nothing in the unpack step (their rows of Y are
padding). Causal masks are refused: P' mixes every input into every packed vector, so Y_i would
see inputs j > i; the paper's causal Luna is a different computation (a per-position cumulative
pack), not a mask on this one.
"""

from __future__ import annotations

import copy
import math
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.multihead import MultiHeadAttention
from attnkit.scores import Score

__all__ = ["LunaAttention", "LunaOutput"]


class LunaOutput(NamedTuple):
    """Y (B, N, d), the packed sequence P' (B, l, d) and, on request, the pack weights
    (B, H, l, N) and the unpack weights (B, H, N, l)."""

    output: Tensor
    packed: Tensor
    pack_weights: Tensor | None = None
    unpack_weights: Tensor | None = None

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        named = {"pack": self.pack_weights, "unpack": self.unpack_weights}
        return {k: w for k, w in named.items() if w is not None}


@REGISTRY.register("luna")
class LunaAttention(nn.Module):
    """Luna attention: pack P' = Attn(P, X), unpack Y = Attn(X, P') (Luna eqs. 3-4).

    Args:
        embed_dim: d, the size of X, P and both outputs.
        num_heads: heads of both attentions.
        pack_length: l, the length of P (fixed, independent of N).
        score, align: the score and alignment of both attentions (names or modules; a module is
            used by the pack attention and a copy by the unpack attention).

    ``forward(x, p=None, mask=None, need_weights=False)``: x (B, N, d); p (B, l, d), the previous
    layer's P' (default: the learned P); mask: key-padding (B, 1, N) → :class:`LunaOutput`.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        pack_length: int,
        *,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.pack_length = arguments.positive_int(pack_length, "pack_length")
        kw = {"device": device, "dtype": dtype}
        # The paper initialises P like a learned positional embedding: N(0, d^-1/2).
        self.p = nn.Parameter(torch.randn(pack_length, embed_dim, **kw) / math.sqrt(embed_dim))
        self.pack = MultiHeadAttention(embed_dim, num_heads, score, align, **kw)

        def own(part):  # the unpack attention gets its own copy of a module part
            return part if isinstance(part, str) else copy.deepcopy(part)

        self.unpack = MultiHeadAttention(embed_dim, num_heads, own(score), own(align), **kw)

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([7, 4]), 7)
        return cls(8, 2, 3), (example_tensor(2, 7, 8, seed=50),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SPECIALIZED, tx.FeatureLevels.HIERARCHICAL]

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, pack_length={self.pack_length}"

    def forward(
        self,
        x: Tensor,
        p: Tensor | None = None,
        mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> LunaOutput:
        who = type(self).__name__
        d, length = self.embed_dim, self.pack_length
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(f"{who}: x must be a floating tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != d:
            raise ValueError(f"{who}: x must be (B, N, {d}), got shape {tuple(x.shape)}")
        if p is None:
            p = self.p.expand(x.shape[0], -1, -1)
        elif not isinstance(p, Tensor) or p.shape != (x.shape[0], length, d):
            raise ValueError(
                f"{who}: p must be (B, l, d) = ({x.shape[0]}, {length}, {d}), got "
                f"{tuple(getattr(p, 'shape', ()))}"
            )
        if mask is not None:
            if isinstance(mask, Tensor) and mask.dim() >= 2 and mask.shape[-2] != 1:
                raise ValueError(
                    f"{who} takes a key-padding mask (B, 1, N) only, got shape "
                    f"{tuple(mask.shape)}: a causal or per-query mask cannot be honoured, "
                    "because the pack step mixes every input into every packed vector"
                )
            masks.check(mask, torch.Size((x.shape[0], 1, x.shape[1])))
        packed = self.pack(p, x, x, mask=mask, need_weights=need_weights)
        rows = None if mask is None else mask.transpose(-1, -2)  # padded queries: no attention
        out = self.unpack(x, packed.context, packed.context, mask=rows, need_weights=need_weights)
        return LunaOutput(out.context, packed.context, packed.weights, out.weights)
