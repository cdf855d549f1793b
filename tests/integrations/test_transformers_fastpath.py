"""The lean per-call path of swap_attention: the model's own score, the remembered mask
conversions, the mask function and the direct SDPA path give exactly the unswapped model (float64,
against transformers' eager attention), and a mask changed in place is read again."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel
from transformers import masking_utils as hf_masks

import attnkit.integrations.transformers as tf
from attnkit import alignments as ak_alignments
from attnkit.integrations import transformers_fastpath as fp
from attnkit.integrations.transformers import swap_attention

transformers.logging.set_verbosity_error()

TIGHT = {"atol": 1e-12, "rtol": 1e-12}


def _gpt2(**extra):
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=50,
        n_positions=32,
        n_embd=16,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        **extra,
    )
    return GPT2LMHeadModel(config).double().eval()


def _ids_and_padding():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask


def _no_general_path(monkeypatch):
    """Make attnkit.attention (the validated general path) fail, so that a call that still
    works went through the direct SDPA path."""

    def refuse(*args, **kwargs):
        raise AssertionError("the general path was taken")

    monkeypatch.setattr(tf, "attention", refuse)


def test_model_scaled_dot_is_the_scaled_product_of_each_pair():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, dtype=torch.float64, generator=g)
    k = torch.randn(2, 5, 4, dtype=torch.float64, generator=g)
    score = fp.model_score(0.3, 4)
    e = score(q, k)
    for b in range(2):
        for i in range(3):
            for j in range(5):
                ref = 0.3 * sum(float(q[b, i, t] * k[b, j, t]) for t in range(4))
                assert abs(float(e[b, i, j]) - ref) < 1e-12
    assert fp.model_score(None, 16).fixed_scale == 0.25  # 1/√d without the model's scaling
    assert fp.model_score(0.3, 4) is score  # one instance per scale


def test_the_swapped_model_takes_the_direct_path_and_is_exact(monkeypatch):
    model = _gpt2()
    ids, mask = _ids_and_padding()
    keep = mask.bool()
    ref = model(ids, attention_mask=mask).logits
    ref_tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    swap_attention(model)
    _no_general_path(monkeypatch)
    out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[keep], ref[keep], **TIGHT)
    torch.testing.assert_close(model(ids).logits, _eager(model, ids), **TIGHT)
    tokens = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)


def _eager(model, ids, **kwargs):
    name = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        return model(ids, **kwargs).logits
    finally:
        model.set_attn_implementation(name)


def test_per_layer_scaling_is_the_models(monkeypatch):
    # GPT-2 can divide each layer's scores by its index + 1: a scale per layer.
    model = _gpt2(scale_attn_by_inverse_layer_idx=True)
    ids, _ = _ids_and_padding()
    ref = model(ids).logits
    swap_attention(model)
    _no_general_path(monkeypatch)
    torch.testing.assert_close(model(ids).logits, ref, **TIGHT)


def test_each_mask_is_converted_once_per_forward_pass(monkeypatch):
    model = _gpt2()
    ids, mask = _ids_and_padding()
    swap_attention(model)
    calls = []
    real = fp._convert
    monkeypatch.setattr(fp, "_convert", lambda *a, **k: calls.append(1) or real(*a, **k))
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
    model = _gpt2()
    ids, mask = _ids_and_padding()
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
    mask, got_bias, _ = fp.split_mask(additive, torch.float32)
    assert torch.equal(mask, allowed)
    if with_bias:
        assert torch.equal(got_bias[allowed], bias[allowed])
    else:
        assert got_bias is None
    again = fp.split_mask(additive, torch.float32)
    assert again[0] is mask  # remembered


@pytest.mark.parametrize("write", ["numpy", "data"])
def test_a_mask_changed_where_the_version_counter_does_not_see_is_converted_again(write):
    allowed = torch.ones(1, 1, 4, 6, dtype=torch.bool).tril(2)
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    first, _, _ = fp.split_mask(additive, torch.float32)
    assert torch.equal(first, allowed)
    if write == "numpy":
        additive.numpy()[0, 0, 0, 5] = 0.0  # opens a pair, unseen by _version
    else:
        additive.data[0, 0, 0, 5] = 0.0
    again, _, _ = fp.split_mask(additive, torch.float32)
    expect = allowed.clone()
    expect[0, 0, 0, 5] = True
    assert torch.equal(again, expect)


def test_a_mask_that_allows_every_pair_is_dropped():
    nothing = (None, None, None)
    assert fp.split_mask(torch.zeros(2, 1, 3, 3), torch.float32) == nothing
    assert fp.split_mask(torch.ones(1, 1, 1, 5, dtype=torch.bool), torch.float32) == nothing
    with torch.inference_mode():  # no version counter: converted on every call, still right
        assert fp.split_mask(torch.zeros(2, 1, 3, 3), torch.float32) == nothing


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
    got = fp.eager_mask(**kwargs, allow_is_causal_skip=causal_skip)
    if ref is None:
        assert got is None
        return
    if got is None:  # allowed only where eager's mask allows every pair (adding it changes nothing)
        assert m == 1 and bool((ref == 0).all())
        return
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.equal(got, ref)
    # the remembered boolean form is what converting the mask gives
    mask, bias, additive = fp.split_mask(got, torch.float64)
    fresh_mask, fresh_bias, fresh_additive = fp.split_mask(ref.clone(), torch.float64)
    assert bias is None and fresh_bias is None
    assert (mask is None and fresh_mask is None) or torch.equal(mask, fresh_mask)
    assert (additive is None) == (fresh_additive is None)


def test_an_additive_mask_is_offered_to_sdpa_only_when_every_row_has_a_key():
    g = torch.Generator().manual_seed(6)
    allowed = torch.rand(2, 1, 4, 6, generator=g) > 0.5
    allowed[..., 0] = True  # every row has a key
    additive = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    assert fp.split_mask(additive, torch.float32)[2] is additive
    assert fp.split_mask(additive, torch.float64)[2] is None  # not in the inputs' dtype
    allowed[1, 0, 2] = False  # a row without a key: attnkit gives it 0, SDPA would not
    empty_row = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    mask, bias, offered = fp.split_mask(empty_row, torch.float32)
    assert offered is None and torch.equal(mask, allowed) and bias is None


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batches_are_exact_on_either_route(monkeypatch, side):
    # Right padding leaves every query row a key (the additive mask goes to SDPA as it is);
    # left padding gives the padded rows none (the boolean mask, and those rows are 0).
    model = _gpt2()
    ids, mask = _ids_and_padding()
    if side == "left":
        mask = mask.flip(-1)
    keep = mask.bool()
    ref = model(ids, attention_mask=mask).logits
    swap_attention(model)
    _no_general_path(monkeypatch)
    seen = []
    real = fp.sdpa.attend
    monkeypatch.setattr(
        fp.sdpa, "attend", lambda *a, **k: seen.append((k["mask"], k["bias"])) or real(*a, **k)
    )
    out = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[keep], ref[keep], **TIGHT)
    assert len(seen) == 2  # one call per layer
    for got_mask, got_bias in seen:
        if side == "right":
            assert got_mask is None and got_bias is not None and got_bias.dtype == torch.float64
        else:
            assert got_mask is not None and got_mask.dtype == torch.bool and got_bias is None


def test_sdpa_path_leaves_other_calls_to_the_general_path():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    path = fp.SdpaPath()
    score, softmax = fp.model_score(None, 4), ak_alignments.build("softmax")
    out = path(q, k, v, score, softmax, mask=None, bias=None, dropout=0.0)
    p = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)  # the reference, 1/√4 = 1/2
    torch.testing.assert_close(out.context, p @ v)
    sparse = ak_alignments.build("sparsemax")
    assert path(q, k, v, score, sparse, mask=None, bias=None, dropout=0.0) is None
    # a mostly empty 1024 × 1024 mask: attnkit.attention evaluates it block-sparsely
    n = 1024
    i = torch.arange(n)
    band = ((i[:, None] - i[None, :]).abs() < 64)[None, None]
    q, k, v = (torch.randn(1, 1, n, 4, generator=g) for _ in range(3))
    assert path(q, k, v, score, softmax, mask=band, bias=None, dropout=0.0) is None
