"""Self-attention (Brauwers 3.3.1): every feature queries all of them, Q = W_Q F (eq. 35), with
the feature updates of eqs. 36-37.

The constant- and learned-query forms of eqs. 33-34 are score functions:
``attnkit.scores.Additive(None, d_k, d_w)`` and ``attnkit.scores.LearnedQuery(d_k)``.
"""

from __future__ import annotations

from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.output import AttentionOutput

__all__ = ["SelfAttention", "SelfAttentionOutput"]


class SelfAttentionOutput(NamedTuple):
    """The new features (B, n, d_f) and the attention output (weights with need_weights)."""

    features: Tensor
    attention: AttentionOutput

    @property
    def representation(self) -> Tensor:
        return self.features

    def named_weights(self) -> dict[str, Tensor]:
        weights = self.attention.weights
        return {} if weights is None else {"weights": weights}


@REGISTRY.register("self_attention")
class SelfAttention(nn.Module):
    """Each feature vector queries all of them: Q = W_Q F (eq. 35), K = W_K F, V = W_V F (eq. 1);
    the context vectors become the new features, either as they are, f_new = c (eq. 36,
    ``update="replace"``), or f_new = Normalize(f_old + c) with layer normalisation (eq. 37,
    ``update="residual"``).

    Args:
        d_f: feature size (d_v = d_f so that the update keeps the size).
        d_k: query/key size (default d_f).
        attention: the attention part (score × alignment) for Q, K; default scaled dot + softmax.
    """

    def __init__(
        self,
        d_f: int,
        d_k: int | None = None,
        *,
        update: Literal["replace", "residual"] = "residual",
        attention: Attention | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d_f=d_f)
        arguments.optional_positive_int(d_k, "d_k")
        if attention is not None and not isinstance(attention, nn.Module):
            raise TypeError(f"attention must be an attention module or None, got {attention!r}")
        if update not in ("replace", "residual"):
            raise ValueError(
                f"update must be 'replace' (eq. 36) or 'residual' (eq. 37), got {update!r}"
            )
        d_k = d_f if d_k is None else d_k
        self.d_f = d_f
        kw = {"device": device, "dtype": dtype}
        self.W_Q = nn.Linear(d_f, d_k, bias=False, **kw)
        self.W_K = nn.Linear(d_f, d_k, bias=False, **kw)
        self.W_V = nn.Linear(d_f, d_f, bias=False, **kw)
        self.attention = attention or Attention("scaled_dot", "softmax")
        self.update = update
        self.norm = nn.LayerNorm(d_f, **kw) if update == "residual" else None

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("f",)}

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(module, (f (2, 5, 4),), a padding mask (2, 1, 5))."""
        mask = masks.from_lengths(torch.tensor([5, 3]), 5)
        return cls(4, 3), (example_tensor(2, 5, 4, seed=1),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def forward(
        self, f: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> SelfAttentionOutput:
        """f (B, n, d_f) -> (new features (B, n, d_f), the attention output).

        ``mask`` is an attention mask with three dims: (B, 1, n) (padding, as
        :func:`attnkit.masks.from_lengths` gives), (B, n, n) or (1, n, n); True = may attend.
        A 2-D mask is refused: (B, n) padding and (n, n) query-key masks cannot be told apart.
        """
        f = checks.features(f, "f", self.d_f, what="d_f")
        checks.part_matches(self, "SelfAttention", "f", f)
        if mask is not None and isinstance(mask, Tensor) and mask.dim() != 3:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} for f of shape {tuple(f.shape)}: pass a 3-D "
                "mask, (B, 1, n) for padding (attnkit.masks.from_lengths) or (B, n, n) / "
                "(1, n, n) per query"
            )
        out = self.attention(
            self.W_Q(f), self.W_K(f), self.W_V(f), mask=mask, need_weights=need_weights
        )
        if self.norm is None:
            return SelfAttentionOutput(out.context, out)  # eq. 36
        return SelfAttentionOutput(self.norm(f + out.context), out)  # eq. 37
