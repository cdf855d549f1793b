"""The mechanism registry: loud, complete (every public mechanism class in the mechanism packages
is registered, found by walking the packages, so the registry cannot go stale), and each
registered class gives the suite what it needs (``example``, ``mask_inputs``)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from torch import nn

import attnkit as ak
from attnkit import mechanisms
from attnkit.efficient.feature_maps import EluPlusOne, ReLUFeatures
from attnkit.efficient.kernelized import KernelNormalized
from attnkit.efficient.landmarks import GaussianKernel, LandmarkAttention
from attnkit.efficient.resa import ReinforcedSequenceSampler
from attnkit.efficient.synthesizer import (
    DenseSynthetic,
    DotProductLogits,
    FactorizedDenseSynthetic,
    FactorizedRandomSynthetic,
    RandomSynthetic,
)
from attnkit.features.aggregation import LinearAggregation, NestedPerceptronAggregation
from attnkit.linear_family import LinearFamilyPart, UnnormalizedWeights
from attnkit.modern.sinks import SinkSoftmax
from attnkit.queries.query_types import QueryTagged
from attnkit.sparse_trainable import BlockCompression, LightningIndexer, MeanCompression
from attnkit.sparse_trainable.deepseek_v32 import LatentIndexer, SparseLatentAttention

# Public nn.Module classes in the mechanism packages that are not mechanisms, and why.
NOT_MECHANISMS = {
    ReinforcedSequenceSampler: "the token sampler inside reinforced self-attention (registered "
    "'resa'); it selects tokens and attends nothing",
    QueryTagged: "a taxonomy tag around any module; its calls pass through unchanged",
    KernelNormalized: "an alignment (kernel values normalised over keys), a part of the kernelized "
    "mechanisms, which are registered",
    GaussianKernel: "an alignment (the unnormalised Gaussian kernel), a part of SOFT and "
    "Skyformer, which are registered",
    LandmarkAttention: "the base of the landmark mechanisms (Nyströmformer, SOFT, Skyformer), "
    "which are registered",
    SinkSoftmax: "an alignment (softmax with a sink logit per head), a part of the registered "
    "sink attention",
    LinearFamilyPart: "the base of the gated linear-attention parts, which are registered",
    UnnormalizedWeights: "an alignment (the unnormalised decayed scores), a part of the gated "
    "linear-attention parts, which are registered",
    EluPlusOne: "a feature map for linear attention, chosen by name through FEATURE_MAPS",
    ReLUFeatures: "a feature map for linear attention, chosen by name through FEATURE_MAPS",
    BlockCompression: "NSA's block compression φ, a part of the registered native_sparse",
    MeanCompression: "NSA's parameter-free block compression, a part of native_sparse",
    LightningIndexer: "DSA's index scores, a part of the registered deepseek_sparse",
    LatentIndexer: "DeepSeek-V3.2's released indexer, a part of SparseLatentAttention",
    SparseLatentAttention: "DeepSeek-V3.2's released layer, built from transformers' module "
    "(from_transformers); the per-head DSA part is registered as deepseek_sparse",
    LinearAggregation: "an aggregation of the affinity matrix, a part of parallel co-attention",
    NestedPerceptronAggregation: "an aggregation of the affinity matrix, a part of parallel "
    "co-attention",
    **dict.fromkeys(
        (
            DenseSynthetic,
            DotProductLogits,
            FactorizedDenseSynthetic,
            FactorizedRandomSynthetic,
            RandomSynthetic,
        ),
        "logits for the registered synthesizer mechanism, which mixes them",
    ),
}


def _public_module_classes() -> list[type]:
    """Every public nn.Module subclass defined in a module of ``mechanisms.PACKAGES``."""
    found = []
    for package_name in mechanisms.PACKAGES:
        package = importlib.import_module(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + "."):
            module = importlib.import_module(info.name)
            for name, obj in vars(module).items():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, nn.Module)
                    and obj.__module__ == module.__name__
                    and not name.startswith("_")
                ):
                    found.append(obj)
    return found


def test_every_public_mechanism_class_is_registered():
    registered = {mechanisms.REGISTRY.get(name) for name in mechanisms.available()}
    classes = _public_module_classes()
    assert len(classes) >= 15  # the walk finds the packages' classes
    unregistered = [c.__qualname__ for c in classes if c not in registered | NOT_MECHANISMS.keys()]
    assert not unregistered, (
        f"register these mechanisms (or list them in NOT_MECHANISMS): {unregistered}"
    )
    assert not NOT_MECHANISMS.keys() & registered


def test_the_walk_finds_a_new_unregistered_class(monkeypatch):
    """The completeness check above fails for a mechanism that someone forgot to register."""
    from attnkit.queries import multihop

    class Forgotten(nn.Module):
        pass

    Forgotten.__module__ = multihop.__name__
    monkeypatch.setattr(multihop, "Forgotten", Forgotten, raising=False)
    registered = {mechanisms.REGISTRY.get(name) for name in mechanisms.available()}
    assert Forgotten in _public_module_classes() and Forgotten not in registered


def test_available_is_sorted_and_names_the_survey_mechanisms():
    names = mechanisms.available()
    assert names == sorted(names) == ak.mechanisms.available()
    assert {"parallel_co_attention", "rotatory", "hierarchical", "capsule", "multi_hop"} <= set(
        names
    )


def test_registry_is_loud():
    with pytest.raises(ValueError, match=r"unknown mechanism 'capsul'; did you mean 'capsule'"):
        mechanisms.build("capsul")
    with pytest.raises(TypeError, match=r"mechanism 'capsule' got an unexpected argument 'd'"):
        mechanisms.build("capsule", d=4, n_classes=3)
    with pytest.raises(TypeError, match=r"mechanism 'capsule'.*missing.*'n_classes'"):
        mechanisms.build("capsule", d_f=4)
    with pytest.raises(ValueError, match=r"mechanism 'capsule' is already registered"):
        mechanisms.REGISTRY.register("capsule")(type("Other", (), {}))
    assert isinstance(mechanisms.build("capsule", d_f=4, n_classes=3), ak.queries.CapsuleAttention)


@pytest.mark.parametrize("name", mechanisms.available())
def test_example_is_a_fresh_instance_of_the_registered_class(name):
    cls = mechanisms.REGISTRY.get(name)
    module, args, kwargs = mechanisms.example(name)
    again, _, _ = mechanisms.example(name)
    assert type(module) is cls and module is not again
    assert isinstance(args, tuple) and isinstance(kwargs, dict)
    inspect.signature(module.forward).bind(*args, **kwargs)


@pytest.mark.parametrize("name", mechanisms.available())
def test_mask_inputs_name_every_mask_argument(name):
    """A mask the suite does not know of would escape mask == truncation."""
    cls = mechanisms.REGISTRY.get(name)
    params = inspect.signature(cls.forward).parameters
    # a block mask is a sparsity pattern over (query, key) tiles, not padding of an input
    assert set(cls.mask_inputs) == {p for p in params if "mask" in p and p != "block_mask"}
    for covered in cls.mask_inputs.values():
        assert covered and set(covered) <= set(params)


def test_example_tensor_is_reproducible():
    a, b = mechanisms.example_tensor(2, 3, seed=4), mechanisms.example_tensor(2, 3, seed=4)
    assert a.shape == (2, 3) and (a == b).all()
    assert not (a == mechanisms.example_tensor(2, 3, seed=5)).all()


def test_example_fails_loudly_for_a_mechanism_without_a_proper_one():
    table = mechanisms.REGISTRY.snapshot()
    try:

        @mechanisms.REGISTRY.register("no_example")
        class NoExample(nn.Module):
            pass

        @mechanisms.REGISTRY.register("bad_example")
        class BadExample(nn.Module):
            @classmethod
            def example(cls):
                return nn.Identity(), (), {}

        with pytest.raises(TypeError, match=r"'no_example' \(.*NoExample\) has no example\(\)"):
            mechanisms.example("no_example")
        with pytest.raises(TypeError, match=r"'bad_example'.*module a .*BadExample"):
            mechanisms.example("bad_example")
    finally:
        mechanisms.REGISTRY.restore(table)
    assert "no_example" not in mechanisms.available()
