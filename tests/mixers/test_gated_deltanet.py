"""GatedDeltaNetMixer against transformers' Qwen3NextGatedDeltaNet (its torch path) with the
weights copied, in float64: prefill, gradients, padding equal to truncation and cached decoding
(its own and transformers')."""

import pytest
import torch
from mixers.hf_float64 import widened
from transformers import DynamicCache, Qwen3NextConfig
from transformers.models.qwen3_next import modeling_qwen3_next

from attnkit import masks
from attnkit.mixers import REGISTRY, GatedDeltaNetMixer

TOL = {"rtol": 1e-10, "atol": 1e-10}


def reference(seed=0, **config):
    """A small transformers Qwen3NextGatedDeltaNet in float64 with every weight perturbed."""
    torch.manual_seed(seed)
    sizes = {
        "hidden_size": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 6,
        "linear_value_head_dim": 5,
        "linear_conv_kernel_dim": 4,
        "num_hidden_layers": 1,
        "layer_types": ["linear_attention"],
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    cfg = Qwen3NextConfig(**(sizes | config))
    module = modeling_qwen3_next.Qwen3NextGatedDeltaNet(cfg, 0).double().eval()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return cfg, module


def run_reference(module, x, **kwargs):
    with widened(modeling_qwen3_next):
        return module(x, **kwargs)


@pytest.mark.parametrize(
    ("config", "chunk"),
    [
        ({}, 3),
        ({"linear_num_value_heads": 2, "linear_value_head_dim": 6}, 64),
        ({"linear_num_key_heads": 1, "linear_conv_kernel_dim": 2}, 4),
    ],
)
def test_prefill_equals_transformers(config, chunk):
    _, theirs = reference(**config)
    ours = GatedDeltaNetMixer.from_transformers(theirs, chunk_size=chunk)
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), run_reference(theirs, x), **TOL)


def test_prefill_equals_transformers_as_it_is_at_float32_precision():
    """transformers computes the rule and the norm in float32 whatever the input; unwidened it
    agrees to that precision."""
    _, theirs = reference(seed=1)
    ours = GatedDeltaNetMixer.from_transformers(theirs)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def _their_rows(module):
    """For each row of our in_proj_qkvz (blocks q, k, v, z, head-major) and in_proj_ba (b, a),
    the row of transformers' interleaved projection it comes from, by index arithmetic."""
    hk, dk, dv = module.num_k_heads, module.head_k_dim, module.head_v_dim
    r = module.num_v_heads // hk
    per_group = 2 * dk + 2 * r * dv
    qkvz = []
    for offset, size in ((0, dk), (dk, dk), (2 * dk, r * dv), (2 * dk + r * dv, r * dv)):
        qkvz += [g * per_group + offset + i for g in range(hk) for i in range(size)]
    ba = [g * 2 * r + offset + i for offset in (0, r) for g in range(hk) for i in range(r)]
    return torch.tensor(qkvz), torch.tensor(ba)


def test_gradients_equal_transformers():
    _, theirs = reference(seed=2)
    ours = GatedDeltaNetMixer.from_transformers(theirs, chunk_size=4)
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    probe = torch.randn(2, 10, 16, dtype=torch.float64)
    (ours(x_ours) * probe).sum().backward()
    (run_reference(theirs, x_theirs) * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL)
    qkvz, ba = _their_rows(theirs)
    expected = {
        "in_proj_qkvz.weight": theirs.in_proj_qkvz.weight.grad[qkvz],
        "in_proj_ba.weight": theirs.in_proj_ba.weight.grad[ba],
        "conv.weight": theirs.conv1d.weight.grad,
        "dt_bias": theirs.dt_bias.grad,
        "A_log": theirs.A_log.grad,
        "norm.weight": theirs.norm.weight.grad,
        "out_proj.weight": theirs.out_proj.weight.grad,
    }
    mine = dict(ours.named_parameters())
    assert set(expected) == set(mine)
    for name, grad in expected.items():
        assert mine[name].grad.abs().sum() > 0, name
        torch.testing.assert_close(mine[name].grad, grad, **TOL, msg=name)
    # the copied weights themselves, by the same index arithmetic
    torch.testing.assert_close(ours.in_proj_qkvz.weight, theirs.in_proj_qkvz.weight[qkvz])
    torch.testing.assert_close(ours.in_proj_ba.weight, theirs.in_proj_ba.weight[ba])


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_equals_truncation(side):
    _, theirs = reference(seed=3)
    ours = GatedDeltaNetMixer.from_transformers(theirs, chunk_size=4)
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
    are those of the truncated sequences as well (its state is what differs)."""
    _, theirs = reference(seed=4)
    ours = GatedDeltaNetMixer.from_transformers(theirs)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    keep = masks.from_lengths(torch.tensor([9, 4]), 9)[:, 0]
    mine = ours(x, mask=keep)
    with_mask = run_reference(theirs, x, attention_mask=keep.long())
    torch.testing.assert_close(mine[keep], with_mask[keep], **TOL)


def test_cached_decoding_equals_the_causal_pass_and_transformers_decoding():
    cfg, theirs = reference(seed=5)
    ours = GatedDeltaNetMixer.from_transformers(theirs, chunk_size=3)
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
    # the same state, laid out (B, H_v, d_k, d_v) in both
    torch.testing.assert_close(cache.states["delta"], hf_cache.get_recurrent_state(0), **TOL)


def test_decoding_after_a_padded_prefill_equals_each_sequence_alone():
    _, theirs = reference(seed=6)
    ours = GatedDeltaNetMixer.from_transformers(theirs, chunk_size=4)
    lengths = [7, 3]
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    nxt = torch.randn(2, 2, 16, dtype=torch.float64)
    cache = ours.new_cache()
    ours(x, mask=masks.from_lengths(torch.tensor(lengths), 7), cache=cache)
    steps = torch.cat([ours(nxt[:, t : t + 1], cache=cache) for t in range(2)], 1)
    for i, n in enumerate(lengths):
        alone = run_reference(theirs, torch.cat([x[i : i + 1, :n], nxt[i : i + 1]], 1))
        torch.testing.assert_close(steps[i], alone[0, n:], **TOL)


def test_registry_and_dtypes():
    layer = REGISTRY.build("gated_deltanet", embed_dim=12, num_heads=2, head_dim=4, num_v_heads=4)
    assert (layer.key_dim, layer.value_dim) == (8, 16)
    x = torch.randn(1, 5, 12)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    bf = GatedDeltaNetMixer(8, 2, 4, dtype=torch.bfloat16)
    assert bf(torch.randn(1, 3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_bad_input_is_refused_by_name():
    layer = GatedDeltaNetMixer(8, 2, 4)
    with pytest.raises(ValueError, match=r"x must be \(B, N, embed_dim\) = \(B, N, 8\)"):
        layer(torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match="mask must be key padding"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(2, 3))
    cache = layer.new_cache()
    layer(torch.randn(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="belongs to another layer"):
        GatedDeltaNetMixer(8, 2, 4)(torch.randn(1, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="'delta' state"):
        layer(torch.randn(3, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="num_v_heads 3 must be a multiple of num_heads 2"):
        GatedDeltaNetMixer(8, 2, 4, num_v_heads=3)
    with pytest.raises(TypeError, match="Qwen3NextGatedDeltaNet"):
        GatedDeltaNetMixer.from_transformers(torch.nn.Linear(2, 2))
