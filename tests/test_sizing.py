"""Building parts at given sizes: the shared builder, and every registered score, alignment and
position scheme through its class's for_heads / example / examples."""

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit import sizing
from attnkit.sizing import Sized, Sizes

REGISTRIES = {"score": ak.scores, "alignment": ak.alignments, "position": ak.positions}
EVERY = [
    (kind, name) for kind, package in REGISTRIES.items() for name in package.available()
]  # fmt: skip


class Table(Sized, nn.Module):
    """A part with a size table, an optional size, and a required non-size argument."""

    part_kind = "table"
    size_arguments = {"d": "head_dim", "rows": "max_len", "num_heads": "num_heads"}  # noqa: RUF012

    def __init__(self, d, kind, *, rows=7, num_heads=None, device=None, dtype=None):
        super().__init__()
        self.d, self.kind, self.rows, self.num_heads = d, kind, rows, num_heads
        self.weight = nn.Parameter(torch.zeros(rows, d, device=device, dtype=dtype))


class Plain(Sized, nn.Module):
    """A part without a constructor of its own, with a buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("one", torch.ones(2))


def test_sizes_fill_the_declared_arguments_and_overrides_replace_them():
    part = Table.for_heads(4, 2, max_len=9, kind="a")
    assert (part.d, part.rows, part.num_heads, part.kind) == (4, 9, 2, "a")
    # a size not given leaves its argument at the default
    assert Table.for_heads(head_dim=4, kind="a").rows == 7
    assert Table.for_heads(head_dim=4, max_len=9, kind="a", rows=3).rows == 3
    built = Table.for_heads(4, kind="a", dtype=torch.float64)
    assert built.weight.dtype == torch.float64


def test_what_the_sizes_cannot_give_is_refused_by_name():
    with pytest.raises(TypeError, match="table 'Table' needs the argument 'kind'"):
        Table.for_heads(4)
    with pytest.raises(TypeError, match="unexpected argument 'width'; it takes: d, kind"):
        Table.for_heads(4, kind="a", width=3)
    with pytest.raises(TypeError, match="unexpected argument 'd'; it takes: no arguments"):
        Plain.for_heads(4, d=3)
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        Table.for_heads(0, kind="a")
    with pytest.raises(ValueError, match="max_len must be a positive int or None, got -1"):
        Table.for_heads(4, max_len=-1, kind="a")


def test_a_required_size_that_is_missing_is_named():
    class NeedsRows(Table):
        def __init__(self, d, rows):
            super().__init__(d, "b", rows=rows)

    with pytest.raises(TypeError, match=r"needs max_len \(its argument 'rows'\).*max_len="):
        NeedsRows.for_heads(4)
    assert NeedsRows.for_heads(4, max_len=5).rows == 5


def test_device_and_dtype_move_a_part_whose_constructor_does_not_take_them():
    assert Plain.for_heads(4, dtype=torch.float64).one.dtype == torch.float64
    assert Plain.for_heads(4, device=None, dtype=None).one.dtype == torch.float32


def test_example_sizes():
    assert sizing.example_sizes(max_len=40) == Sizes(head_dim=4, max_len=40, value_dim=3)
    with pytest.raises(TypeError, match="unknown size 'd_q'"):
        sizing.example_sizes(d_q=3)
    with pytest.raises(TypeError, match="needs the argument 'kind'"):
        Table.example()  # the default example is for_heads at the example sizes

    class Kinded(Table):
        def __init__(self, d, *, rows=7, num_heads=None):
            super().__init__(d, "k", rows=rows, num_heads=num_heads)

    example = Kinded.example()
    assert (example.d, example.rows, example.num_heads) == (4, 16, None)
    example = Kinded.example(max_len=12, num_heads=2, head_dim=3)
    assert (example.d, example.rows, example.num_heads) == (3, 12, 2)
    assert list(Kinded.examples()) == [""]


def _config(module: nn.Module) -> str:
    """What a module was built with: its repr, public attributes and parameter shapes."""
    attributes = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
    return f"{module!r} {attributes} {shapes}"


@pytest.mark.parametrize(("kind", "name"), EVERY)
def test_every_registered_part_has_examples_its_example_first(kind, name):
    cls = REGISTRIES[kind].REGISTRY.get(name)
    examples = cls.examples()
    assert "" in examples and all(isinstance(e, cls) for e in examples.values())
    assert _config(cls.example()) == _config(examples[""])
    assert len(set(map(_config, examples.values()))) == len(examples)  # variants differ


@pytest.mark.parametrize("name", ak.scores.available())
def test_every_score_is_built_by_keyword_or_position_and_per_head(name):
    cls = ak.scores.REGISTRY.get(name)
    by_keyword = cls.for_heads(head_dim=6, num_heads=2, embed_dim=12, max_len=9)
    by_position = cls.for_heads(6, 2, max_len=9)
    assert repr(by_keyword) == repr(by_position)
    sizes = {key: p.shape for key, p in by_keyword.named_parameters()}
    assert sizes == {key: p.shape for key, p in by_position.named_parameters()}
    if sizes:  # one parameter set per head: the head dim leads every parameter but scalars
        assert by_keyword.num_heads == 2
    q, k = torch.randn(1, 2, 3, 6), torch.randn(1, 2, 5, 6)
    assert by_keyword(q, k).shape == (1, 2, 3, 5)


@pytest.mark.parametrize("name", ak.alignments.available())
def test_every_alignment_is_built_for_the_query_size(name):
    cls = ak.alignments.REGISTRY.get(name)
    align = cls.for_heads(6, max_len=9)
    scores, query = torch.randn(2, 3, 5), torch.randn(2, 3, 6)
    assert align(scores, query=query).weights.shape == (2, 3, 5)


@pytest.mark.parametrize("name", ["performer", "lsh", "routing", "sinkhorn", "rfa"])
def test_for_heads_takes_an_override_under_a_deprecated_name_as_the_registry_does(name):
    """``d=`` (renamed ``head_dim=``) given to ``for_heads`` replaces the size the layer gives,
    with the class's DeprecationWarning, as ``build(name, d=...)`` does; given with
    ``head_dim=`` too it is refused naming both."""
    cls = ak.head_registry.REGISTRY.get(name)
    sizes = {"embed_dim": 8, "num_heads": 2, "head_dim": 4, "max_len": 8}
    with pytest.warns(DeprecationWarning, match=r"d= is renamed head_dim="):
        part = cls.for_heads(**sizes, d=6)
    assert part.head_dim == 6
    with pytest.warns(DeprecationWarning, match=r"d= is renamed head_dim="):
        assert ak.head_registry.build(name, d=6).head_dim == 6
    with pytest.raises(TypeError, match=r"got both `d` and `head_dim`; .* pass only `head_dim`"):
        sizing.build(cls, Sizes(**sizes), {"d": 6, "head_dim": 5})
    with pytest.raises(TypeError, match=r"got an unexpected argument 'dd'"):
        cls.for_heads(**sizes, dd=6)
