"""The package's public names: every module says what it exports, and it exists."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import attnkit

MODULES = sorted(
    info.name
    for info in pkgutil.walk_packages(attnkit.__path__, prefix="attnkit.")
    if not info.name.endswith("__main__")
)


@pytest.mark.parametrize("name", MODULES)
def test_every_module_lists_what_it_exports_and_each_name_exists(name):
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, list | tuple), f"{name} has no __all__"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"


def test_the_package_exports_the_head_part_and_the_core():
    assert {"HeadAttention", "Attention", "attention", "AttentionOutput"} <= set(attnkit.__all__)
    assert attnkit.attention is importlib.import_module("attnkit.core").attention


def test_subpackages_load_on_first_use():
    for name in ("efficient", "linear_family", "modern", "sparse_trainable", "training"):
        assert getattr(attnkit, name) is importlib.import_module(f"attnkit.{name}")
    with pytest.raises(AttributeError, match="no attribute 'efficent'"):
        attnkit.efficent  # noqa: B018
