"""The attention and position slots of MultiHeadAttention: any per-head attention part, any
position scheme, each checked against the computation written out by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.positions import Positioned, PositionScheme


class MeanOfValues(ak.HeadAttention):
    """A per-head attention part that is not score → align → sum: every query gets the mean of
    the allowed values (uniform weights computed here, not by an alignment)."""

    mask_forms = frozenset({"key", "padding", "causal", "full"})

    def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
        n = k.shape[-2]
        w = torch.ones(*torch.broadcast_shapes(q.shape[:-1], (*k.shape[:-2], 1)), n, dtype=v.dtype)
        if mask is not None:
            w = w * mask
        w = w / w.sum(-1, keepdim=True).clamp_min(1)
        ak.hooks.report(self, w)
        return ak.AttentionOutput(w @ v, w if need_weights else None)


class DistancePenalty(PositionScheme):
    """A test scheme: bias −slope_h·|i − j| per head h (an ALiBi-like bias)."""

    def __init__(self, slopes):
        super().__init__()
        self.slopes = torch.tensor(slopes)

    def forward(self, q, k, *, q_offset=0, k_offset=0):
        i = torch.arange(q.shape[-2]) + q_offset
        j = torch.arange(k.shape[-2]) + k_offset
        dist = (i[:, None] - j[None, :]).abs().to(q.dtype)
        return Positioned(q, k, -self.slopes.to(q.dtype)[:, None, None] * dist)


class ScaleByPosition(PositionScheme):
    """A test scheme that transforms q and k: multiply the vector at position p by (1 + p)."""

    def forward(self, q, k, *, q_offset=0, k_offset=0):
        fq = 1 + torch.arange(q.shape[-2], dtype=q.dtype)[:, None] + q_offset
        fk = 1 + torch.arange(k.shape[-2], dtype=k.dtype)[:, None] + k_offset
        return Positioned(q * fq, k * fk)


def _heads(mha, x):
    """Per-head projections written out: (B, H, L, d) for q, k, v."""
    e, h = mha.embed_dim, mha.num_heads
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q, k, v = (x @ w[i * e : (i + 1) * e].T + b[i * e : (i + 1) * e] for i in range(3))
    return [t.unflatten(-1, (h, e // h)).transpose(1, 2) for t in (q, k, v)]


def _merge(mha, ctx):
    return mha.out_proj(ctx.transpose(1, 2).flatten(-2))


def test_attention_slot_takes_a_part_that_is_not_score_align():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, attention=MeanOfValues()).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = ak.masks.from_lengths(torch.tensor([5, 3]), 5)
    out = mha(x, mask=mask, need_weights=True)
    _, _, v = _heads(mha, x)
    lengths = torch.tensor([5, 3])
    ref_ctx = torch.stack(
        [v[b, :, : lengths[b]].mean(-2, keepdim=True).expand(2, 5, 4) for b in range(2)]
    )
    torch.testing.assert_close(out.context, _merge(mha, ref_ctx))
    assert out.weights.shape == (2, 2, 5, 5)
    with ak.evaluation.capture(mha) as rec:
        mha(x)
    assert list(rec) == ["attention"]


def test_attention_slot_default_is_score_align():
    mha = ak.MultiHeadAttention(8, 2, score="general", align="sparsemax")
    assert isinstance(mha.attention, ak.Attention)
    assert isinstance(mha.score, ak.scores.General) and isinstance(
        mha.align, ak.alignments.Sparsemax
    )
    custom = ak.MultiHeadAttention(8, 2, attention=MeanOfValues())
    assert custom.score is None and custom.align is None


def test_attention_slot_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match=r"either attention= .* or score=/align="):
        ak.MultiHeadAttention(8, 2, score="general", attention=MeanOfValues())
    with pytest.raises(TypeError, match=r"attention must be an attnkit\.HeadAttention"):
        ak.MultiHeadAttention(8, 2, attention=lambda q, k, v: q)

    class Plain(nn.Module):  # the old protocol, capabilities unknown
        def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
            return ak.AttentionOutput(v)

    with pytest.raises(TypeError, match=r"plain nn\.Module: derive it from attnkit\.HeadAttention"):
        ak.MultiHeadAttention(8, 2, attention=Plain())


def test_attention_slot_given_a_class_asks_for_an_instance():
    with pytest.raises(TypeError, match=r"got the class MeanOfValues; pass MeanOfValues\(\.\.\.\)"):
        ak.MultiHeadAttention(8, 2, attention=MeanOfValues)
    with pytest.raises(TypeError, match=r"got the class Attention; pass Attention\(\.\.\.\)"):
        ak.TransformerEncoderLayer(8, 2, attention=ak.Attention)


def test_position_slot_bias_scheme_equals_the_explicit_bias():
    torch.manual_seed(1)
    slopes = [0.5, 0.25]
    mha = ak.MultiHeadAttention(8, 2, position=DistancePenalty(slopes)).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    q, k, v = _heads(mha, x)
    dist = (torch.arange(5)[:, None] - torch.arange(5)[None]).abs().double()
    bias = -torch.tensor(slopes, dtype=torch.float64)[:, None, None] * dist
    w = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + bias, -1)  # d = 4: scale 1/√4
    torch.testing.assert_close(mha(x).context, _merge(mha, w @ v))
    # a user's bias adds to the scheme's
    user = torch.randn(5, 5, dtype=torch.float64)
    w2 = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + bias + user, -1)
    torch.testing.assert_close(mha(x, bias=user).context, _merge(mha, w2 @ v))


def test_position_slot_transform_scheme_equals_the_transform():
    torch.manual_seed(2)
    mha = ak.MultiHeadAttention(8, 2, position=ScaleByPosition()).double()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    q, k, v = _heads(mha, x)
    f = 1 + torch.arange(4, dtype=torch.float64)[:, None]
    w = torch.softmax((q * f) @ (k * f).transpose(-1, -2) / 2.0, -1)
    torch.testing.assert_close(mha(x).context, _merge(mha, w @ v))


def test_position_slot_by_name_and_errors():
    assert isinstance(ak.MultiHeadAttention(8, 2).position, ak.positions.NoPosition)
    assert isinstance(
        ak.MultiHeadAttention(8, 2, position="none").position, ak.positions.NoPosition
    )
    with pytest.raises(ValueError, match="unknown position scheme 'nonee'; did you mean 'none'"):
        ak.MultiHeadAttention(8, 2, position="nonee")
    with pytest.raises(TypeError, match="PositionScheme"):
        ak.MultiHeadAttention(8, 2, position=3)


def test_no_position_leaves_attention_order_blind():
    torch.manual_seed(3)
    mha = ak.MultiHeadAttention(8, 2).double()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    perm = torch.randperm(6)
    torch.testing.assert_close(mha(x).context[:, perm], mha(x[:, perm]).context)
    positioned = ak.MultiHeadAttention(8, 2, position=DistancePenalty([1.0, 1.0])).double()
    positioned.load_state_dict(mha.state_dict())
    assert not torch.allclose(positioned(x).context[:, perm], positioned(x[:, perm]).context)
