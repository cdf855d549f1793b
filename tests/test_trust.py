"""Validate at the door, trust inside: the trusted context; what a trusted layer still checks."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit import checks, trust


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
