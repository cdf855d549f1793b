"""inputs.broadcast_shapes agrees with torch.broadcast_shapes, errors included."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnkit as ak
from attnkit import inputs
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


@pytest.mark.parametrize("fn", [lambda s, b, h: s, lambda s: s, lambda s, b, h, q, kv, extra: s])
def test_a_score_mod_of_the_wrong_arity_is_named_at_every_door(fn):
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(TypeError, match=r"score_mod must take five arguments .* got <lambda>\("):
        ak.attention(q, q, q, score_mod=fn)
    with pytest.raises(TypeError, match="score_mod must take five arguments"):
        ak.MultiHeadAttention(4, 1)(q[0], score_mod=fn)


def test_score_mods_that_take_five_arguments_pass():
    inputs.score_mod(lambda s, b, h, q, kv: s)
    inputs.score_mod(lambda s, *rest: s)
    inputs.score_mod(torch.add)  # a builtin whose arity cannot be read is left to the call
    with pytest.raises(TypeError, match="score_mod must be callable, got int"):
        inputs.score_mod(3)
