"""The position-wise feed-forward sublayer of a Transformer layer (Vaswani et al. eq. 2):
two linear maps with a nonlinearity between them, applied to every position alike."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from attnkit import arguments

__all__ = ["FeedForward"]


class FeedForward(nn.Sequential):
    """x (…, embed_dim) -> Linear(d_ff) -> activation -> dropout -> Linear(embed_dim).

    Args:
        embed_dim: the model width.
        d_ff: the hidden width (a positive int), 4·embed_dim when None.
        dropout: applied to the hidden activations in training.
        activation: the nonlinearity, an ``nn.Module`` (e.g. ``torch.nn.GELU()``).
        **kw: ``device`` and ``dtype`` of the parameters.
    """

    def __init__(
        self, embed_dim: int, d_ff: int | None, dropout: float, activation: nn.Module, **kw: Any
    ) -> None:
        d_ff = 4 * embed_dim if d_ff is None else arguments.positive_int(d_ff, "d_ff")
        if not isinstance(activation, nn.Module):
            raise TypeError(
                f"activation must be an nn.Module (e.g. torch.nn.GELU()), got "
                f"{type(activation).__name__}"
            )
        super().__init__(
            nn.Linear(embed_dim, d_ff, **kw),
            activation,
            nn.Dropout(dropout),
            nn.Linear(d_ff, embed_dim, **kw),
        )

    def forward(self, x: Tensor) -> Tensor:
        first, activation, drop, second = self._modules.values()
        x = activation(first(x))
        if self.training and drop.p > 0:  # (no module call for a no-op, per token)
            x = drop(x)
        return second(x)
