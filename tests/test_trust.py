"""Validate at the door, trust inside: the trusted context; what a trusted layer still checks."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit import checks, head, trust


def test_trusted_is_scoped_and_nests():
    assert not trust.is_trusted()
    with trust.trusted():
        assert trust.is_trusted()
        with trust.trusted():
            assert trust.is_trusted()
        assert trust.is_trusted()
    assert not trust.is_trusted()
    with pytest.raises(RuntimeError), trust.trusted():
        raise RuntimeError
    assert not trust.is_trusted()


def test_a_trusted_layer_skips_the_parameter_walk_but_not_the_user_checks():
    mha = ak.MultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with mock.patch.object(checks, "part_matches", wraps=checks.part_matches) as spy:
        mha(x)
        walked = spy.call_count
        with trust.trusted():
            mha(x)
        assert walked > 0 and spy.call_count == walked  # nothing walked inside
    with trust.trusted(), pytest.raises(TypeError, match=r"bias has dtype torch\.float64"):
        mha(x, bias=torch.zeros(5, 5, dtype=torch.float64))
    with trust.trusted(), pytest.raises(ValueError, match="query has 7 features"):
        mha(torch.randn(2, 5, 7))


def test_finite_is_stated_by_the_door_and_kept_by_inner_trusted_contexts():
    assert not trust.inputs_finite()
    with trust.trusted(finite=True):
        assert trust.inputs_finite()
        with trust.trusted():  # an inner door (a layer calling its part) keeps the statement
            assert trust.inputs_finite()
        with trust.trusted(finite=False):
            assert not trust.inputs_finite()
        assert trust.inputs_finite()
    assert not trust.inputs_finite()
    refused = pytest.raises(TypeError, match="finite must be a bool or None, got 'yes'")
    with refused, trust.trusted(finite="yes"):  # type: ignore[arg-type]
        pass


class _Counts:
    """Counters on the validation helpers and on every torch.isfinite call (its input shape)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mask_checks = 0
        self.validations = 0
        self.head_checks = 0
        self.finite_scans: list[tuple[int, ...]] = []
        mask_check, validate, isfinite = ak.masks.check, checks.validate, torch.isfinite
        check_head_inputs = head.check_head_inputs

        def counted_mask_check(*args, **kwargs):
            self.mask_checks += 1
            return mask_check(*args, **kwargs)

        def counted_validate(*args, **kwargs):
            self.validations += 1
            return validate(*args, **kwargs)

        def counted_head_check(*args, **kwargs):
            self.head_checks += 1
            return check_head_inputs(*args, **kwargs)

        def counted_isfinite(x):
            self.finite_scans.append(tuple(x.shape))
            return isfinite(x)

        monkeypatch.setattr(ak.masks, "check", counted_mask_check)
        monkeypatch.setattr(checks, "validate", counted_validate)
        monkeypatch.setattr(head, "check_head_inputs", counted_head_check)
        monkeypatch.setattr(torch, "isfinite", counted_isfinite)

    def reset(self) -> None:
        self.mask_checks = self.validations = self.head_checks = 0
        self.finite_scans.clear()


def _padded_reference(mha, x, lengths):
    """Each item alone, truncated to its length (the per-head part sees only real keys)."""
    return [mha(x[i : i + 1, :n]).context for i, n in enumerate(lengths)]


def test_a_masked_multi_head_call_validates_its_mask_and_inputs_once(monkeypatch):
    mha = ak.MultiHeadAttention(8, 2).eval()
    lengths = [5, 3]
    x = torch.randn(2, 5, 8)
    x[1, 3:] = float("nan")  # padding content: reaches nothing, is not looked for
    mask = ak.masks.from_lengths(torch.tensor(lengths), 5)
    counts = _Counts(monkeypatch)
    out = mha(x, mask=mask).context
    assert counts.mask_checks == 1  # at the layer's door, not again in the per-head call
    assert counts.validations == 0  # the per-head call is not validated a second time
    assert counts.finite_scans == []  # masked keys are excluded by construction
    for i, (want, n) in enumerate(zip(_padded_reference(mha, x, lengths), lengths, strict=True)):
        torch.testing.assert_close(out[i : i + 1, :n], want)


def test_a_padded_decoding_step_scans_no_cache(monkeypatch):
    """A step of batched decoding with key padding over a KV cache: the mask is checked once per
    layer call and no key or value of the cache is looked at for non-finite content."""
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2).eval()
    lengths, n = [6, 4], 6
    x = torch.randn(2, n + 1, 8)
    x[1, lengths[1] : n] = float("inf")  # the second row's padding, inside the cache
    pad = ak.masks.from_lengths(torch.tensor(lengths), n)  # (B, 1, N)
    keep = torch.cat([pad, torch.ones(2, 1, 1, dtype=torch.bool)], -1)  # + the new token
    cache = ak.kv_cache.LayerCache()
    with torch.no_grad():
        mha(x[:, :n], mask=pad & ak.masks.causal(n), cache=cache)
        counts = _Counts(monkeypatch)
        step = mha(x[:, n:], mask=keep, cache=cache).context
    # the prefill validated this kind of call in full; the step's mask is checked by its sizes
    # alone (attnkit.call_plan)
    assert counts.mask_checks == 0 and counts.validations == 0
    assert counts.finite_scans == []
    # reference: each row alone, its padding dropped, in one causal pass
    for i, length in enumerate(lengths):
        real = torch.cat([x[i : i + 1, :length], x[i : i + 1, n:]], 1)
        want = mha(real, mask=ak.masks.causal(length + 1)).context[:, -1:]
        torch.testing.assert_close(step[i : i + 1], want)


def test_a_decoding_step_of_the_decoder_lm_validates_nothing_twice(monkeypatch):
    from attnkit.models.decoder_lm import DecoderLM

    torch.manual_seed(0)
    lm = DecoderLM(50, 16, 2, 2, max_len=16).eval()
    tokens = torch.randint(0, 50, (2, 7))
    cache = lm.new_cache()
    with torch.no_grad():
        lm(tokens[:, :6], cache=cache)
        counts = _Counts(monkeypatch)
        step = lm(tokens[:, 6:], cache=cache)
        assert counts.validations == 0 and counts.mask_checks == 0
        assert counts.head_checks == 0
        assert counts.finite_scans == []
        counts.reset()
        whole = lm(tokens)  # the prompt's causal mask: the model states its activations finite
        assert counts.finite_scans == [] and counts.validations == 0
    torch.testing.assert_close(step[:, -1], whole[:, -1])


def test_a_trusted_call_still_refuses_a_score_built_for_other_heads():
    part = ak.Attention(ak.scores.Location(4, 8, num_heads=3), "softmax")
    q = torch.randn(1, 2, 5, 4)  # two heads
    with trust.trusted(), pytest.raises(ValueError, match="num_heads=3"):
        part(q, q, q)
