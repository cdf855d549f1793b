"""inputs.broadcast_shapes agrees with torch.broadcast_shapes, errors included."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnkit.inputs import broadcast_shapes

SHAPES = [(), (1,), (3,), (2, 1), (2, 3), (1, 3), (4, 1, 3), (4, 2, 1), (5, 1, 1, 3)]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_broadcast_shapes_agrees_with_torch(count):
    for shapes in itertools.product(SHAPES, repeat=count):
        try:
            expected = torch.broadcast_shapes(*shapes)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                broadcast_shapes(*shapes)
            continue
        assert broadcast_shapes(*shapes) == expected
    assert broadcast_shapes() == torch.Size([])
