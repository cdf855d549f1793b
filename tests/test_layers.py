"""HeadwiseLinear equals one nn.Linear per head."""

import pytest
import torch

from attnkit.layers import HeadwiseLinear, resolve_activation


@pytest.mark.parametrize("inner_dims", [1, 2])
def test_headwise_equals_linear_per_head(inner_dims):
    torch.manual_seed(0)
    layer = HeadwiseLinear(5, 3, num_heads=4)
    shape = (2, 4, 6, 5) if inner_dims == 1 else (2, 4, 6, 7, 5)
    x = torch.randn(*shape)
    y = layer(x, inner_dims=inner_dims)
    for h in range(4):
        ref = x[:, h] @ layer.weight[h].T + layer.bias[h]
        torch.testing.assert_close(y[:, h], ref)


@pytest.mark.parametrize("inner_dims", [1, 2])
def test_headwise_takes_an_empty_batch(inner_dims):
    lin = HeadwiseLinear(4, 3, num_heads=2)
    x = torch.randn(0, 2, *([5] * inner_dims), 4)
    assert lin(x, inner_dims).shape == (0, 2, *([5] * inner_dims), 3)


def test_column_slice_uses_part_of_the_weight_without_bias():
    layer = HeadwiseLinear(5, 3)
    x = torch.randn(2, 2)
    torch.testing.assert_close(layer(x, columns=slice(1, 3)), x @ layer.weight[:, 1:3].T)


def test_missing_head_dim_is_reported():
    with pytest.raises(ValueError, match="head dimension of size 4"):
        HeadwiseLinear(5, 3, num_heads=4)(torch.randn(2, 3, 6, 5))


def test_the_number_of_heads_is_kept_under_the_constructor_name():
    layer = HeadwiseLinear(5, 3, num_heads=4)
    assert layer.num_heads == 4 and layer.weight.shape == (4, 3, 5)
    assert HeadwiseLinear(5, 3).num_heads is None
    assert "num_heads=4" in repr(layer)
    with pytest.raises(TypeError, match="`heads` is now `num_heads`"):
        HeadwiseLinear(5, 3, heads=4)


def test_activation_lookup():
    assert resolve_activation("relu")(torch.tensor(-1.0)) == 0
    with pytest.raises(ValueError, match="unknown activation"):
        resolve_activation("nope")
