"""MechanismOutput: the family is structural (a representation and named weights)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import features, mechanisms, queries


class _Conforming(NamedTuple):
    context: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.context

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


class _WeightsOnly(NamedTuple):
    context: Tensor
    weights: Tensor


def test_membership_needs_representation_and_named_weights():
    x = torch.zeros(2, 3)
    assert isinstance(_Conforming(x, x), mechanisms.MechanismOutput)
    assert not isinstance(_WeightsOnly(x, x), mechanisms.MechanismOutput)
    assert not isinstance((x, x), mechanisms.MechanismOutput)


def test_the_packages_output_types_are_members():
    x = torch.zeros(2, 3)
    for cls in (features.CoAttentionOutput, queries.CapsuleOutput, queries.MultiHopOutput):
        out = cls(*[x] * len(cls._fields))
        assert isinstance(out, mechanisms.MechanismOutput), cls.__name__
