"""Rotatory attention (LCR-Rot, Zheng & Chen; Brauwers 3.1.1, eqs. 17-20) and its multi-hop form
(LCR-Rot-hop, Wallaart & Frasincar)."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.features._pooling import attend_one, masked_mean
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import ActivatedGeneral, Score

__all__ = ["RotatoryAttention", "RotatoryOutput"]


class RotatoryOutput(NamedTuple):
    """r = concat(r^l, r^r, r^{lt}, r^{rt}) (eq. 20) and the last hop's weights."""

    representation: Tensor
    weights_left: Tensor
    weights_right: Tensor
    weights_target_left: Tensor
    weights_target_right: Tensor

    def named_weights(self) -> dict[str, Tensor]:
        return {
            "weights_left": self.weights_left,
            "weights_right": self.weights_right,
            "weights_target_left": self.weights_target_left,
            "weights_target_right": self.weights_target_right,
        }


@REGISTRY.register("rotatory")
class RotatoryAttention(nn.Module):
    """Left context, target and right context attend to one another in rotation.

    r^t = mean of the target's features (eq. 17); r^l and r^r attend over the left and right
    contexts with r^t as query (eq. 18); r^{lt} and r^{rt} attend over the target with r^l and
    r^r as queries (eq. 19); r = concat(r^l, r^r, r^{lt}, r^{rt}) (eq. 20). With ``hops`` > 1
    (LCR-Rot-hop) the rotation repeats, r^{lt} and r^{rt} becoming the queries over the left and
    right contexts.

    Args:
        d_l, d_t, d_r: feature sizes of the left context, target and right context. With hops
            > 1, d_l = d_r is needed (r^{lt} then queries the left context).
        hops: rounds of rotation.
        score: factory ``score(d_q, d_k) -> Score``; default the activated general score
            (tanh, Wallaart & Frasincar).
        share_weights: one set of four attention modules for all hops, or one per hop.
    """

    def __init__(
        self,
        d_l: int,
        d_t: int,
        d_r: int,
        *,
        hops: int = 1,
        score: Callable[[int, int], Score] | None = None,
        share_weights: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d_l=d_l, d_t=d_t, d_r=d_r)
        arguments.boolean(share_weights, "share_weights")
        arguments.positive_int(hops, "hops")
        if hops > 1 and d_t != d_l:
            raise ValueError(
                f"hops > 1 uses r^lt (size d_t = {d_t}) as query over the left "
                f"context: it needs d_t == d_l, got d_l = {d_l}"
            )
        if score is not None and not callable(score):
            raise TypeError(
                f"score must be a factory score(d_q, d_k) -> Score or None, got {score!r}"
            )
        self.d_l, self.d_t, self.d_r = d_l, d_t, d_r
        make = score or (lambda dq, dk: ActivatedGeneral(dq, dk, device=device, dtype=dtype))
        self.hops = hops
        rounds = 1 if share_weights else hops

        def four(q_left: int, q_right: int) -> nn.ModuleDict:
            return nn.ModuleDict(
                {
                    "left": Attention(make(q_left, d_l)),
                    "right": Attention(make(q_right, d_r)),
                    "target_left": Attention(make(d_l, d_t)),
                    "target_right": Attention(make(d_r, d_t)),
                }
            )

        self.rounds = nn.ModuleList([four(d_t, d_t) for _ in range(rounds)])

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {
        "mask_left": ("left",),
        "mask_target": ("target",),
        "mask_right": ("right",),
    }

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(LCR-Rot-hop with 2 hops, (left (2, 5, 4), target (2, 3, 4), right (2, 6, 4)),
        masks)."""
        args = tuple(example_tensor(2, n, 4, seed=s) for s, n in enumerate((5, 3, 6)))
        kwargs = {
            name: masks.from_lengths(torch.tensor(lengths), n)
            for name, lengths, n in (
                ("mask_left", [5, 2], 5),
                ("mask_target", [3, 1], 3),
                ("mask_right", [4, 6], 6),
            )
        }
        return cls(4, 4, 4, hops=2), args, kwargs

    def taxonomy_tags(self) -> list:
        tags: list = [tx.FeatureMultiplicity.ROTATORY, tx.QueryType.SPECIALIZED]
        if self.hops > 1:
            tags.append(tx.QueryMultiplicity.MULTI_HOP)
        return tags

    def forward(
        self,
        left: Tensor,
        target: Tensor,
        right: Tensor,
        mask_left: Tensor | None = None,
        mask_target: Tensor | None = None,
        mask_right: Tensor | None = None,
    ) -> RotatoryOutput:
        """left (B, n_l, d_l), target (B, n_t, d_t), right (B, n_r, d_r); each mask None, (B, n)
        or (B, 1, n) boolean (True = a real feature) for the matching input."""
        left = checks.features(left, "left", self.d_l, what="d_l")
        target = checks.features(target, "target", self.d_t, what="d_t")
        right = checks.features(right, "right", self.d_r, what="d_r")
        checks.same_batch(("left", left), ("target", target), ("right", right))
        checks.part_matches(self, "RotatoryAttention", "left", left)
        mask_left = checks.feature_mask(mask_left, left, "mask_left", "left")
        mask_target = checks.feature_mask(mask_target, target, "mask_target", "target")
        mask_right = checks.feature_mask(mask_right, right, "mask_right", "right")
        left = checks.without_padding(left, mask_left)
        target = checks.without_padding(target, mask_target)
        right = checks.without_padding(right, mask_right)
        r_t = masked_mean(target, mask_target)  # eq. 17
        q_left = q_right = r_t
        for hop in range(self.hops):
            m = self.rounds[min(hop, len(self.rounds) - 1)]
            r_l, a_l = attend_one(m["left"], q_left, left, mask_left)  # eq. 18
            r_r, a_r = attend_one(m["right"], q_right, right, mask_right)
            r_lt, a_lt = attend_one(m["target_left"], r_l, target, mask_target)  # eq. 19
            r_rt, a_rt = attend_one(m["target_right"], r_r, target, mask_target)
            q_left, q_right = r_lt, r_rt
        r = torch.cat([r_l, r_r, r_lt, r_rt], dim=-1)  # eq. 20
        return RotatoryOutput(r, a_l, a_r, a_lt, a_rt)
