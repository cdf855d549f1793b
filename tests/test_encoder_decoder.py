"""The encoder–decoder Transformer: from_torch reproduces torch.nn.Transformer itself."""

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit import masks
from attnkit.encoder_decoder import Transformer

# torch.nn.Transformer warns that its inference fast path is off for these settings.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")


def _torch_transformer(norm_first, activation="relu", seed=0):
    torch.manual_seed(seed)
    theirs = nn.Transformer(
        d_model=8,
        nhead=2,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=16,
        dropout=0.0,
        activation=activation,
        batch_first=True,
        norm_first=norm_first,
    ).double()
    with torch.no_grad():  # torch starts biases at 0 and norms at 1: make every parameter count
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return theirs.eval()


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_from_torch_reproduces_torch_transformer_with_masks(norm_first, activation):
    theirs = _torch_transformer(norm_first, activation)
    ours = Transformer.from_torch(theirs)
    g = torch.Generator().manual_seed(1)
    src = torch.randn(2, 6, 8, dtype=torch.float64, generator=g, requires_grad=True)
    tgt = torch.randn(2, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    src_ok = masks.from_lengths(torch.tensor([6, 4]), 6)  # (B, 1, N), True = may attend
    tgt_ok = masks.from_lengths(torch.tensor([5, 3]), 5)
    ref = theirs(
        src,
        tgt,
        tgt_mask=nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64),
        src_key_padding_mask=~src_ok[:, 0],  # torch: True = ignore
        tgt_key_padding_mask=~tgt_ok[:, 0],
        memory_key_padding_mask=~src_ok[:, 0],
    )
    out = ours(src, tgt, src_mask=src_ok, tgt_mask=tgt_ok, memory_mask=src_ok)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    r = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * r).sum(), (src, tgt))
    g_out = torch.autograd.grad((out * r).sum(), (src, tgt))
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # The padding masks matter: without them the output changes.
    assert not torch.allclose(ours(src, tgt), out)


def test_from_torch_copies_every_parameter_and_setting():
    theirs = _torch_transformer(True)
    ours = Transformer.from_torch(theirs)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert all(layer.norm_first for layer in ours.decoder.layers)
    assert ours.encoder.norm is not None and ours.decoder.norm is not None
    with pytest.raises(TypeError, match=r"torch.nn.Transformer"):
        Transformer.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="bias=False"):
        Transformer.from_torch(nn.Transformer(8, 2, 1, 1, 16, bias=False))
    with pytest.raises(ValueError, match="custom_encoder"):
        Transformer.from_torch(nn.Transformer(8, 2, 1, 1, 16, custom_encoder=nn.Identity()))


def test_transformer_is_causal_in_the_target_and_exported():
    assert ak.Transformer is Transformer
    torch.manual_seed(0)
    model = Transformer(8, 2, encoder_layers=1, decoder_layers=2, d_ff=16, norm_first=True)
    model = model.double()
    src = torch.randn(1, 4, 8, dtype=torch.float64)
    tgt = torch.randn(1, 5, 8, dtype=torch.float64, requires_grad=True)
    y = model(src, tgt) @ torch.randn(8, dtype=torch.float64)  # a LayerNorm's sum is constant
    for i in range(5):
        (g,) = torch.autograd.grad(y[:, i].sum(), tgt, retain_graph=True)
        assert (g[:, i + 1 :] == 0).all() and (g[:, i] != 0).any()


def test_block_masks_and_score_mods_reach_both_stacks():
    from attnkit import patterns as pt

    torch.manual_seed(0)
    n, m = 40, 24
    model = Transformer(16, 4, encoder_layers=1, decoder_layers=1, d_ff=32).double()
    src = torch.randn(2, n, 16, dtype=torch.float64)
    tgt = torch.randn(2, m, 16, dtype=torch.float64)
    src_pattern, tgt_pattern = pt.longformer(3, [0]), pt.sliding_window(5, causal=True)

    def halve(e, b, h, q_idx, kv_idx):
        return e / 2

    out = model(
        src,
        tgt,
        src_block_mask=pt.block_mask(src_pattern, n, block_q=16, block_k=16),
        tgt_block_mask=pt.block_mask(tgt_pattern, m, block_q=8, block_k=8),
        src_score_mod=halve,
        tgt_score_mod=halve,
    )
    halved = Transformer(16, 4, encoder_layers=1, decoder_layers=1, d_ff=32).double()
    halved.load_state_dict(model.state_dict())
    for layer in (*halved.encoder.layers, *halved.decoder.layers):  # e/2 == (q/2)·k
        layer.self_attention.module.score_mod = halve
    ref = halved(
        src, tgt, src_mask=pt.dense(src_pattern, n, n), tgt_mask=pt.dense(tgt_pattern, m, m)
    )
    torch.testing.assert_close(out, ref)
