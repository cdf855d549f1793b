"""Prefix-LM attention (Raffel et al. 2020, T5 sec. 3.2.1, Fig. 3 right; Dong et al. 2019,
UniLM): the first P tokens (the prefix, the input) see each other bidirectionally, and every later
token sees the prefix and the tokens before it (causal):

    allowed(i, j) = j < P  or  j ≤ i

With P = 0 this is causal attention; with P = N, full attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.patterns.base import MaskMod

__all__ = ["prefix_lm", "prefix_lm_mask"]


def _lengths(prefix_lengths: int | Tensor) -> int | Tensor:
    if isinstance(prefix_lengths, Tensor):
        if (
            prefix_lengths.dim() != 1
            or prefix_lengths.is_floating_point()
            or (prefix_lengths.dtype == torch.bool)
        ):
            raise TypeError(
                f"prefix_lengths must be an int or a 1-D integer tensor (B,), got shape "
                f"{tuple(prefix_lengths.shape)} dtype {prefix_lengths.dtype}"
            )
        if prefix_lengths.numel() and int(prefix_lengths.min()) < 0:
            raise ValueError(f"prefix_lengths must be >= 0, got {prefix_lengths.tolist()}")
        return prefix_lengths
    return arguments.nonnegative_int(prefix_lengths, "prefix_lengths")


def prefix_lm(prefix_lengths: int | Tensor) -> MaskMod:
    """The prefix-LM pattern as a ``mask_mod``; ``prefix_lengths`` is one P for every item or
    (B,) one per item (indexed by the batch index ``b``; build the block mask with ``batch=B``)."""
    lengths = _lengths(prefix_lengths)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        p = lengths[b] if isinstance(lengths, Tensor) else lengths
        return (kv_idx < p) | (kv_idx <= q_idx)

    return mask_mod


def prefix_lm_mask(prefix_lengths: int | Tensor, n: int, *, device=None) -> Tensor:
    """The prefix-LM mask: (N, N) for one P, or (B, N, N) for P per item (True = may attend)."""
    n = arguments.nonnegative_int(n, "n")
    lengths = _lengths(prefix_lengths)
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    if isinstance(lengths, Tensor):
        return (j[None] < lengths.to(device)[:, None, None]) | (j <= i)[None]
    return (j < lengths) | (j <= i)
