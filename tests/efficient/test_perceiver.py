"""Perceiver latent cross-attention: the forward pass against the paper's blocks written out
(multi-head attention as a loop over heads), latents invariant to permutations of the inputs,
masked inputs == removed inputs, weights whose size grows linearly in N, and clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit.efficient.perceiver import PerceiverEncoder

D, DIN, N_LAT, H = 8, 6, 3, 2


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _projections(mha):
    if mha.packed:
        wq, wk, wv = mha.in_proj_weight.split(mha.embed_dim)
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    bq, bk, bv = mha.in_proj_bias.split(mha.embed_dim)
    return (wq, bq), (wk, bk), (wv, bv)


def _mha(mha, query, key, keep=None):
    """Multi-head softmax attention (Vaswani eqs. 1-2), one head at a time; ``keep`` (B, N)."""
    (wq, bq), (wk, bk), (wv, bv) = _projections(mha)
    q, k, v = query @ wq.T + bq, key @ wk.T + bk, key @ wv.T + bv
    d, heads = mha.head_dim, []
    for h in range(mha.num_heads):
        c = slice(h * d, (h + 1) * d)
        s = q[..., c] @ k[..., c].transpose(-1, -2) / d**0.5
        if keep is not None:
            s = s.masked_fill(~keep[:, None, :], float("-inf"))
        heads.append(torch.softmax(s, -1) @ v[..., c])
    return mha.out_proj(torch.cat(heads, -1))


def _ln(norm, x):
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias)


def _mlp(mlp, x):
    norm, lin1, _, lin2 = mlp
    return F.gelu(_ln(norm, x) @ lin1.weight.T + lin1.bias) @ lin2.weight.T + lin2.bias


def _reference(model, x, queries, keep=None):
    """Z = Z₀ + CrossAttn(LN(Z₀), LN(X)); Z += MLP(LN(Z)); per block Z += SelfAttn(LN(Z)),
    Z += MLP(LN(Z)); out = CrossAttn(LN(Q), LN(Z))."""
    z0 = model.latents.expand(x.shape[0], -1, -1)
    z = z0 + _mha(model.cross, _ln(model.latent_norm, z0), _ln(model.input_norm, x), keep)
    z = z + _mlp(model.cross_mlp, z)
    for norm, attention, mlp in zip(
        model.self_norms, model.self_attentions, model.self_mlps, strict=True
    ):
        zn = _ln(norm, z)
        z = z + _mha(attention, zn, zn)
        z = z + _mlp(mlp, z)
    out = _mha(model.decoder, _ln(model.query_norm, queries), _ln(model.decoder_norm, z))
    return z, out


def _model(**kw):
    torch.manual_seed(0)
    model = PerceiverEncoder(D, DIN, N_LAT, H, 2, 16, query_dim=4, **kw).double()
    with torch.no_grad():  # non-trivial layer-norm affines and biases
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, dtype=p.dtype))
    return model


def test_forward_matches_the_blocks_written_out():
    model = _model()
    x, queries = _x(2, 7, DIN, seed=1), _x(2, 5, 4, seed=2)
    keep = torch.tensor([[True] * 7, [True, False, True, True, False, False, True]])
    out = model(x, mask=keep[:, None], queries=queries)
    z, decoded = _reference(model, x, queries, keep)
    torch.testing.assert_close(out.latents, z)
    torch.testing.assert_close(out.decoded, decoded)
    assert out.representation is out.decoded


def test_latents_are_invariant_to_permuting_the_inputs():
    model = _model()
    x = _x(2, 9, DIN, seed=3)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(model(x[:, perm]).latents, model(x).latents)


def test_masking_an_input_removes_it():
    model = _model()
    x, queries = _x(1, 7, DIN, seed=5), _x(1, 2, 4, seed=6)
    keep = torch.tensor([False, True, True, False, True, False, True])
    masked = model(x, mask=keep[None, None], queries=queries)
    removed = model(x[:, keep], queries=queries)
    torch.testing.assert_close(masked.latents, removed.latents)
    torch.testing.assert_close(masked.decoded, removed.decoded)


def test_weights_grow_linearly_in_n():
    """The cross weights are (n × N); every other attention's size is independent of N."""
    model = _model()
    queries = _x(1, 5, 4)
    for n in (4, 64, 1024):
        out = model(_x(1, n, DIN), queries=queries, need_weights=True)
        assert out.cross_weights.shape == (1, H, N_LAT, n)
        assert [w.shape for w in out.self_weights] == [(1, H, N_LAT, N_LAT)] * 2
        assert out.decoder_weights.shape == (1, H, 5, N_LAT)
        assert out.latents.shape == (1, N_LAT, D)


def test_bad_inputs_are_refused():
    model = _model()
    x = _x(2, 5, DIN)
    with pytest.raises(ValueError, match="key-padding mask"):
        model(x, mask=torch.ones(2, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"x must be \(B, N, 6\)"):
        model(_x(2, 5, 3))
    with pytest.raises(ValueError, match=r"queries must be \(B, O, 4\)"):
        model(x, queries=_x(2, 3, 5))
    no_decoder = PerceiverEncoder(D, DIN, N_LAT).double()
    assert no_decoder(x).representation.shape == (2, N_LAT, D)
    with pytest.raises(ValueError, match="without query_dim"):
        no_decoder(x, queries=_x(2, 3, 4))
