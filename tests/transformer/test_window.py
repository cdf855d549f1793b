"""The sliding window's two forms: the dense mask equals the window written out as a loop, and
the block mask built from the band's geometry equals the general block mask that evaluates the
window's mask function at every pair (its tile flags, its kept tiles, its dense form)."""

import pytest
import torch

from attnkit import patterns
from attnkit.kernels import BlockMask
from attnkit.transformer.window import window_block_mask, window_mask, window_pattern


def _loop(m: int, n: int, w: int, causal: bool) -> torch.Tensor:
    """Query i (place n − m + i) may attend key j: causally the w places up to it, else the
    places less than w away."""
    rows = []
    for i in range(n - m, n):
        rows.append([(i - w < j <= i) if causal else abs(i - j) < w for j in range(n)])
    return torch.tensor(rows)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("m", "n", "w"), [(9, 9, 3), (1, 12, 4), (3, 10, 1), (5, 5, 9)])
def test_the_dense_window_is_the_loop(m, n, w, causal):
    got = window_mask(w, m, n, causal, torch.device("cpu"))
    assert torch.equal(got, _loop(m, n, w, causal))


def test_the_window_pattern_is_the_loop_and_shared():
    for causal in (True, False):
        dense = patterns.dense(window_pattern(4, causal), 11, 11)
        assert torch.equal(dense, _loop(11, 11, 4, causal))
        assert window_pattern(4, causal) is window_pattern(4, causal)


# sizes the tiles divide and not; windows inside one tile, across several, wider than N
CASES = [(300, 50, 128), (256, 128, 128), (257, 129, 64), (100, 7, 16), (40, 100, 16), (5, 1, 4)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("n", "w", "block"), CASES)
def test_the_window_block_mask_is_the_block_mask_of_its_pattern(n, w, block, causal):
    got = window_block_mask(w, n, causal, torch.device("cpu"), block)
    want = BlockMask.from_mask_mod(
        patterns.sliding_window(w - 1, causal=causal), n, n, block_q=block, block_k=block
    )
    assert (got.m, got.n, got.block_q, got.block_k, got.lead) == (n, n, block, block, ())
    assert torch.equal(got.any_allowed, want.any_allowed)
    assert torch.equal(got.all_allowed, want.all_allowed)
    assert torch.equal(got.has_key, want.has_key)
    assert got.partial.keys() == want.partial.keys()
    for key, tile in want.partial.items():
        assert torch.equal(got.partial[key], tile), key
    assert torch.equal(got.to_dense(), _loop(n, n, w, causal))
    # a tile read at arbitrary keys, past the kept tiles
    kv = torch.tensor([0, n // 2, n - 1])
    assert torch.equal(got.tile_at(n // 3, n, kv), _loop(n, n, w, causal)[n // 3 :, kv])


def test_the_window_block_mask_is_kept_per_length():
    cpu = torch.device("cpu")
    assert window_block_mask(8, 64, True, cpu) is window_block_mask(8, 64, True, cpu)
    assert window_block_mask(8, 64, True, cpu) is not window_block_mask(8, 65, True, cpu)
