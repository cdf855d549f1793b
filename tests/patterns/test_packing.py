"""Packed variable-length batches: a document mask from cu_seqlens; a packed row gives each
sequence exactly what it gets alone."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import patterns

CU = torch.tensor([0, 3, 3, 8, 10])  # lengths 3, 0, 5, 2


def test_document_and_position_ids():
    assert patterns.document_ids(CU).tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 3]
    assert patterns.position_ids(CU).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]


@pytest.mark.parametrize("causal", [False, True])
def test_mask_matches_the_definition(causal):
    doc = [0, 0, 0, 2, 2, 2, 2, 2, 3, 3]
    want = torch.tensor(
        [[doc[i] == doc[j] and (j <= i or not causal) for j in range(10)] for i in range(10)]
    )
    assert torch.equal(patterns.packed_mask(CU, causal=causal), want)
    assert torch.equal(patterns.dense(patterns.packed(CU, causal=causal), 10, 10), want)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_equals_each_sequence_alone(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 10, 4, dtype=torch.float64) for _ in range(3))
    bm = patterns.packed_block_mask(CU, causal=causal, block_q=4, block_k=4)
    by_blocks = ak.attention(q, k, v, block_mask=bm).context
    by_mask = ak.attention(q, k, v, mask=patterns.packed_mask(CU, causal=causal)).context
    for s in range(len(CU) - 1):
        a, b = int(CU[s]), int(CU[s + 1])
        if a == b:
            continue
        alone = ak.attention(
            q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
            mask=ak.masks.causal(b - a) if causal else None,
        ).context  # fmt: skip
        torch.testing.assert_close(by_blocks[..., a:b, :], alone, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(by_mask[..., a:b, :], alone, atol=1e-12, rtol=1e-12)
    assert not bm.any_allowed[0, 2]  # tiles across documents are skipped


def test_packed_multihead_attention_equals_each_sequence_alone():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 10, 8, dtype=torch.float64)
    out = mha(x, mask=patterns.packed_mask(CU, causal=True)).context
    for a, b in ((0, 3), (3, 8), (8, 10)):
        alone = mha(x[:, a:b], mask=ak.masks.causal(b - a)).context
        torch.testing.assert_close(out[:, a:b], alone, atol=1e-12, rtol=1e-12)


def test_refusals():
    with pytest.raises(ValueError, match="start at 0"):
        patterns.packed_mask(torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="must not decrease"):
        patterns.packed_mask(torch.tensor([0, 3, 2]))
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D integer tensor"):
        patterns.packed_mask([0, 3])
