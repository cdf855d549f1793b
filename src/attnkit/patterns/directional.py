"""DiSAN's directional masks (Shen et al., "DiSAN: Directional Self-Attention Network", AAAI
2018, eqs. 12-13; used inside every block of Bi-BloSA): a token attends only to the tokens
strictly before it (forward) or strictly after it (backward) — never to itself, so that the
two directions carry different, order-encoding information. The first (last) token has no key
under the forward (backward) mask: its weights are 0 and its context 0.
"""

from __future__ import annotations

from torch import Tensor

from attnkit.patterns.base import MaskMod

__all__ = ["backward", "forward"]


def forward() -> MaskMod:
    """Query i attends keys j < i (DiSAN's forward mask, eq. 12)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < q_idx

    return mask_mod


def backward() -> MaskMod:
    """Query i attends keys j > i (DiSAN's backward mask, eq. 13)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx > q_idx

    return mask_mod
