"""Small building blocks shared by parts: per-head linear maps and named activations."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments

__all__ = ["ACTIVATIONS", "HeadwiseLinear", "resolve_activation"]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh,
    "relu": F.relu,
    "selu": F.selu,
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
}


def resolve_activation(act: str | Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """Return the activation named ``act`` (one of :data:`ACTIVATIONS`), or ``act`` if callable."""
    if callable(act):
        return act
    if not isinstance(act, str):
        raise TypeError(
            f"activation must be a name from {sorted(ACTIVATIONS)} or a callable, got {act!r}"
        )
    try:
        return ACTIVATIONS[act]
    except KeyError:
        raise ValueError(
            f"unknown activation {act!r}; choose one of {sorted(ACTIVATIONS)} or pass a callable"
        ) from None


@arguments.renamed(heads="num_heads")
class HeadwiseLinear(nn.Module):
    """``y = W x + b`` with, when ``num_heads`` is set (kept as the attribute ``num_heads``),
    one independent (W, b) per attention head.

    Shapes: without heads, x (…, d_in) -> (…, d_out). With heads H, x (…, H, *inner, d_in) where
    ``inner`` is ``inner_dims`` dimensions (1 for (M, d), 2 for (M, N, d)) -> (…, H, *inner, d_out).
    Initialised like ``torch.nn.Linear``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        num_heads: int | None = None,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(d_in, "d_in")
        arguments.positive_int(d_out, "d_out")
        arguments.optional_positive_int(num_heads, "num_heads")
        arguments.boolean(bias, "bias")
        self.d_in, self.d_out, self.num_heads = d_in, d_out, num_heads
        lead = () if num_heads is None else (num_heads,)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(*lead, d_out, d_in, **kw))
        self.bias = nn.Parameter(torch.empty(*lead, d_out, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.d_in)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor, inner_dims: int = 1, columns: slice | None = None) -> Tensor:
        """Apply the map; ``columns`` uses only those input columns of W (and then no bias)."""
        weight, bias = self.weight, self.bias
        if columns is not None:
            weight, bias = weight[..., columns], None
        d_in = weight.shape[-1]
        if x.shape[-1] != d_in:
            raise ValueError(
                f"input has {x.shape[-1]} features (shape {tuple(x.shape)}) but this layer "
                f"takes d_in = {d_in}"
            )
        if self.num_heads is None:
            return F.linear(x, weight, bias)
        lead = x.shape[: x.dim() - inner_dims - 1]
        if len(lead) == 0 or lead[-1] != self.num_heads:
            raise ValueError(
                f"expected a head dimension of size {self.num_heads} at dim "
                f"{-(inner_dims + 2)} of input shape {tuple(x.shape)}"
            )
        inner = x.shape[x.dim() - inner_dims - 1 : -1]
        # the inner size is spelled out: with an empty batch a -1 would be ambiguous
        flat = x.reshape(*lead, math.prod(inner), d_in)
        y = torch.matmul(flat, weight.transpose(-1, -2))
        if bias is not None:
            y = y + bias[:, None, :]
        return y.reshape(*lead, *inner, self.d_out)

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}"
