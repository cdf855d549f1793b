"""Mask builders and the mask check."""

import pytest
import torch

import attnkit as ak
from attnkit import masks


def test_from_lengths():
    m = masks.from_lengths(torch.tensor([2, 0, 3]), 3)
    assert m.shape == (3, 1, 3)
    assert m[:, 0].tolist() == [[True, True, False], [False, False, False], [True, True, True]]
    with pytest.raises(ValueError, match="lengths"):
        masks.from_lengths(torch.tensor([4]), 3)
    with pytest.raises(TypeError, match="integer"):
        masks.from_lengths(torch.tensor([1.0]), 3)


def test_causal_matches_sdpa_convention():
    assert masks.causal(3).tolist() == [[True, False, False], [True, True, False], [True] * 3]
    # M < N: aligned at the end, as in torch's is_causal with a KV cache.
    assert masks.causal(2, 4).tolist() == [[True, True, True, False], [True] * 4]


def test_window_and_combine():
    w = masks.window(4, 4, 1)
    assert w.tolist() == [
        [True, True, False, False],
        [True, True, True, False],
        [False, True, True, True],
        [False, False, True, True],
    ]
    both = masks.combine(w, masks.causal(4), None)
    assert both.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, True, True, False],
        [False, False, True, True],
    ]
    assert masks.combine(None) is None


def test_check():
    masks.check(torch.ones(1, 5, dtype=torch.bool), torch.Size((2, 3, 5)))
    with pytest.raises(ValueError, match=r"\(2, 5\) does not broadcast"):
        masks.check(torch.ones(2, 5, dtype=torch.bool), torch.Size((2, 3, 5)))


def test_padding_only_zeroes_padding_and_refuses_other_masks():
    x = torch.randn(2, 4, 3)
    mask = masks.from_lengths(torch.tensor([4, 2]), 4)  # (2, 1, 4)
    zeroed, keep = masks.padding_only(x, 3, mask, "Part")
    assert keep.tolist() == [[True] * 4, [True, True, False, False]]
    assert torch.equal(zeroed[0], x[0]) and torch.equal(zeroed[1, :2], x[1, :2])
    assert not zeroed[1, 2:].any()
    same, everywhere = masks.padding_only(x, 3, None, "Part")
    assert same is x and everywhere.all()
    with pytest.raises(ValueError, match="Part takes a padding mask"):
        masks.padding_only(x, 3, torch.ones(2, 4, 4, dtype=torch.bool), "Part")
    with pytest.raises(ValueError, match=r"Part needs x \(B, N, 5\)"):
        masks.padding_only(x, 5, None, "Part")
    with pytest.raises(TypeError, match="boolean"):
        masks.padding_only(x, 3, torch.ones(2, 1, 4), "Part")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8])
def test_check_refuses_non_boolean_masks_and_says_what_to_do(dtype):
    # A 0/1 (or 0.5) tensor is not read as a mask: it names bias= and the conversion to bool.
    mask = torch.full((2, 3, 5), 0.5).to(dtype)
    with pytest.raises(TypeError, match=rf"mask must be boolean.*{dtype}.*bias=.*mask\.bool\(\)"):
        masks.check(mask, torch.Size((2, 3, 5)))


def test_a_short_mask_that_fits_two_ways_is_refused_and_one_that_fits_one_way_taken():
    scores = torch.Size((2, 2, 5, 5))  # B = H = 2
    with pytest.raises(ValueError, match=r"\(2, 1, 5\) has 3 dims .* both readings fit"):
        masks.check(torch.ones(2, 1, 5, dtype=torch.bool), scores)
    masks.check(torch.ones(2, 1, 1, 5, dtype=torch.bool), scores)  # every dim given
    masks.check(torch.ones(1, 1, 5, dtype=torch.bool), scores)  # leading 1s
    masks.check(torch.ones(5, 5, dtype=torch.bool), scores)  # (M, N)
    # per-head (H, M, N) with B != H: read batch first it would not fit, so it is unambiguous
    masks.check(torch.ones(2, 5, 5, dtype=torch.bool), torch.Size((3, 2, 5, 5)))
    with pytest.raises(ValueError, match="bias of shape"):
        masks.check_unambiguous(torch.zeros(2, 1, 5), scores, name="bias")


def test_a_causal_mask_is_known_as_made_until_it_changes():
    mask = masks.causal(6)
    assert masks.is_made_causal(mask)
    assert masks.is_made_causal(mask[None, None]) and masks.is_made_causal(mask.unsqueeze(-3))
    assert not masks.is_made_causal(mask.t()) and not masks.is_made_causal(mask[1:, 1:])
    assert not masks.is_made_causal(mask[None].expand(2, 6, 6))
    assert not masks.is_made_causal(masks.causal(4, 6))  # (not square: not remembered)
    assert not masks.is_made_causal(torch.ones(6, 6, dtype=torch.bool).tril())  # (not made here)
    # an in-place change is seen, and attention then honours the changed mask, not causality
    q, k, v = torch.randn(3, 1, 6, 4, dtype=torch.float64).unbind(0)
    view = mask[None]
    mask[5, 5] = False
    assert not masks.is_made_causal(mask) and not masks.is_made_causal(view)
    got = ak.attention(q, k, v, mask=mask).context
    want = ak.attention(q, k, v, mask=mask, kernel="dense").context
    torch.testing.assert_close(got, want)
    with torch.inference_mode():
        assert not masks.is_made_causal(masks.causal(3))  # (no version counter: not remembered)


def test_a_shared_causal_mask_is_made_once_per_size_for_those_who_share_a_dict():
    outside = masks.causal_shared(5, 7)
    assert outside is not masks.causal_shared(5, 7)  # (a new one without a dict)
    torch.testing.assert_close(outside, masks.causal(5, 7))
    shared: dict = {}
    first = masks.causal_shared(5, 7, shared=shared)
    assert masks.causal_shared(5, 7, shared=shared) is first
    assert masks.causal_shared(5, 7, shared={}) is not first  # (another dict: its own)
    torch.testing.assert_close(first, torch.ones(5, 7, dtype=torch.bool).tril(2))
    other = masks.causal_shared(6, shared=shared)
    assert other is not first and masks.is_made_causal(other)
    first[0, 4] = True  # changed in place: not handed out again
    again = masks.causal_shared(5, 7, shared=shared)
    assert again is not first and not bool(again[0, 4])
    with torch.inference_mode():
        kept: dict = {}
        assert masks.causal_shared(3, shared=kept) is masks.causal_shared(3, shared=kept)
