"""Registries fail loudly (DESIGN 2)."""

import pytest

import attnkit as ak
from attnkit.registry import Registry


def test_available_lists_every_part():
    assert "additive" in ak.scores.available() and "scaled_dot" in ak.scores.available()
    assert "entmax15" in ak.alignments.available()


def test_build_constructs_with_arguments():
    s = ak.scores.build("additive", d_q=8, d_k=6, d_w=16)
    assert isinstance(s, ak.scores.Additive) and s.d_w == 16
    a = ak.alignments.build("local", window=2)
    assert isinstance(a, ak.alignments.Local) and a.window == 2


def test_registering_a_different_class_under_a_taken_name_fails():
    reg = Registry("thing")

    @reg.register("x")
    class A:
        pass

    with pytest.raises(ValueError, match=r"thing 'x' is already registered.*override=True"):

        @reg.register("x")
        class B:
            pass

    assert reg.get("x") is A


def test_registering_the_same_definition_again_is_silent():
    reg = Registry("thing")
    source = "class Part:\n    pass\n"

    def execute() -> type:  # a notebook cell run twice: a new class, same module and name
        namespace = {"__name__": "notebook"}
        exec(source, namespace)
        return namespace["Part"]

    first, second = execute(), execute()
    assert first is not second
    reg.register("part")(first)
    reg.register("part")(first)  # the same class object
    assert reg.get("part") is first
    reg.register("part")(second)  # the cell executed again
    assert reg.get("part") is second and second.registered_name == "part"
    other = type("Part", (), {"__module__": "elsewhere"})  # same name, another module
    with pytest.raises(ValueError, match="already registered"):
        reg.register("part")(other)


def test_override_replaces_a_different_class():
    reg = Registry("thing")
    reg.register("x")(type("A", (), {}))
    b = reg.register("x", override=True)(type("B", (), {}))
    assert reg.get("x") is b


def test_unknown_name_lists_options_and_the_closest():
    with pytest.raises(ValueError, match=r"did you mean 'cosine'\?.*Available: .*additive"):
        ak.scores.build("cosin")
    with pytest.raises(ValueError, match=r"^unknown score 'zzz'\. Available: activated_general"):
        ak.scores.build("zzz")  # nothing close: a full stop, then the names


def test_unknown_and_missing_arguments():
    with pytest.raises(TypeError, match="d_w"):
        ak.scores.build("additive", d_q=1, d_k=1)
    with pytest.raises(TypeError, match="widow"):
        ak.alignments.build("local", widow=3)


def test_non_string_name():
    with pytest.raises(TypeError, match="name must be a str"):
        ak.scores.build(3)


def test_a_renamed_part_names_its_new_name():
    reg = Registry("thing")
    reg.register("new_name")(type("A", (), {}))
    reg.renamed["old-name"] = "new_name"
    with pytest.raises(ValueError, match=r"thing 'old-name' is now 'new_name'"):
        reg.get("old-name")
    with pytest.raises(ValueError, match="is now 'draw_read'"):
        ak.mechanisms.REGISTRY.build("draw-read", hidden_size=4, height=5, width=5, glimpse=2)
    assert ak.mechanisms.REGISTRY.get("draw_read") is ak.vision.DRAWRead


def test_build_names_the_new_spelling_of_a_renamed_keyword():
    reg = Registry("thing")

    @reg.register("layer")
    @ak.arguments.renamed(heads="num_heads")
    class Layer:
        def __init__(self, num_heads: int) -> None:
            self.num_heads = num_heads

    with pytest.raises(TypeError, match=r"thing 'layer': `heads` is now `num_heads`"):
        reg.build("layer", heads=2)
    assert reg.build("layer", num_heads=2).num_heads == 2


def test_part_names_are_snake_case():
    import re

    import attnkit.vision  # noqa: F401  (registers its parts)
    from attnkit.kernels.base import REGISTRY as kernels
    from attnkit.positions.base import REGISTRY as positions

    pattern = re.compile(r"[a-z][a-z0-9_]*")
    # task names are command-line words (kv-recall) and keep their hyphens
    part_registries = [ak.scores.REGISTRY, ak.alignments.REGISTRY, ak.mechanisms.REGISTRY]
    part_registries += [positions, kernels]
    assert "draw_read" in ak.mechanisms.REGISTRY.available()
    for registry in part_registries:
        bad = [name for name in registry.available() if not pattern.fullmatch(name)]
        assert not bad, f"{registry.kind} names not in snake_case: {bad}"


def test_a_lazy_registry_finds_a_part_of_an_unloaded_package_by_name(monkeypatch):
    """get() before available(): the registry imports its packages, so a part of a subpackage
    not imported yet is found, not reported unknown."""
    reg = Registry("widget", packages=("attnkit.linear_family",))
    calls = []
    monkeypatch.setattr("importlib.import_module", lambda name: calls.append(name))
    with pytest.raises(ValueError, match="unknown widget 'gla'"):
        reg.get("gla")  # the (stubbed) import registered nothing
    assert calls == ["attnkit.linear_family"]
    reg.available()
    assert calls == ["attnkit.linear_family"]  # once only


def test_the_mechanism_registry_loads_its_subpackages_on_get():
    import subprocess
    import sys

    code = (
        "import attnkit as ak; "
        "print(ak.mechanisms.REGISTRY.get('gla').__name__, "
        "ak.mechanisms.REGISTRY.get('deepseek_sparse').__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["GatedLinearAttention", "DeepSeekSparseAttention"]
