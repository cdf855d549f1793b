"""torch.compile on attnkit modules: the SDPA path compiles to one graph (fullgraph=True), and
compiled modules give the eager results. Compilation takes seconds per case, so all but one case
run under the slow marker (`pytest -m slow tests/test_compile.py`)."""

from __future__ import annotations

import pytest
import torch
from registered_parts import ALIGNMENTS, SCORES, Dims

import attnkit as ak
from attnkit.transformer import TransformerEncoderLayer

DIMS = Dims(max_len=8)


def test_multihead_sdpa_path_compiles_to_one_graph():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(16, 2)
    x = torch.randn(2, 5, 16)
    compiled = torch.compile(mha, fullgraph=True)  # raises on any graph break
    torch.testing.assert_close(compiled(x).context, mha(x).context)


@pytest.mark.slow
def test_multihead_with_a_padding_mask_compiles_to_one_graph():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(16, 2)
    x = torch.randn(2, 5, 16, requires_grad=True)
    mask = ak.masks.from_lengths(torch.tensor([5, 3]), 5)
    compiled = torch.compile(mha, fullgraph=True)
    out, ref = compiled(x, mask=mask).context, mha(x, mask=mask).context
    torch.testing.assert_close(out, ref)
    g1 = torch.autograd.grad(out.sum(), x)[0]
    g2 = torch.autograd.grad(ref.sum(), x)[0]
    torch.testing.assert_close(g1, g2)


@pytest.mark.slow
@pytest.mark.parametrize("score", sorted(SCORES))
def test_every_score_compiles_and_matches_eager(score):
    torch.manual_seed(0)
    att = ak.Attention(SCORES[score](DIMS), ALIGNMENTS["softmax"](DIMS))
    q = torch.randn(2, 3, DIMS.d_q, requires_grad=True)
    k = torch.randn(2, 6, DIMS.d_k, requires_grad=True)
    v = torch.randn(2, 6, DIMS.d_v)
    compiled = torch.compile(att)
    out, ref = compiled(q, k, v).context, att(q, k, v).context
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # (a query-free score ignores q, a location score ignores k: no gradient on either side)
    g1 = torch.autograd.grad(out.sum(), [q, k], allow_unused=True)
    g2 = torch.autograd.grad(ref.sum(), [q, k], allow_unused=True)
    for a, b in zip(g1, g2, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_transformer_layers_compile_and_match_eager():
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(16, 2, 32).eval()
    x = torch.randn(2, 5, 16)
    mask = ak.masks.from_lengths(torch.tensor([5, 2]), 5)
    compiled = torch.compile(layer)
    torch.testing.assert_close(compiled(x, mask), layer(x, mask), atol=1e-5, rtol=1e-5)
