"""The default position scheme leaves queries and keys alone; the registry is loud."""

import pytest
import torch

import attnkit as ak


def test_no_position_is_the_identity():
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 7, 4)
    out = ak.positions.NoPosition()(q, k, q_offset=4)
    assert out.q is q and out.k is k and out.bias is None


def test_registry():
    assert "none" in ak.positions.available()
    assert isinstance(ak.positions.build("none"), ak.positions.NoPosition)
    with pytest.raises(ValueError, match="unknown position scheme"):
        ak.positions.build("sinusoid-ish")
