"""LightningAttentionMixer against transformers' MiniMaxLightningAttention with the weights
copied, in float64: prefill, gradients, padding equal to truncation and cached decoding (its own
and transformers' MiniMaxCache)."""

import pytest
import torch
from mixers.hf_float64 import widened
from transformers.models.minimax import modeling_minimax

from attnkit import masks
from attnkit.mixers import REGISTRY, LightningAttentionMixer

D = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def reference(seed=0, layer=1, *, exact=True, **config):
    """A small transformers MiniMaxLightningAttention in float64 with every weight perturbed;
    ``exact``: its decay buffers computed in float64 (transformers computes them in the default
    dtype)."""
    torch.manual_seed(seed)
    sizes = {
        "hidden_size": 16,
        "num_attention_heads": 4,
        "head_dim": 6,
        "num_hidden_layers": 3,
        "block_size": 4,
        "layer_types": ["linear_attention"] * 3,
    }
    cfg = modeling_minimax.MiniMaxConfig(**(sizes | config))
    default = torch.get_default_dtype()
    torch.set_default_dtype(D if exact else torch.float32)
    try:
        module = modeling_minimax.MiniMaxLightningAttention(cfg, layer).double().eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module


def run_reference(module, x, **kwargs):
    with widened(modeling_minimax):
        return module(x, None, kwargs.pop("attention_mask", None), **kwargs)[0]


def _x(b, n, seed=1):
    return torch.randn(b, n, 16, generator=torch.Generator().manual_seed(seed), dtype=D)


@pytest.mark.parametrize(
    ("config", "layer", "chunk"),
    [
        ({}, 1, 3),
        ({"num_attention_heads": 2, "head_dim": 8, "block_size": 256}, 0, 64),
        ({"num_attention_heads": 3, "head_dim": None, "hidden_size": 15}, 2, 5),
    ],
)
def test_prefill_equals_transformers(config, layer, chunk):
    theirs = reference(layer=layer, **config)
    ours = LightningAttentionMixer.from_transformers(theirs, chunk_size=chunk)
    x = torch.randn(2, 13, theirs.qkv_proj.in_features, dtype=D)
    expected = run_reference(theirs, x)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(ours(x), expected, **TOL)


def test_prefill_equals_transformers_as_it_is_at_float32_precision():
    """transformers computes its decays in float32 (the default dtype) and its norm in
    float32; unwidened it agrees to that precision."""
    theirs = reference(seed=1, exact=False)
    ours = LightningAttentionMixer.from_transformers(theirs)
    x = _x(2, 11)
    torch.testing.assert_close(ours(x), theirs(x, None, None)[0], rtol=1e-5, atol=1e-5)


def test_gradients_equal_transformers():
    theirs = reference(seed=2)
    ours = LightningAttentionMixer.from_transformers(theirs, chunk_size=3)
    x = _x(2, 10, seed=3)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    probe = _x(2, 10, seed=4)
    (ours(x_ours) * probe).sum().backward()
    (run_reference(theirs, x_theirs) * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL)
    mine = dict(ours.named_parameters())
    others = dict(theirs.named_parameters())
    assert set(mine) == set(others)  # the same names and layouts
    for name, p in mine.items():
        assert p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, others[name].grad, **TOL, msg=name)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_equals_truncation(side):
    theirs = reference(seed=3)
    ours = LightningAttentionMixer.from_transformers(theirs, chunk_size=4)
    lengths = [11, 6, 1]
    x = _x(3, 11, seed=5)
    keep = masks.from_lengths(torch.tensor(lengths), 11)[:, 0]
    if side == "left":
        keep = keep.flip(1)
    x = torch.where(keep[..., None], x, torch.full_like(x, 1e3))  # padding must not leak
    y = ours(x, mask=keep)
    for i in range(len(lengths)):
        real = keep[i]
        alone = run_reference(theirs, x[i : i + 1, real])[0]
        torch.testing.assert_close(y[i, real], alone, **TOL)
        assert (y[i, ~real] == 0).all()
    torch.testing.assert_close(ours(x, mask=keep[:, None]), y)


@pytest.mark.parametrize("side", ["right", "left"])
def test_transformers_own_mask_agrees_at_real_positions(side):
    """transformers zeroes padded q, k, v: at the real positions of a right- or left-padded
    batch its outputs are those of the truncated sequences as well."""
    theirs = reference(seed=4)
    ours = LightningAttentionMixer.from_transformers(theirs)
    x = _x(2, 9, seed=6)
    keep = masks.from_lengths(torch.tensor([9, 4]), 9)[:, 0]
    if side == "left":
        keep = keep.flip(1)
    mine = ours(x, mask=keep)
    with_mask = run_reference(theirs, x, attention_mask=keep.long())
    torch.testing.assert_close(mine[keep], with_mask[keep], **TOL)


def test_cached_decoding_equals_the_causal_pass_and_transformers_decoding():
    theirs = reference(seed=5)
    ours = LightningAttentionMixer.from_transformers(theirs, chunk_size=3)
    x = _x(2, 10, seed=7)
    full = ours(x)
    cache = ours.new_cache()
    steps = [ours(x[:, :4], cache=cache)] + [
        ours(x[:, t : t + 1], cache=cache) for t in range(4, 8)
    ]
    steps.append(ours(x[:, 8:], cache=cache))  # a chunk after single steps
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert len(cache) == 10 and cache.states["lightning"].shape == (2, 4, 6, 6)
    hf_cache = modeling_minimax.MiniMaxCache()
    hf = [run_reference(theirs, x[:, :4], cache=hf_cache)]
    hf += [run_reference(theirs, x[:, t : t + 1], cache=hf_cache) for t in range(4, 8)]
    hf.append(run_reference(theirs, x[:, 8:], cache=hf_cache))
    torch.testing.assert_close(torch.cat(hf, 1), full, **TOL)
    torch.testing.assert_close(cache.states["lightning"], hf_cache.get_linear_cache(1), **TOL)


def test_decoding_after_a_padded_prefill_equals_each_sequence_alone():
    theirs = reference(seed=6)
    ours = LightningAttentionMixer.from_transformers(theirs, chunk_size=4)
    lengths = [7, 3]
    x = _x(2, 7, seed=8)
    nxt = _x(2, 2, seed=9)
    cache = ours.new_cache()
    ours(x, mask=masks.from_lengths(torch.tensor(lengths), 7), cache=cache)
    steps = torch.cat([ours(nxt[:, t : t + 1], cache=cache) for t in range(2)], 1)
    for i, n in enumerate(lengths):
        alone = run_reference(theirs, torch.cat([x[i : i + 1, :n], nxt[i : i + 1]], 1))
        torch.testing.assert_close(steps[i], alone[0, n:], **TOL)


def test_registry_and_dtypes():
    layer = REGISTRY.build("lightning", embed_dim=12, num_heads=3)
    assert layer.head_dim == 4
    x = torch.randn(1, 5, 12)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    bf = LightningAttentionMixer(8, 2, dtype=torch.bfloat16)
    assert bf(torch.randn(1, 3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_bad_input_is_refused_by_name():
    layer = LightningAttentionMixer(8, 2)
    with pytest.raises(ValueError, match=r"x must be \(B, N, embed_dim\) = \(B, N, 8\)"):
        layer(torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match="mask must be key padding"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(2, 3))
    cache = layer.new_cache()
    layer(torch.randn(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="belongs to another layer"):
        LightningAttentionMixer(8, 2)(torch.randn(1, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="'lightning' state"):
        layer(torch.randn(3, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="embed_dim 9 must be a multiple of num_heads 2"):
        LightningAttentionMixer(9, 2)
    with pytest.raises(ValueError, match="layer_idx"):
        LightningAttentionMixer(8, 2, layer_idx=2, num_layers=2)
    with pytest.raises(TypeError, match="MiniMaxLightningAttention"):
        LightningAttentionMixer.from_transformers(torch.nn.Linear(2, 2))
    theirs = reference()
    theirs.act_fn = torch.nn.GELU()
    with pytest.raises(ValueError, match="must be SiLU"):
        LightningAttentionMixer.from_transformers(theirs)
