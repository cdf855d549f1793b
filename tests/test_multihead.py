"""MultiHeadAttention: parity with torch.nn.MultiheadAttention, any score × alignment, SPEC 8."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnkit as ak
from attnkit import masks

E, H = 12, 3


def _data(b=2, m=5, n=7, kdim=E, vdim=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, E, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, n, kdim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, n, vdim, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


CASES = {
    "self": {},
    "cross-kdim-vdim": {"kdim": 5, "vdim": 7},
    "no-bias": {"bias": False},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_from_torch_parity(case, masked, need_weights):
    kw = CASES[case]
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, batch_first=True, **kw).double()
    if kw.get("bias", True):
        with torch.no_grad():  # torch zero-initialises the biases; make them count
            theirs.in_proj_bias.normal_()
            theirs.out_proj.bias.normal_()
    ours = ak.MultiHeadAttention.from_torch(theirs)
    q, k, v = _data(kdim=kw.get("kdim", E), vdim=kw.get("vdim", E))
    if case == "self":
        k = v = q
    kpm = attn_mask = mask = None
    if masked:
        kpm = torch.zeros(2, k.shape[1], dtype=torch.bool)
        kpm[1, -3:] = True  # torch: True = ignore
        attn_mask = ~masks.causal(5, k.shape[1])
        mask = masks.combine(~kpm[:, None, :], ~attn_mask)
    ref, ref_w = theirs(
        q,
        k,
        v,
        key_padding_mask=kpm,
        attn_mask=attn_mask,
        need_weights=need_weights,
        average_attn_weights=False,
    )
    out = ours(q, k, v, mask=mask, need_weights=need_weights)
    torch.testing.assert_close(out.context, ref)
    if need_weights:
        torch.testing.assert_close(out.weights, ref_w)
    r = torch.randn_like(ref)
    inputs = [x for x in {id(t): t for t in (q, k, v)}.values()]
    g_ref = torch.autograd.grad((ref * r).sum(), [*inputs, *theirs.parameters()])
    g_out = torch.autograd.grad((out.context * r).sum(), [*inputs, *ours.parameters()])
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_from_torch_sequence_first_module():
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H).double()  # (L, B, E) inputs
    ours = ak.MultiHeadAttention.from_torch(theirs)
    q, k, v = _data()
    ref, _ = theirs(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    torch.testing.assert_close(ours(q, k, v).context, ref.transpose(0, 1))


def test_from_torch_rejects_unsupported_options():
    with pytest.raises(ValueError, match="add_bias_kv"):
        ak.MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        ak.MultiHeadAttention.from_torch(nn.Linear(2, 2))


def test_sdpa_dispatch_and_dense_path_agree():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H).double()
    q, k, v = _data()
    mask = masks.from_lengths(torch.tensor([7, 4]), 7)
    with mock.patch.object(
        F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention
    ) as sdpa:
        fast = mha(q, k, v, mask=mask).context
        assert sdpa.call_count == 1
        dense = mha(q, k, v, mask=mask, need_weights=True)
        assert sdpa.call_count == 1
    torch.testing.assert_close(fast, dense.context)


def _score_for(name: str):
    d = E // H
    if name == "location":
        return ak.scores.Location(d, 16, heads=H)
    return name


ALL_SCORES = ak.scores.available()


@pytest.mark.parametrize("score", ALL_SCORES)
@pytest.mark.parametrize("align", ["softmax", "sparsemax", "entmax15", "sigmoid"])
def test_any_score_and_alignment(score, align):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score=_score_for(score), align=align).double()
    q, k, v = _data()
    out = mha(q, k, v, need_weights=True)
    assert out.context.shape == (2, 5, E)
    assert out.weights.shape == (2, H, 5, 7)
    out.context.sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"


@pytest.mark.parametrize("score", ["general", "biased_general", "additive", "deep"])
def test_named_scores_get_one_parameter_set_per_head(score):
    mha = ak.MultiHeadAttention(E, H, score=score)
    for p in mha.score.parameters():
        assert p.shape[0] == H


def test_named_scores_are_built_with_explicit_sizes():
    # d_q = d_k = d_w = E/H: each score's for_heads names its sizes (no keyword filtering).
    d = E // H
    additive = ak.MultiHeadAttention(E, H, score="additive").score
    assert (additive.d_q, additive.d_k, additive.d_w, additive.heads) == (d, d, d, H)
    deep = ak.MultiHeadAttention(E, H, score="deep").score
    assert (deep.d_w, deep.depth, len(deep.hidden)) == (d, 2, 1)
    assert ak.MultiHeadAttention(E, H, score="learned_query").score.query.shape == (H, 1, d)
    assert ak.MultiHeadAttention(E, H, score="convolutional").score.filter.shape[:2] == (H, d)
    built = ak.MultiHeadAttention(E, H, score="general", dtype=torch.float64).score
    assert built.W.weight.shape == (H, d, d) and built.W.weight.dtype == torch.float64
    with pytest.raises(TypeError, match=r"location score needs max_len.*Location\(4, max_len"):
        ak.MultiHeadAttention(E, H, score="location")


def test_unbatched_query_gives_an_unbatched_output():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score="general").double()
    x = torch.randn(5, E, dtype=torch.float64)
    out = mha(x, mask=masks.causal(5), need_weights=True)
    ref = mha(x.unsqueeze(0), mask=masks.causal(5), need_weights=True)
    assert out.context.shape == (5, E) and out.weights.shape == (H, 5, 5)
    torch.testing.assert_close(out.context, ref.context[0])
    torch.testing.assert_close(out.weights, ref.weights[0])


CAUSAL_SAFE = [s for s in ALL_SCORES if not ak.scores.REGISTRY.get(s).mixes_keys]


@pytest.mark.parametrize("score", CAUSAL_SAFE)
def test_causal_receptive_field(score):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score=_score_for(score)).double()
    x = torch.randn(2, 6, E, dtype=torch.float64, requires_grad=True)
    out = mha(x, mask=masks.causal(6), need_weights=True)
    assert (out.weights.triu(diagonal=1) == 0).all()
    for i in range(6):
        (g,) = torch.autograd.grad(out.context[:, i].sum(), x, retain_graph=True)
        assert (g[:, i + 1 :] == 0).all()


@pytest.mark.parametrize("score", ["scaled_dot", "general", "additive", "cosine", "euclidean"])
def test_self_attention_is_permutation_equivariant(score):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score=score).double()
    x = torch.randn(2, 6, E, dtype=torch.float64)
    p = torch.randperm(6)
    torch.testing.assert_close(mha(x[:, p]).context, mha(x).context[:, p])


def test_mask_per_head():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H).double()
    x = torch.randn(2, 4, E, dtype=torch.float64)
    mask = torch.ones(2, H, 4, 4, dtype=torch.bool)
    mask[:, 1, :, 0] = False
    w = mha(x, mask=mask, need_weights=True).weights
    assert (w[:, 1, :, 0] == 0).all() and (w[:, 0, :, 0] > 0).all()
