"""Transformer blocks: parity with torch's encoder layer, causal decoder."""

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
