"""No position information: the default of the position slot."""

from __future__ import annotations

from torch import Tensor

from attnkit.positions.base import REGISTRY, Positioned, PositionScheme, check_offsets

__all__ = ["NoPosition"]


@REGISTRY.register("none")
class NoPosition(PositionScheme):
    """Leaves queries and keys as they are and adds no bias (attention stays order-blind)."""

    translation_invariant = True  # reads only i − j
    per_token = True  # no transform, no bias
    same_for_every_head = True
    bias_of_positions = True

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_offsets(q_offset, k_offset)
        return Positioned(q, k)
