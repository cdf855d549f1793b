"""The model's masks in attnkit's form for swap_attention: the mask function gives transformers'
eager masks and remembers their boolean form (an exactly causal one as the causal mask), each
mask tensor is converted once and read again when changed in place, and the swapped model stays
exact on every mask route (float64, against transformers' eager attention)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import masking_utils as hf_masks
from transformers_gpt2 import TIGHT, gpt2_eager, ids_and_padding

from attnkit.integrations import transformers_masks as masks
from attnkit.integrations.transformers import swap_attention
from attnkit.masks import is_made_causal

transformers.logging.set_verbosity_error()


def _eager(model, ids, **kwargs):
    name = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return model(ids, **kwargs).logits
    finally:
        model.set_attn_implementation(name)


def test_each_mask_is_converted_once_per_forward_pass(monkeypatch):
    model = gpt2_eager()
    ids, mask = ids_and_padding()
    swap_attention(model)
    calls = []
    real = masks._convert
    monkeypatch.setattr(masks, "_convert", lambda *a, **k: calls.append(1) or real(*a, **k))
    model(ids, attention_mask=mask)
    # the mask function hands its boolean form over: no layer converts the additive mask back
    assert calls == []
    # a 4D mask of the caller's own is converted by the first layer and reused by the second
    additive = _additive(mask, ids.shape[1])
    model(ids, attention_mask=additive)
    assert calls == [1]


def _additive(padding: torch.Tensor, n: int) -> torch.Tensor:
    """The eager (B, 1, n, n) causal mask with padding, written out by hand."""
    causal = torch.ones(n, n).tril().bool()
    allowed = causal[None, None] & padding.bool()[:, None, None, :]
    zero, low = torch.tensor(0.0, dtype=torch.float64), torch.finfo(torch.float64).min
    return torch.where(allowed, zero, low)


def test_a_mask_changed_in_place_is_read_again():
    model = gpt2_eager()
    ids, mask = ids_and_padding()
    additive = _additive(mask, ids.shape[1])
    swap_attention(model)
    model(ids, attention_mask=additive)  # its conversion is now remembered
    additive[0, :, :, 2] = torch.finfo(torch.float64).min  # row 0 may no longer read key 2
    out = model(ids, attention_mask=additive).logits
    ref = _eager(model, ids, attention_mask=additive)
    torch.testing.assert_close(out[0, 3:], ref[0, 3:], **TIGHT)
    fresh = model(ids, attention_mask=additive.clone()).logits
    assert torch.equal(out, fresh)


@pytest.mark.parametrize("with_bias", [False, True])
def test_split_mask_recovers_the_pattern_and_the_bias(with_bias):
    g = torch.Generator().manual_seed(5)
    allowed = torch.rand(2, 1, 4, 6, generator=g) > 0.3
    bias = torch.randn(2, 1, 4, 6, generator=g) if with_bias else torch.zeros(2, 1, 4, 6)
    additive = torch.where(allowed, bias, torch.finfo(torch.float32).min)
    mask, got_bias, _ = masks.split_mask(additive, torch.float32)
    assert torch.equal(mask, allowed)
    if with_bias:
        assert torch.equal(got_bias[allowed], bias[allowed])
    else:
        assert got_bias is None
    again = masks.split_mask(additive, torch.float32)
    assert again[0] is mask  # remembered


@pytest.mark.parametrize("write", ["numpy", "data"])
def test_a_mask_changed_where_the_version_counter_does_not_see_is_converted_again(write):
    allowed = torch.ones(1, 1, 4, 6, dtype=torch.bool).tril(2)
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    first, _, _ = masks.split_mask(additive, torch.float32)
    assert torch.equal(first, allowed)
    if write == "numpy":
        additive.numpy()[0, 0, 0, 5] = 0.0  # opens a pair, unseen by _version
    else:
        additive.data[0, 0, 0, 5] = 0.0
    again, _, _ = masks.split_mask(additive, torch.float32)
    expect = allowed.clone()
    expect[0, 0, 0, 5] = True
    assert torch.equal(again, expect)


def test_a_mask_that_allows_every_pair_is_dropped():
    nothing = (None, None, None)
    assert masks.split_mask(torch.zeros(2, 1, 3, 3), torch.float32) == nothing
    assert masks.split_mask(torch.ones(1, 1, 1, 5, dtype=torch.bool), torch.float32) == nothing
    with torch.inference_mode():  # no version counter: converted on every call, still right
        assert masks.split_mask(torch.zeros(2, 1, 3, 3), torch.float32) == nothing


ARGS = [
    # (q_length, kv_length, q_offset, padding, allow_is_causal_skip, allow_is_bidirectional_skip)
    (1, 7, 6, None, True, False),  # a decoding step: every key
    (1, 7, 6, [1, 1, 0, 1, 1, 1, 1], True, False),  # a decoding step with a padded key
    (5, 5, 0, None, True, False),  # a prompt: causal
    (5, 5, 0, [0, 1, 1, 1, 1], False, False),
    (1, 7, 6, None, False, True),  # bidirectional, nothing to mask: None in eager too
]


@pytest.mark.parametrize(("m", "n", "offset", "padding", "causal_skip", "bi_skip"), ARGS)
def test_the_mask_function_gives_eager_masks(m, n, offset, padding, causal_skip, bi_skip):
    kwargs = {
        "batch_size": 2,
        "q_length": m,
        "kv_length": n,
        "q_offset": offset,
        "attention_mask": None if padding is None else torch.tensor([padding] * 2).bool(),
        "dtype": torch.float64,
        "allow_is_bidirectional_skip": bi_skip,
        "mask_function": (
            hf_masks.bidirectional_mask_function if bi_skip else hf_masks.causal_mask_function
        ),
    }
    ref = hf_masks.eager_mask(**kwargs, allow_is_causal_skip=causal_skip)
    got = masks.eager_mask(**kwargs, allow_is_causal_skip=causal_skip)
    if ref is None:
        assert got is None
        return
    if got is None:  # allowed only where eager's mask allows every pair (adding it changes nothing)
        assert m == 1 and bool((ref == 0).all())
        return
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.equal(got, ref)
    # the remembered boolean form is what converting the mask gives; an exactly causal mask is
    # remembered once for every batch row, (M, M), and not offered as an additive mask
    mask, bias, additive = masks.split_mask(got, torch.float64)
    fresh_mask, fresh_bias, fresh_additive = masks.split_mask(ref.clone(), torch.float64)
    assert bias is None and fresh_bias is None
    if fresh_mask is None:
        assert mask is None and additive is None
        return
    assert torch.equal(mask.expand_as(fresh_mask), fresh_mask)
    tril = torch.ones(m, n, dtype=torch.bool).tril()
    causal = m == n and torch.equal(fresh_mask, tril.expand_as(fresh_mask))
    assert (tuple(mask.shape) == (m, n)) == causal
    assert (additive is None) == (fresh_additive is None or causal)


def test_an_exactly_causal_mask_is_remembered_as_the_causal_mask():
    kwargs = {"batch_size": 3, "q_length": 6, "kv_length": 6, "dtype": torch.float32}
    padding = torch.ones(3, 6, dtype=torch.bool)
    got = masks.eager_mask(**kwargs, attention_mask=padding)
    mask, bias, additive = masks.split_mask(got, torch.float32)
    assert tuple(mask.shape) == (6, 6) and bias is None and additive is None
    for i in range(6):
        for j in range(6):
            assert bool(mask[i, j]) == (j <= i)
    assert is_made_causal(mask)  # SDPA's kernel takes it as causal without reading it again
    padding[1, 0] = False  # a padded key: no longer the causal mask in every row
    got = masks.eager_mask(**kwargs, attention_mask=padding)
    mask, _, additive = masks.split_mask(got, torch.float32)
    assert tuple(mask.shape) == (3, 1, 6, 6) and not bool(mask[1, 0, 3, 0])
    assert additive is None  # query 0 of row 1 has no key: no additive form


def test_a_mask_the_mask_function_built_is_kept_without_a_copy_and_read_again_when_changed():
    kwargs = {"batch_size": 2, "q_length": 4, "kv_length": 4, "dtype": torch.float32}
    got = masks.eager_mask(**kwargs, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    assert masks._MASKS[id(got)][2] is None  # no copy of its values is kept
    assert tuple(masks.split_mask(got, torch.float32)[0].shape) == (4, 4)  # causal
    got[0, 0, 3, 1] = torch.finfo(torch.float32).min  # an in-place write: a new version
    mask, _, _ = masks.split_mask(got, torch.float32)
    assert tuple(mask.shape) == (2, 1, 4, 4)
    assert not bool(mask[0, 0, 3, 1]) and bool(mask[1, 0, 3, 1]) and bool(mask[0, 0, 3, 0])


def test_an_additive_mask_is_offered_to_sdpa_only_when_every_row_has_a_key():
    g = torch.Generator().manual_seed(6)
    allowed = torch.rand(2, 1, 4, 6, generator=g) > 0.5
    allowed[..., 0] = True  # every row has a key
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    assert masks.split_mask(additive, torch.float32)[2] is additive
    assert masks.split_mask(additive, torch.float64)[2] is None  # not in the inputs' dtype
    allowed[1, 0, 2] = False  # a row without a key: attnkit gives it 0, SDPA would not
    empty_row = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    mask, bias, offered = masks.split_mask(empty_row, torch.float32)
    assert offered is None and torch.equal(mask, allowed) and bias is None
