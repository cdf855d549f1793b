"""The per-head part registry (:mod:`attnkit.head_registry`): loud like every registry, its
parts built by name and by example, and the mechanism registry delegating to it so that every
name it took before still works there."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import head_registry, mechanisms
from attnkit.registry import Registry


@pytest.fixture
def registries():
    """Every registry as it was before the test (a test may register parts)."""
    head_registry.available(), mechanisms.available()  # loaded before the snapshot
    saved = [(r, r.snapshot()) for r in list(Registry.instances)]
    yield
    for registry, table in saved:
        registry.restore(table)


class ReLUPart(ak.HeadAttention):
    """w_ij = relu(q_i·k_j): key masks and attend(), nothing else."""

    mask_forms = frozenset({"key"})

    def attend(self, q, k, v, *, mask, bias, need_weights):
        w = torch.relu(q @ k.transpose(-1, -2))
        return ak.AttentionOutput(w @ v if mask is None else (w * mask) @ v, w)


def test_every_registered_part_is_a_head_attention_and_no_mechanism_is_one():
    names = head_registry.available()
    assert names == sorted(names) and {"performer", "gla", "lsh", "moba"} <= set(names)
    assert all(issubclass(head_registry.REGISTRY.get(n), ak.HeadAttention) for n in names)
    own = mechanisms.REGISTRY.own()
    assert not set(own) & set(names)
    assert not any(issubclass(mechanisms.REGISTRY.get(n), ak.HeadAttention) for n in own)
    assert {"capsule", "multi_hop"} <= set(own)


def test_build_and_example_by_name():
    part = head_registry.build("performer", head_dim=8, n_features=16)
    assert type(part) is ak.efficient.Performer and part.head_dim == 8
    module, (q, k, v), kwargs = head_registry.example("gla")
    assert type(module) is ak.linear_family.GatedLinearAttention
    assert module(q, k, v, **kwargs).context.shape == (*q.shape[:-1], v.shape[-1])


def test_the_registry_is_loud():
    with pytest.raises(ValueError, match=r"unknown per-head part 'perfomer'; did you mean"):
        head_registry.build("perfomer")
    with pytest.raises(TypeError, match=r"per-head part 'performer' got an unexpected argument"):
        head_registry.build("performer", head_dim=8, n_feature=16)
    with pytest.raises(ValueError, match="per-head part 'performer' is already registered"):
        head_registry.REGISTRY.register("performer")(ReLUPart)


def test_a_part_registered_in_one_file_is_listed_built_and_run_by_name(registries):
    head_registry.REGISTRY.register("relu_part")(ReLUPart)
    assert "relu_part" in head_registry.available()
    assert "relu_part" in ak.tasks.parts.slot_mechanisms()
    module, args, kwargs = head_registry.example("relu_part")
    assert type(module) is ReLUPart and kwargs["mask"].shape == (2, 2, 1, 7)
    assert module(*args, **kwargs).context.shape == (2, 2, 7, 4)
    built = ak.tasks.parts.build_slot_attention("relu_part", head_dim=4, num_heads=2, max_len=8)
    mha = ak.MultiHeadAttention(8, 2, attention=built)
    assert mha(torch.randn(2, 5, 8)).context.shape == (2, 5, 8)


def test_the_mechanism_registry_still_takes_every_per_head_name():
    """Names built as mechanisms before per-head parts had their own registry: listed,
    resolved, built and exemplified there as before."""
    assert set(head_registry.available()) <= set(mechanisms.available())
    assert mechanisms.REGISTRY.get("performer") is ak.efficient.Performer
    assert type(mechanisms.build("gla", head_dim=4, num_heads=2)).__name__ == (
        "GatedLinearAttention"
    )
    module, args, kwargs = mechanisms.example("performer")
    assert type(module) is ak.efficient.Performer and module(*args, **kwargs).context.shape
    with pytest.raises(ValueError, match=r"unknown mechanism 'perfomer'; did you mean 'performer'"):
        mechanisms.build("perfomer")


def test_a_per_head_part_registered_as_a_mechanism_goes_to_its_own_registry(registries):
    with pytest.warns(DeprecationWarning, match=r"attnkit.head_registry.REGISTRY.register"):
        mechanisms.REGISTRY.register("relu_mechanism")(ReLUPart)
    assert head_registry.REGISTRY.get("relu_mechanism") is ReLUPart
    assert "relu_mechanism" not in mechanisms.REGISTRY.own()
    assert mechanisms.REGISTRY.get("relu_mechanism") is ReLUPart
