"""Adaptively sparse attention (Correia, Niculae and Martins, "Adaptively Sparse Transformers",
EMNLP 2019; Soydaner 5.1): each head learns the α of its α-entmax alignment, so that a head can be
dense (α → 1, softmax), sparse (α = 2, sparsemax) or anything between, as training decides.

    a = α_h-entmax(e),   α_h-entmax(e)_l = [(α_h − 1) e_l − τ]_+^{1/(α_h − 1)},

with τ such that the weights sum to 1, and α_h = 1 + softplus(ρ_h) > 1 learned per head (the
paper keeps α in (1, 2] by a sigmoid; here any α > 1 is allowed). The alignment is
:class:`attnkit.alignments.Entmax` with its learned ρ made one per head.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Entmax
from attnkit.core import Attention
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["AdaptivelySparseAttention"]


class _PerHeadEntmax(Entmax):
    """α-entmax with a learned α per head: ρ of shape (H, 1, 1), scores (…, H, M, N)."""

    def __init__(self, num_heads: int, alpha: float, n_iter: int) -> None:
        super().__init__(alpha, learnable=True, n_iter=n_iter)
        self.num_heads = num_heads
        self.rho = nn.Parameter(self.rho.detach().repeat(num_heads).reshape(num_heads, 1, 1))

    def alpha_value(self) -> float:
        # the smallest α: the masked-key gap 1/(α − 1) + 1 it implies holds for every head
        return float(self.alpha.detach().min())

    def _map(self, scores: Tensor) -> Tensor:
        if scores.dim() < 3 or scores.shape[-3] != self.num_heads:
            raise ValueError(
                f"a per-head entmax with {self.num_heads} heads needs scores (…, H, M, N), got "
                f"{tuple(scores.shape)}"
            )
        return super()._map(scores)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, n_iter={self.n_iter}"


@REGISTRY.register("adaptive_sparse")
@arguments.renamed(n_heads="num_heads")
class AdaptivelySparseAttention(HeadAttention):
    """Scaled dot-product attention with α-entmax and a learned α per head, a per-head part
    ``part(q, k, v, *, mask, bias, need_weights)`` with q (B, …, H, M, d), k (B, …, H, N, d),
    v (B, …, H, N, d_v).

    Args:
        num_heads: H.
        alpha: the initial α of every head, > 1 (1.5 is the paper's start).
        n_iter: bisection steps of entmax.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"num_heads": "num_heads"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    decodes_with_cache: ClassVar[bool] = True  # a step equals its causal rows

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(self, num_heads: int, alpha: float = 1.5, *, n_iter: int = 50) -> None:
        super().__init__()
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.attention = Attention("scaled_dot", _PerHeadEntmax(num_heads, alpha, n_iter))

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 5, 4, seed=s) for s in (16, 17, 18))
        mask = masks.from_lengths(torch.tensor([5, 3]), 5)[:, None].expand(2, 2, 1, 5)
        module = cls(2)
        with torch.no_grad():
            module.attention.align.rho[1] += 1.0  # the two heads start with different α
        return module, (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.AlignmentKind.SPARSE]

    @property
    def alphas(self) -> Tensor:
        """α per head, (H,)."""
        return self.attention.align.alpha.reshape(-1)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:
        if q.dim() < 3 or q.shape[-3] != self.num_heads:
            raise ValueError(
                f"AdaptivelySparseAttention(num_heads={self.num_heads}) needs q "
                f"(…, H={self.num_heads}, M, d), got {tuple(q.shape)}"
            )
        out = self.attention(q, k, v, mask=mask, bias=bias, need_weights=need_weights)
        return AttentionOutput(out.context, out.weights if need_weights else None)
