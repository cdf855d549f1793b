"""Transformer blocks: parity with torch's encoder layer, causal decoder."""

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.transformer import TransformerDecoderLayer, TransformerEncoderLayer


def test_encoder_layer_matches_torch():
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).double()
    ours = TransformerEncoderLayer(16, 4, 32).double()
    mha = ak.MultiHeadAttention.from_torch(theirs.self_attn)
    ours.self_attention.module.load_state_dict(mha.state_dict())
    ours.ff[0].load_state_dict(theirs.linear1.state_dict())
    ours.ff[3].load_state_dict(theirs.linear2.state_dict())
    ours.norm1.load_state_dict(theirs.norm1.state_dict())
    ours.norm2.load_state_dict(theirs.norm2.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x))


def test_decoder_is_causal():
    torch.manual_seed(0)
    layer = TransformerDecoderLayer(16, 4, score="additive", align="entmax15").double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    y = layer(x, torch.randn(2, 7, 16, dtype=torch.float64))
    for i in range(5):
        (g,) = torch.autograd.grad(y[:, i].sum(), x, retain_graph=True)
        assert (g[:, i + 1 :] == 0).all()


def test_layers_are_built_in_the_dtype_asked_and_follow_to():
    from attnkit.transformer import TransformerEncoder

    for module in (
        TransformerEncoder(2, 8, 2, dtype=torch.float64),
        TransformerDecoderLayer(8, 2, score="additive", dtype=torch.float64),
        TransformerEncoderLayer(8, 2).to(torch.float64),
    ):
        dtypes = {p.dtype for p in module.parameters()} | {b.dtype for b in module.buffers()}
        assert dtypes == {torch.float64}, type(module).__name__
    with torch.device("meta"):
        assert {p.device.type for p in TransformerEncoderLayer(8, 2).parameters()} == {"meta"}
    assert {p.device.type for p in TransformerEncoderLayer(8, 2, device="meta").parameters()} == {
        "meta"
    }


def test_encoder_layer_in_float64_matches_the_formula():
    # x = LN(x + MHA(x)); x = LN(x + W2 relu(W1 x + b1) + b2), written out (Vaswani et al.).
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(8, 2, 16, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mha = layer.self_attention.module
    w_q, w_k, w_v = mha.in_proj_weight.split(8)
    b_q, b_k, b_v = mha.in_proj_bias.split(8)
    heads = []
    for h in range(2):
        s = slice(4 * h, 4 * h + 4)
        q, k, v = x @ w_q[s].T + b_q[s], x @ w_k[s].T + b_k[s], x @ w_v[s].T + b_v[s]
        heads.append(torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1) @ v)
    att = torch.cat(heads, -1) @ mha.out_proj.weight.T + mha.out_proj.bias
    y = nn.functional.layer_norm(x + att, (8,), layer.norm1.weight, layer.norm1.bias)
    ff = torch.relu(y @ layer.ff[0].weight.T + layer.ff[0].bias) @ layer.ff[3].weight.T
    ref = nn.functional.layer_norm(
        y + ff + layer.ff[3].bias, (8,), layer.norm2.weight, layer.norm2.bias
    )
    torch.testing.assert_close(layer(x), ref, atol=1e-12, rtol=1e-12)


class _ScaleByPosition(ak.positions.PositionScheme):
    """A test scheme: the vector at position p is multiplied by (1 + p)."""

    def forward(self, q, k, *, q_offset=0, k_offset=0):
        fq = 1 + torch.arange(q.shape[-2], dtype=q.dtype)[:, None] + q_offset
        fk = 1 + torch.arange(k.shape[-2], dtype=k.dtype)[:, None] + k_offset
        return ak.positions.Positioned(q * fq, k * fk)


def test_layers_fill_the_attention_and_position_slots_of_their_self_attention():
    torch.manual_seed(0)
    part = ak.Attention("dot", "sparsemax")
    layer = TransformerEncoderLayer(8, 2, 16, attention=part, position=_ScaleByPosition())
    layer = layer.double()
    mha = layer.self_attention.module
    assert mha.attention is part and isinstance(mha.position, _ScaleByPosition)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    # Written out: the same projections, q and k scaled by (1 + position), dot + sparsemax.
    q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in mha._project(x, x, x))
    scale = 1 + torch.arange(5, dtype=torch.float64)[:, None]
    heads = ak.attention(q * scale, k * scale, v, score="dot", align="sparsemax").context
    att = mha.out_proj(heads.transpose(1, 2).flatten(-2))
    y = layer.norm1(x + att)
    torch.testing.assert_close(layer(x), layer.norm2(y + layer.ff(y)), atol=1e-12, rtol=1e-12)
    dec = TransformerDecoderLayer(8, 2, position="none", attention=ak.Attention("dot"))
    assert dec.self_attention.module.attention.score.registered_name == "dot"
    assert dec.cross_attention.module.score.registered_name == "scaled_dot"
    with pytest.raises(ValueError, match="pass either attention="):
        TransformerEncoderLayer(8, 2, score="additive", attention=ak.Attention("dot"))


# ---- sparse encoders: a pattern is one argument ----------------------------------------------


def _sparse_patterns(n):
    from attnkit import patterns as pt

    return {
        "bigbird": pt.bigbird(8, n, global_positions=[0], random_blocks=1, block=64),
        "longformer": pt.longformer(8, [0, n // 2]),
        "sparse transformer": pt.strided(16, causal=False),
    }


@pytest.mark.parametrize("name", ["bigbird", "longformer", "sparse transformer"])
def test_a_pattern_encoder_equals_the_dense_masked_encoder_and_skips_empty_tiles(name):
    from unittest import mock

    from attnkit import patterns as pt
    from attnkit.kernels import chunked

    torch.manual_seed(0)
    n = 520  # 5 tiles of 128 a side, the last one ragged
    pattern = _sparse_patterns(n)[name]
    sparse = ak.TransformerEncoder(2, 16, 4, 32, pattern=pattern).double()
    plain = ak.TransformerEncoder(2, 16, 4, 32).double()
    plain.load_state_dict(sparse.state_dict())
    x = torch.randn(2, n, 16, dtype=torch.float64)
    with mock.patch.object(chunked, "attend", wraps=chunked.attend) as spy:
        out = sparse(x)
    densities = [c.kwargs["block_mask"].density for c in spy.call_args_list]
    assert len(densities) == 2
    if name != "sparse transformer":  # (the strided pattern's columns reach every tile)
        assert max(densities) < 1
    torch.testing.assert_close(out, plain(x, mask=pt.dense(pattern, n, n)))


def test_block_mask_and_score_mod_reach_every_layer():
    from attnkit import patterns as pt

    torch.manual_seed(1)
    n = 40
    pattern = pt.sliding_window(4)
    bm = pt.block_mask(pattern, n, block_q=16, block_k=16)

    def soft_cap(e, b, h, q_idx, kv_idx):
        return 2.0 * torch.tanh(e / 2.0)

    enc = ak.TransformerEncoder(2, 16, 4, 32).double()
    capped = ak.TransformerEncoder(2, 16, 4, 32, score_mod=soft_cap).double()
    capped.load_state_dict(enc.state_dict())
    x = torch.randn(2, n, 16, dtype=torch.float64)
    torch.testing.assert_close(
        enc(x, block_mask=bm, score_mod=soft_cap), capped(x, mask=pt.dense(pattern, n, n))
    )
    dec = ak.TransformerDecoder(2, 16, 4, 32, cross_attention=False).double()
    torch.testing.assert_close(
        dec(x, block_mask=bm, score_mod=soft_cap),
        dec(x, mask=pt.dense(pattern, n, n), score_mod=soft_cap),
    )
    assert not torch.allclose(dec(x, score_mod=soft_cap), dec(x))


@pytest.mark.parametrize(
    ("cls", "lead"),
    [
        (TransformerEncoderLayer, ()),
        (TransformerDecoderLayer, ()),
        (ak.TransformerEncoder, (1,)),
        (ak.TransformerDecoder, (1,)),
        (ak.Transformer, ()),
    ],
)
def test_sizes_are_spelt_embed_dim_and_num_heads(cls, lead):
    """DESIGN 8: ``embed_dim`` and ``num_heads``; the old keywords name the new ones."""
    extra = {"encoder_layers": 1, "decoder_layers": 1} if cls is ak.Transformer else {}
    built = cls(*lead, embed_dim=8, num_heads=2, d_ff=16, **extra)
    layer = built.encoder.layers[0] if cls is ak.Transformer else built
    layer = layer.layers[0] if hasattr(layer, "layers") else layer
    assert layer.self_attention.module.num_heads == 2
    assert layer.ff[0].in_features == 8
    with pytest.raises(TypeError, match=rf"^{cls.__name__}: `d_model` is now `embed_dim`$"):
        cls(*lead, d_model=8, num_heads=2, **extra)
    with pytest.raises(TypeError, match=rf"^{cls.__name__}: `heads` is now `num_heads`$"):
        cls(*lead, 8, heads=2, **extra)


def test_a_decoder_stack_builds_its_causal_mask_once_per_forward(monkeypatch):
    from attnkit import masks
    from attnkit.transformer import TransformerDecoder

    torch.manual_seed(0)
    stack = TransformerDecoder(3, 16, 4, cross_attention=False, final_norm=False).double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    alone = x
    for layer in stack.layers:  # each layer on its own builds its mask
        alone = layer(alone)
    made = []
    real = masks.causal

    def counted(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(masks, "causal", counted)
    torch.testing.assert_close(stack(x), alone)
    assert made == [(6, 6)]
    made.clear()
    cache = stack.new_cache()
    torch.testing.assert_close(stack(x[:, :4], cache=cache), stack(x[:, :4]))
    assert made == [(4, 4), (4, 4)]  # one per forward (the cached one and the plain one)
    step = stack(x[:, 4:6], cache=cache)  # two new positions after four cached: (2, 6)
    torch.testing.assert_close(step, stack(x)[:, 4:6])
    assert made[2] == (2, 6) and len(made) == 4
