"""Mamba2Mixer against transformers' Mamba2Mixer (its torch path) with the weights copied, in
float64: prefill, gradients, padding equal to truncation and cached decoding (its own and
transformers')."""

import pytest
import torch
from mixers.hf_float64 import widened
from transformers import DynamicCache, Mamba2Config
from transformers.models.mamba2 import modeling_mamba2

from attnkit import masks
from attnkit.mixers import REGISTRY, Mamba2Mixer, MixerCache

TOL = {"rtol": 1e-10, "atol": 1e-10}


def reference(seed=0, **config):
    """A small transformers Mamba2Mixer in float64 with every weight perturbed (so that no
    default value — D = 1, a unit norm weight — hides a mistake)."""
    torch.manual_seed(seed)
    sizes = {
        "hidden_size": 16,
        "num_heads": 4,
        "head_dim": 8,
        "state_size": 6,
        "n_groups": 2,
        "expand": 2,
        "conv_kernel": 4,
        "chunk_size": 5,
        "num_hidden_layers": 1,
    }
    cfg = Mamba2Config(**(sizes | config))
    module = modeling_mamba2.Mamba2Mixer(cfg, 0).double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return cfg, module


def run_reference(module, x, **kwargs):
    with widened(modeling_mamba2):
        return module(x, **kwargs)


@pytest.mark.parametrize(
    ("config", "chunk"),
    [
        ({}, 3),
        ({"n_groups": 1, "use_bias": True, "use_conv_bias": False}, 64),
        ({"n_groups": 4, "conv_kernel": 2, "time_step_limit": (0.05, 0.4)}, 4),
    ],
)
def test_prefill_equals_transformers(config, chunk):
    _, theirs = reference(**config)
    ours = Mamba2Mixer.from_transformers(theirs, chunk_size=chunk)
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), run_reference(theirs, x), **TOL)


def test_prefill_equals_transformers_as_it_is_at_float32_precision():
    """transformers computes its scan and norm in float32 whatever the input; unwidened it agrees
    to that precision."""
    _, theirs = reference(seed=1)
    ours = Mamba2Mixer.from_transformers(theirs)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_gradients_equal_transformers():
    _, theirs = reference(seed=2, use_bias=True)
    ours = Mamba2Mixer.from_transformers(theirs, chunk_size=4)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    probe = torch.randn(2, 10, 16, dtype=torch.float64)
    (ours(x_ours) * probe).sum().backward()
    (run_reference(theirs, x_theirs) * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL)
    pairs = {
        "in_proj.weight": "in_proj.weight",
        "in_proj.bias": "in_proj.bias",
        "conv.weight": "conv1d.weight",
        "conv.bias": "conv1d.bias",
        "A_log": "A_log",
        "dt_bias": "dt_bias",
        "D": "D",
        "norm.weight": "norm.weight",
        "out_proj.weight": "out_proj.weight",
        "out_proj.bias": "out_proj.bias",
    }
    mine, theirs_params = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert set(pairs) == set(mine)
    for a, b in pairs.items():
        assert mine[a].grad is not None and mine[a].grad.abs().sum() > 0, a
        torch.testing.assert_close(mine[a].grad, theirs_params[b].grad, **TOL, msg=a)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_equals_truncation(side):
    _, theirs = reference(seed=3, use_bias=True)
    ours = Mamba2Mixer.from_transformers(theirs, chunk_size=4)
    lengths = [11, 6, 1]
    x = torch.randn(3, 11, 16, dtype=torch.float64)
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


def test_transformers_own_mask_agrees_at_real_positions_of_a_right_padded_batch():
    """transformers zeroes padded inputs, so with right padding its outputs at real positions
    are those of the truncated sequences as well (its state, which keeps decaying over the
    padding, is what differs; see the decoding test below)."""
    _, theirs = reference(seed=4)
    ours = Mamba2Mixer.from_transformers(theirs)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    keep = masks.from_lengths(torch.tensor([9, 4]), 9)[:, 0]
    mine = ours(x, mask=keep)
    with_mask = run_reference(theirs, x, attention_mask=keep.long())
    torch.testing.assert_close(mine[keep], with_mask[keep], **TOL)


def test_cached_decoding_equals_the_causal_pass_and_transformers_decoding():
    cfg, theirs = reference(seed=5)
    ours = Mamba2Mixer.from_transformers(theirs, chunk_size=3)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    full = ours(x)
    cache = ours.new_cache()
    steps = [ours(x[:, :4], cache=cache)] + [
        ours(x[:, t : t + 1], cache=cache) for t in range(4, 8)
    ]
    steps.append(ours(x[:, 8:], cache=cache))  # a chunk after single steps
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert len(cache) == 10
    hf_cache = DynamicCache(config=cfg)
    hf = [run_reference(theirs, x[:, :4], cache=hf_cache)]
    hf += [run_reference(theirs, x[:, t : t + 1], cache=hf_cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(hf, 1), full, **TOL)
    # the same state: (B, H, n, P) here, (B, H, P, n) in transformers
    ours_state = ours.new_cache()
    ours(x, cache=ours_state)
    their_state = hf_cache.get_recurrent_state(0)
    torch.testing.assert_close(ours_state.states["ssm"].transpose(-1, -2), their_state, **TOL)


def test_decoding_after_a_padded_prefill_equals_each_sequence_alone():
    _, theirs = reference(seed=6)
    ours = Mamba2Mixer.from_transformers(theirs, chunk_size=4)
    lengths = [7, 3]
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    nxt = torch.randn(2, 2, 16, dtype=torch.float64)
    cache = ours.new_cache()
    ours(x, mask=masks.from_lengths(torch.tensor(lengths), 7), cache=cache)
    steps = torch.cat([ours(nxt[:, t : t + 1], cache=cache) for t in range(2)], 1)
    for i, n in enumerate(lengths):
        alone = run_reference(theirs, torch.cat([x[i : i + 1, :n], nxt[i : i + 1]], 1))
        torch.testing.assert_close(steps[i], alone[0, n:], **TOL)


def test_registry_and_constructor_sizes():
    layer = REGISTRY.build("mamba2", embed_dim=12, num_heads=3, state_size=4, n_groups=3)
    assert (layer.head_dim, layer.inner) == (8, 24)  # expand 2 by default
    x = torch.randn(1, 5, 12)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert Mamba2Mixer(12, 3, 4, expand=1).inner == 12
    bf = Mamba2Mixer(8, 2, state_size=4, dtype=torch.bfloat16)
    assert bf(torch.randn(1, 3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_bad_input_is_refused_by_name():
    layer = Mamba2Mixer(8, 2, state_size=4)
    with pytest.raises(ValueError, match=r"x must be \(B, N, embed_dim\) = \(B, N, 8\)"):
        layer(torch.randn(1, 3, 6))
    with pytest.raises(TypeError, match="x must be floating point"):
        layer(torch.ones(1, 3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="mask must be key padding"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(2, 3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="cache must be a MixerCache"):
        layer(torch.randn(1, 3, 8), cache=object())
    cache = layer.new_cache()
    layer(torch.randn(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="belongs to another layer"):
        Mamba2Mixer(8, 2, state_size=4)(torch.randn(1, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="'ssm' state"):
        layer(torch.randn(2, 1, 8), cache=cache)  # another batch size
    with pytest.raises(ValueError, match="must be a multiple of n_groups"):
        Mamba2Mixer(8, 3, 4, n_groups=2)
    with pytest.raises(ValueError, match="must equal expand"):
        Mamba2Mixer(8, 2, 4, expand=2)
    with pytest.raises(ValueError, match="time_step_limit"):
        Mamba2Mixer(8, 2, time_step_limit=(0.5, 0.1))
    with pytest.raises(TypeError, match="transformers Mamba2Mixer"):
        Mamba2Mixer.from_transformers(torch.nn.Linear(2, 2))
    assert isinstance(cache, MixerCache)
