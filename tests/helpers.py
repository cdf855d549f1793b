"""Comparison helpers for the loop references."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def assert_same_forward_backward(
    fast: Callable[[], Tensor],
    slow: Callable[[], Tensor],
    wrt: Sequence[Tensor],
    *,
    atol: float = 1e-10,
    rtol: float = 1e-8,
) -> None:
    """``fast()`` and ``slow()`` agree, and so do the gradients of a random projection of them
    with respect to every tensor in ``wrt``."""
    a, b = fast(), slow()
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    r = torch.randn_like(a)
    wrt = [t for t in wrt if t.requires_grad]
    ga = torch.autograd.grad((a * r).sum(), wrt, allow_unused=True)
    gb = torch.autograd.grad((b * r).sum(), wrt, allow_unused=True)
    for x, y in zip(ga, gb, strict=True):
        if x is None or y is None:
            assert (x is None and y is None) or (x if x is not None else y).abs().max() == 0
            continue
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol)


def rand(*shape: int, seed: int = 0, grad: bool = True) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)
