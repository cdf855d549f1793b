"""KimiDeltaAttentionMixer against transformers' KimiLinearDeltaAttention (its torch path) with
the weights copied, in float64: prefill, gradients, padding equal to truncation and cached
decoding (its own and transformers')."""

import pytest
import torch
from mixers.hf_float64 import widened
from transformers import DynamicCache
from transformers.models.kimi_linear import configuration_kimi_linear, modeling_kimi_linear

from attnkit import masks
from attnkit.mixers import REGISTRY, KimiDeltaAttentionMixer

D = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def reference(seed=0, heads=2, head_dim=6, kernel=4):
    """A small transformers KimiLinearDeltaAttention in float64 with every weight perturbed."""
    torch.manual_seed(seed)
    cfg = configuration_kimi_linear.KimiLinearConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        layer_types=["linear_attention"],
        linear_attn_config={
            "head_dim": head_dim,
            "num_heads": heads,
            "short_conv_kernel_size": kernel,
        },
    )
    module = modeling_kimi_linear.KimiLinearDeltaAttention(cfg, 0).double().eval()
    with torch.no_grad():
        # the forget gate's A_log and dt_bias are torch.empty until a model initialises them
        module.forget_gate.A_log.uniform_(1, 16).log_()
        module.forget_gate.dt_bias.uniform_(-4, 1)
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return cfg, module


def run_reference(module, x, **kwargs):
    with widened(modeling_kimi_linear):
        return module(x, **kwargs)


def _x(b, n, seed=1):
    return torch.randn(b, n, 16, generator=torch.Generator().manual_seed(seed), dtype=D)


@pytest.mark.parametrize(
    ("config", "chunk"),
    [({}, 3), ({"heads": 3, "head_dim": 4}, 64), ({"heads": 1, "kernel": 2}, 4)],
)
def test_prefill_equals_transformers(config, chunk):
    _, theirs = reference(**config)
    ours = KimiDeltaAttentionMixer.from_transformers(theirs, chunk_size=chunk)
    x = _x(2, 13)
    expected = run_reference(theirs, x)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(ours(x), expected, **TOL)


def test_prefill_equals_transformers_as_it_is_at_float32_precision():
    """transformers computes the gate, the rule and the norm in float32 whatever the input;
    unwidened it agrees to that precision."""
    _, theirs = reference(seed=1)
    ours = KimiDeltaAttentionMixer.from_transformers(theirs)
    x = _x(2, 9)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


# ours -> theirs
NAMES = {
    "q_proj.weight": "q_proj.weight",
    "k_proj.weight": "k_proj.weight",
    "v_proj.weight": "v_proj.weight",
    "conv.weight": "conv1d.weight",
    "f_a_proj.weight": "forget_gate.f_a_proj.weight",
    "f_b_proj.weight": "forget_gate.f_b_proj.weight",
    "A_log": "forget_gate.A_log",
    "dt_bias": "forget_gate.dt_bias",
    "b_proj.weight": "b_proj.weight",
    "g_a_proj.weight": "g_a_proj.weight",
    "g_b_proj.weight": "g_b_proj.weight",
    "o_norm.weight": "o_norm.weight",
    "o_proj.weight": "o_proj.weight",
}


def test_gradients_equal_transformers():
    _, theirs = reference(seed=2)
    ours = KimiDeltaAttentionMixer.from_transformers(theirs, chunk_size=4)
    x = _x(2, 10, seed=3)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    probe = _x(2, 10, seed=4)
    (ours(x_ours) * probe).sum().backward()
    (run_reference(theirs, x_theirs) * probe).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **TOL)
    mine = dict(ours.named_parameters())
    others = dict(theirs.named_parameters())
    assert set(NAMES) == set(mine) and set(NAMES.values()) == set(others)
    for name, their_name in NAMES.items():
        grad = others[their_name].grad.reshape(mine[name].shape)
        assert mine[name].grad.abs().sum() > 0, name
        torch.testing.assert_close(mine[name].grad, grad, **TOL, msg=name)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_equals_truncation(side):
    _, theirs = reference(seed=3)
    ours = KimiDeltaAttentionMixer.from_transformers(theirs, chunk_size=4)
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
    """transformers zeroes padded inputs: at the real positions of a right- or left-padded
    batch its outputs are those of the truncated sequences as well."""
    _, theirs = reference(seed=4)
    ours = KimiDeltaAttentionMixer.from_transformers(theirs)
    x = _x(2, 9, seed=6)
    keep = masks.from_lengths(torch.tensor([9, 4]), 9)[:, 0]
    if side == "left":
        keep = keep.flip(1)
    mine = ours(x, mask=keep)
    with_mask = run_reference(theirs, x, attention_mask=keep.long())
    torch.testing.assert_close(mine[keep], with_mask[keep], **TOL)


def test_cached_decoding_equals_the_causal_pass_and_transformers_decoding():
    cfg, theirs = reference(seed=5)
    ours = KimiDeltaAttentionMixer.from_transformers(theirs, chunk_size=3)
    x = _x(2, 10, seed=7)
    full = ours(x)
    cache = ours.new_cache()
    steps = [ours(x[:, :4], cache=cache)] + [
        ours(x[:, t : t + 1], cache=cache) for t in range(4, 8)
    ]
    steps.append(ours(x[:, 8:], cache=cache))  # a chunk after single steps
    torch.testing.assert_close(torch.cat(steps, 1), full, **TOL)
    assert len(cache) == 10 and cache.states["delta"].shape == (2, 2, 6, 6)
    hf_cache = DynamicCache(config=cfg)
    hf = [run_reference(theirs, x[:, :4], cache=hf_cache)]
    hf += [run_reference(theirs, x[:, t : t + 1], cache=hf_cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(hf, 1), full, **TOL)
    # the same state, laid out (B, H, d_k, d_v) in both
    torch.testing.assert_close(cache.states["delta"], hf_cache.get_recurrent_state(0), **TOL)


def test_decoding_after_a_padded_prefill_equals_each_sequence_alone():
    _, theirs = reference(seed=6)
    ours = KimiDeltaAttentionMixer.from_transformers(theirs, chunk_size=4)
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
    layer = REGISTRY.build("kda", embed_dim=12, num_heads=2, head_dim=4)
    x = torch.randn(1, 5, 12)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    bf = KimiDeltaAttentionMixer(8, 2, 4, dtype=torch.bfloat16)
    assert bf(torch.randn(1, 3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_bad_input_is_refused_by_name():
    layer = KimiDeltaAttentionMixer(8, 2, 4)
    with pytest.raises(ValueError, match=r"x must be \(B, N, embed_dim\) = \(B, N, 8\)"):
        layer(torch.randn(1, 3, 6))
    with pytest.raises(TypeError, match="x must be floating point"):
        layer(torch.ones(1, 3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="mask must be key padding"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        layer(torch.randn(2, 3, 8), mask=torch.ones(2, 3))
    with pytest.raises(TypeError, match="cache must be a MixerCache"):
        layer(torch.randn(1, 3, 8), cache={})
    cache = layer.new_cache()
    layer(torch.randn(1, 3, 8), cache=cache)
    with pytest.raises(ValueError, match="belongs to another layer"):
        KimiDeltaAttentionMixer(8, 2, 4)(torch.randn(1, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="'delta' state"):
        layer(torch.randn(3, 1, 8), cache=cache)
    with pytest.raises(ValueError, match="head_dim"):
        KimiDeltaAttentionMixer(8, 2, 0)
    with pytest.raises(TypeError, match="KimiLinearDeltaAttention"):
        KimiDeltaAttentionMixer.from_transformers(torch.nn.Linear(2, 2))
    _, theirs = reference()
    theirs.activation = "gelu"
    with pytest.raises(ValueError, match="activation must be 'silu'"):
        KimiDeltaAttentionMixer.from_transformers(theirs)
