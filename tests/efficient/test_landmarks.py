"""The landmark core: segment means (Nyströmformer) over the real rows, empty segments
when there are fewer rows than landmarks, and the split of padding masks into query and key
padding (other masks refused)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.efficient.landmarks import padding_masks, segment_means

D = torch.float64


def test_segment_means_are_the_means_of_consecutive_segments():
    x = torch.randn(2, 12, 3, dtype=D)
    got, present = segment_means(x, 4)
    ref = torch.stack([x[:, 3 * s : 3 * s + 3].mean(1) for s in range(4)], 1)
    torch.testing.assert_close(got, ref)
    assert present.all()
    got, _ = segment_means(x, 12)  # one token each
    torch.testing.assert_close(got, x)


def test_segment_means_with_and_without_a_mask_agree():
    """The unmasked means (a reshape when m divides L) equal the masked computation with every
    row kept; when m does not divide L, row r goes to segment ⌊r·m/L⌋."""
    x = torch.randn(2, 3, 12, 5, dtype=D)
    everything = torch.ones(12, 1, dtype=torch.bool)
    for m in (1, 3, 4, 12, 5):
        fast, present = segment_means(x, m)
        slow, present_slow = segment_means(x, m, everything)
        torch.testing.assert_close(fast, slow)
        assert torch.equal(present.broadcast_to(present_slow.shape), present_slow)
    got, _ = segment_means(x, 5)
    segment = torch.arange(12) * 5 // 12
    ref = torch.stack([x[..., segment == s, :].mean(-2) for s in range(5)], -2)
    torch.testing.assert_close(got, ref)


def test_padded_rows_are_removed_wherever_they_are():
    x = torch.randn(10, 3, dtype=D)
    keep = torch.tensor([1, 0, 1, 1, 0, 1, 1, 0, 1, 1], dtype=torch.bool)[:, None]
    x_nan = torch.where(keep, x, torch.nan)
    got, present = segment_means(x_nan, 3, keep)
    alone, _ = segment_means(x[keep[:, 0]], 3)  # 7 real rows: segments of 3, 2, 2
    torch.testing.assert_close(got, alone)
    real = x[keep[:, 0]]
    torch.testing.assert_close(got[0], real[:3].mean(0))
    assert present.all()


def test_fewer_rows_than_landmarks_leave_empty_segments():
    x = torch.randn(3, 2, dtype=D)
    got, present = segment_means(x, 5)
    assert present[:, 0].tolist() == [True, True, False, True, False]
    torch.testing.assert_close(got[present[:, 0]], x)
    assert (got[~present[:, 0]] == 0).all()


def test_padding_masks_split_and_refuse_per_query_masks():
    keep = ak.masks.from_lengths(torch.tensor([4, 2]), 4)  # (B, 1, N)
    query, key = padding_masks(keep, torch.Size((2, 4, 4)), "X")
    assert query.all() and torch.equal(key, keep)
    square = keep.transpose(-1, -2) & keep  # padded self-attention (B, N, N)
    query, key = padding_masks(square, torch.Size((2, 4, 4)), "X")
    assert torch.equal(query, keep.transpose(-1, -2)) and torch.equal(key, keep)
    with pytest.raises(ValueError, match=r"X: the mask \(shape \(4, 4\)\) is not a padding mask"):
        padding_masks(ak.masks.causal(4), torch.Size((2, 4, 4)), "X")
