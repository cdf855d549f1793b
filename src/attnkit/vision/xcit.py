"""Cross-covariance attention (El-Nouby et al. 2021, "XCiT: Cross-Covariance Image Transformers",
Sec. 3.2, eq. 4).

Attention runs over channels instead of tokens. Per head h with Q, K, V (N, d_h) from linear
projections of the tokens x (B, N, D), every channel of Q and K is L2-normalised along the tokens
(q̂_{:,i} = q_{:,i} / ‖q_{:,i}‖), the d_h × d_h cross-covariance C_ij = Σ_n q̂_{n,i} k̂_{n,j} is
scaled by a learned temperature τ_h (one per head, multiplying, as in the authors' code) and
normalised over the key channels j: A_ij = softmax_j(τ_h C_ij). Output channel i of token n is
Σ_j A_ij v_{n,j} (the paper's V·A_XC with A read key channel → query channel); the heads are
concatenated and projected by W_o. The map is d_h × d_h whatever the number of tokens, so the
cost is linear in N.

Key padding masks (B, 1, N) or (B, N): padded tokens are removed from every token sum (their
q, k and v are set to zero before normalisation), so masking a token equals removing it; the
output rows of padded tokens are 0. An item with no real token gets weights 0.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, checks, hooks, inputs
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["CrossCovarianceAttention", "CrossCovarianceAttentionOutput"]


class CrossCovarianceAttentionOutput(NamedTuple):
    """output (B, N, D) and the channel attention A (B, heads, d_h, d_h): row i = query channel."""

    output: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("xcit")
@arguments.renamed(d_model="embed_dim")
class CrossCovarianceAttention(nn.Module):
    """Cross-covariance attention (XCA) over tokens x (B, N, D).

    Args:
        embed_dim: D, split into ``num_heads`` heads of d_h = D / num_heads channels.
        num_heads: heads, each with its own temperature τ_h (initialised to 1).
        bias: biases in the q, k, v projections.
        eps: floor on the channel norms in the L2 normalisation.
        align: the alignment over key channels (default softmax, as in the paper).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int = 1,
        *,
        bias: bool = True,
        eps: float = 1e-12,
        align: str | nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(embed_dim=embed_dim, num_heads=num_heads)
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        self.eps = arguments.finite_float(eps, "eps")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        kw = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=arguments.boolean(bias, "bias"), **kw)
        self.out = nn.Linear(embed_dim, embed_dim, **kw)  # W_o
        self.temperature = nn.Parameter(torch.ones(num_heads, 1, 1, **kw))  # τ_h
        self.align = (
            Softmax()
            if align is None
            else checks.resolve_alignment(align, device=device, dtype=dtype)
        )

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(D = 6, 2 heads; x (2, 5, 6), the second item with 3 real tokens)."""
        mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])[:, None]
        return cls(6, 2), (example_tensor(2, 5, 6),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.QueryType.SELF_ATTENTIVE]

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"

    def _keep(self, x: Tensor, mask: Tensor | None) -> Tensor | None:
        if mask is None:
            return None
        b, n = x.shape[0], x.shape[1]
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a boolean tensor, got {type(mask).__name__}")
        if mask.shape not in ((b, n), (b, 1, n)):
            raise ValueError(
                f"mask must be a key padding mask (B, 1, N) or (B, N) = ({b}, 1, {n}), got shape "
                f"{tuple(mask.shape)} for x {tuple(x.shape)}"
            )
        return mask.reshape(b, n, 1)

    def forward(self, x: Tensor, *, mask: Tensor | None = None) -> CrossCovarianceAttentionOutput:
        """x (B, N, D), mask (B, 1, N) True = real token → output (B, N, D), A (B, h, d_h, d_h)."""
        x = inputs.tensor(x, "x", min_dim=1)
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must be tokens (B, N, embed_dim={self.embed_dim}), got shape {tuple(x.shape)}"
            )
        keep = self._keep(x, mask)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        if keep is not None:
            x = torch.where(keep, x, zero)  # padded content (even NaN) never enters
        b, n, _ = x.shape
        qkv = self.qkv(x)
        if keep is not None:
            qkv = torch.where(keep, qkv, zero)  # biases of padded tokens leave the sums too
        q, k, v = qkv.view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q = F.normalize(q, dim=-2, eps=self.eps)  # along the tokens, per channel
        k = F.normalize(k, dim=-2, eps=self.eps)
        scores = (q.transpose(-2, -1) @ k) * self.temperature  # (B, h, d_h, d_h)
        any_token = None if keep is None else keep.any(dim=1).reshape(b, 1, 1, 1)
        weights = self.align(scores, any_token).weights
        hooks.report(self, weights)
        context = v @ weights.transpose(-2, -1)  # (B, h, N, d_h): Σ_j A_ij v_{n,j}
        output = self.out(context.transpose(1, 2).reshape(b, n, self.embed_dim))
        if keep is not None:
            output = torch.where(keep, output, zero)
        return CrossCovarianceAttentionOutput(output, weights)
