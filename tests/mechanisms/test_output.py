"""MechanismOutput: the family is structural (a representation and named weights)."""

from __future__ import annotations

import typing
from typing import NamedTuple

import pytest
import torch
from torch import Tensor

from attnkit import mechanisms


class _WeightsOnly(NamedTuple):
    context: Tensor
    weights: Tensor


def test_a_tuple_without_representation_and_named_weights_is_no_member():
    x = torch.zeros(2, 3)
    assert not isinstance(_WeightsOnly(x, x), mechanisms.MechanismOutput)
    assert not isinstance((x, x), mechanisms.MechanismOutput)


@pytest.mark.parametrize("name", mechanisms.available())
def test_every_mechanism_declares_a_member_of_the_family(name):
    """The forward's return annotation is a named tuple with a representation (a field or a
    property) and named_weights(); the contract suite checks the values returned."""
    returned = typing.get_type_hints(mechanisms.REGISTRY.get(name).forward)["return"]
    assert issubclass(returned, tuple) and hasattr(returned, "_fields"), returned
    assert "representation" in returned._fields or isinstance(
        returned.__dict__.get("representation"), property
    ), returned
    assert callable(returned.__dict__.get("named_weights")), returned
