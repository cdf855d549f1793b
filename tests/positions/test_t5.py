"""T5 relative buckets against a scalar loop of Raffel et al. 2.1's bucketing."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.positions import T5Relative, t5_bucket


def bucket_loop(j_minus_i: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """One offset at a time: in each direction, the first half of the buckets holds one small
    distance each; the rest cover distances up to max_distance in logarithmically growing
    ranges; farther offsets go to the last bucket."""
    base = 0
    if bidirectional:
        num_buckets //= 2
        if j_minus_i > 0:  # keys after the query use the upper half
            base = num_buckets
        distance = abs(j_minus_i)
    else:
        distance = max(-j_minus_i, 0)  # future keys count as distance 0
    exact = num_buckets // 2
    if distance < exact:
        return base + distance
    ratio = math.log(distance / exact) / math.log(max_distance / exact)
    return base + min(exact + int(ratio * (num_buckets - exact)), num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("buckets", "max_distance"), [(32, 128), (8, 20)])
def test_bucket_function_matches_the_loop(bidirectional, buckets, max_distance):
    offsets = torch.arange(-300, 301)
    got = t5_bucket(
        offsets, bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance
    )
    want = [bucket_loop(int(o), bidirectional, buckets, max_distance) for o in offsets]
    assert got.tolist() == want
    assert got.min() == 0 and got.max() == buckets - 1  # every bucket in range, the last used


def test_bias_is_the_table_entry_and_shift_invariant():
    t5 = T5Relative(3, num_buckets=8, max_distance=20, dtype=torch.float64)
    q, k = (
        torch.randn(2, 3, 4, 5, dtype=torch.float64),
        torch.randn(2, 3, 6, 5, dtype=torch.float64),
    )
    out = t5(q, k, q_offset=2)
    table = t5.weight.detach().tolist()
    expected = [
        [[table[bucket_loop(j - (2 + i), True, 8, 20)][h] for j in range(6)] for i in range(4)]
        for h in range(3)
    ]
    assert torch.equal(out.bias.detach(), torch.tensor(expected, dtype=torch.float64))
    torch.testing.assert_close(out.bias, t5(q, k, q_offset=52, k_offset=50).bias)


def test_causal_buckets_ignore_the_future():
    t5 = T5Relative(2, num_buckets=8, max_distance=20, bidirectional=False)
    bias = t5(torch.randn(2, 5, 4), torch.randn(2, 5, 4)).bias
    assert torch.equal(bias[:, 0, 1:], t5.weight[0][:, None].expand(2, 4))


def test_gradcheck_of_the_table():
    t5 = T5Relative(2, num_buckets=8, max_distance=20, dtype=torch.float64)
    q, k = (
        torch.randn(1, 2, 3, 4, dtype=torch.float64),
        torch.randn(1, 2, 5, 4, dtype=torch.float64),
    )
    w = t5.weight.detach().clone().requires_grad_()

    def f(w):
        bias = torch.func.functional_call(t5, {"weight": w}, (q, k)).bias
        return ak.attention(q, k, k, bias=bias).context

    assert torch.autograd.gradcheck(f, (w,))


def test_built_by_name_for_the_heads_and_errors():
    mha = ak.MultiHeadAttention(8, 4, position="t5")
    assert mha.position.weight.shape == (32, 4)
    with pytest.raises(ValueError, match="4 heads"):
        mha.position(torch.randn(1, 2, 3, 2), torch.randn(1, 2, 3, 2))
    with pytest.raises(ValueError, match="num_buckets"):
        T5Relative(2, num_buckets=2)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(32, 128), (16, 20), (8, 50)])
def test_buckets_equal_the_transformers_t5_implementation(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-300, 300)[None, :]
    theirs = T5Attention._relative_position_bucket(
        relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    mine = t5_bucket(
        relative, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    assert torch.equal(mine, theirs)
