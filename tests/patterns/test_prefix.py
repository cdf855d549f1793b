"""Prefix-LM masks: bidirectional within the prefix, causal after (T5 Fig. 3, UniLM)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import patterns


def _loop(p, n):
    return torch.tensor([[j < p or j <= i for j in range(n)] for i in range(n)])


@pytest.mark.parametrize("p", [0, 1, 3, 6])
def test_mask_and_mask_mod_match_the_definition(p):
    assert torch.equal(patterns.prefix_lm_mask(p, 6), _loop(p, 6))
    assert torch.equal(patterns.dense(patterns.prefix_lm(p), 6, 6), _loop(p, 6))


def test_extremes_are_causal_and_full():
    assert torch.equal(patterns.prefix_lm_mask(0, 5), ak.masks.causal(5))
    assert patterns.prefix_lm_mask(5, 5).all()


def test_per_item_prefixes_and_block_sparse_evaluation():
    torch.manual_seed(0)
    lengths = torch.tensor([2, 5])
    q, k, v = (torch.randn(2, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    mask = patterns.prefix_lm_mask(lengths, 9)
    for b in range(2):
        assert torch.equal(mask[b], _loop(int(lengths[b]), 9))
    dense = ak.attention(q, k, v, mask=mask[:, None]).context
    bm = patterns.block_mask(
        patterns.prefix_lm(lengths), 9, batch=2, num_heads=1, block_q=4, block_k=4
    )
    torch.testing.assert_close(ak.attention(q, k, v, block_mask=bm).context, dense)


def test_prefix_tokens_see_the_whole_prefix_and_nothing_after():
    """Output i < P depends on every prefix token (gradient) and on no token ≥ P."""
    torch.manual_seed(0)
    x = torch.randn(1, 7, 8, dtype=torch.float64, requires_grad=True)
    mha = ak.MultiHeadAttention(8, 2).double()
    out = mha(x, mask=patterns.prefix_lm_mask(3, 7)).context
    out[0, 0].sum().backward()
    assert (x.grad[0, :3].abs().sum(-1) > 0).all() and not x.grad[0, 3:].any()


def test_refusals():
    with pytest.raises(ValueError, match="prefix_lengths"):
        patterns.prefix_lm(-1)
    with pytest.raises(TypeError, match="prefix_lengths must be an int or a 1-D integer"):
        patterns.prefix_lm_mask(torch.tensor([1.5]), 4)
