"""The token-mixer contract's declared cache states: after a prefill and after a decoding step,
each mixer's MixerCache holds exactly the states its class names in ``state_names``, with the
shapes worked out here from the layer's sizes (not read from the layer) and the documented
dtypes (the convolution's inputs in x's dtype, the recurrent state in x's dtype promoted to at
least float32)."""

from __future__ import annotations

import pytest
import torch

from attnkit.mixers import (
    REGISTRY,
    GatedDeltaNetMixer,
    KimiDeltaAttentionMixer,
    LightningAttentionMixer,
    Mamba2Mixer,
    TokenMixer,
)

B = 2


def _mamba2():
    layer = Mamba2Mixer(12, 4, 3, state_size=5, n_groups=2, conv_kernel=3, chunk_size=4)
    # xBC: H·P + 2·G·n = 12 + 20 channels; the SSD state per head: n × P
    return layer, {"conv": (B, 2, 32), "ssm": (B, 4, 5, 3)}


def _gated_deltanet():
    layer = GatedDeltaNetMixer(12, 2, 5, num_v_heads=4, head_v_dim=3, conv_kernel=3, chunk_size=4)
    # [q, k, v]: 2·2·5 + 4·3 channels; the state per value head: d_k × d_v
    return layer, {"conv": (B, 2, 32), "delta": (B, 4, 5, 3)}


def _kda():
    layer = KimiDeltaAttentionMixer(12, 2, 5, conv_kernel=4, chunk_size=4)
    return layer, {"conv": (B, 3, 30), "delta": (B, 2, 5, 5)}


def _lightning():
    layer = LightningAttentionMixer(12, 3, 5, layer_idx=1, num_layers=3, chunk_size=4)
    return layer, {"lightning": (B, 3, 5, 5)}


LAYERS = {
    "mamba2": _mamba2,
    "gated_deltanet": _gated_deltanet,
    "kda": _kda,
    "lightning": _lightning,
}


def _dtypes(x_dtype: torch.dtype) -> dict[str, torch.dtype]:
    work = torch.promote_types(x_dtype, torch.float32)
    return {"conv": x_dtype, "ssm": work, "delta": work, "lightning": work}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(LAYERS))
def test_cache_holds_exactly_the_declared_states(name, dtype):
    torch.manual_seed(0)
    layer, shapes = LAYERS[name]()
    layer = layer.to(dtype)
    assert set(type(layer).state_names) == set(shapes)
    assert layer.state_shapes(B) == shapes
    x = torch.randn(B, 7, 12, dtype=dtype)
    cache = layer.new_cache()
    assert cache.states == {}
    for part in (x[:, :6], x[:, 6:]):  # a prefill of 6 positions, then one decoding step
        layer(part, cache=cache)
        assert set(cache.states) == set(shapes)
        for state, tensor in cache.states.items():
            assert tuple(tensor.shape) == shapes[state], (state, tensor.shape)
            assert tensor.dtype == _dtypes(dtype)[state], (state, tensor.dtype)
            assert tensor.abs().max() > 0  # written, not the zeros of an empty start
    assert len(cache) == 7


def test_a_padded_prefill_keeps_the_same_states():
    layer, shapes = _gated_deltanet()
    keep = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    cache = layer.new_cache()
    layer(torch.randn(B, 5, 12), mask=keep, cache=cache)
    assert {k: tuple(v.shape) for k, v in cache.states.items()} == shapes


@pytest.mark.parametrize("name", sorted(REGISTRY.available()))
def test_every_registered_mixer_declares_and_documents_its_states(name):
    cls = REGISTRY.get(name)
    assert issubclass(cls, TokenMixer)
    assert cls.state_names, f"{cls.__name__} declares no states"
    assert cls.state_shapes is not TokenMixer.state_shapes
    for state, text in cls.state_names.items():
        assert text.startswith("(B, "), (state, text)  # the shape first
        assert f'``"{state}"``' in cls.__doc__, f"{cls.__name__}'s docstring lacks {state!r}"


def test_state_shapes_refuse_a_bad_batch():
    for make in LAYERS.values():
        layer, _ = make()
        with pytest.raises(ValueError, match="batch"):
            layer.state_shapes(0)
