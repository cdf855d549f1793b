"""The validated call (attnkit.kernels.prepare): what a caller's stated facts leave out, and what
they do not."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit import checks
from attnkit.kernels.prepare import clear_masked, prepare_call


def _reference(q, k, v, mask):
    e = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, float("-inf"))
    return torch.softmax(e, -1) @ v


def test_a_checked_call_is_not_validated_again_but_what_the_caller_cannot_know_is():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = ak.masks.from_lengths(torch.tensor([5, 3]), 5)[:, None]
    with mock.patch.object(checks, "validate", wraps=checks.validate) as validate:
        call = prepare_call(q, k, v, mask=mask, checked=True)
        assert validate.call_count == 0
        assert call.shape == (2, 3, 5, 5)
        prepare_call(q, k, v, mask=mask)
        assert validate.call_count == 1
    out = ak.kernels.select(call).attend(call).context
    torch.testing.assert_close(out, _reference(q, k, v, mask.expand(2, 3, 5, 5)))
    with pytest.raises(ValueError, match=r"k has no keys \(N = 0"):
        prepare_call(q, k[..., :0, :], v[..., :0, :], checked=True)
    with pytest.raises(ValueError, match="num_heads=2"):
        prepare_call(q, k, v, score=ak.scores.Location(4, 8, num_heads=2), checked=True)
    # unchecked, a caller's mistake gets the full message
    with pytest.raises(TypeError, match="dtype"):
        prepare_call(q, k.float(), v, mask=mask)


def test_finite_inputs_are_neither_looked_at_nor_cleared_even_where_the_call_would_scan():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    causal = ak.masks.causal(6)
    with mock.patch.object(torch, "isfinite", wraps=torch.isfinite) as looked:
        # a per-query mask with weights asked for: looked at unless stated finite
        call = prepare_call(q, k, v, mask=causal, need_weights=True, finite=True)
        assert looked.call_count == 0
        assert call.masked_finite and call.k is k and call.v is v
        prepare_call(q, k, v, mask=causal, need_weights=True)
        assert looked.call_count > 0
    key_mask = ak.masks.from_lengths(torch.tensor([4]), 6)
    kept = clear_masked(k, v, key_mask, scan=False, finite=True)
    assert kept[0] is k and kept[1] is v and kept[2]
    cleared_k, cleared_v, ok = clear_masked(k, v, key_mask, scan=False)
    assert ok and (cleared_k[0, 4:] == 0).all() and (cleared_v[0, 4:] == 0).all()
