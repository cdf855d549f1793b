"""The per-layer plan of a stack: patterns, lists and their repetition, the names a layer may
have, and the refusals that name what was seen and what is offered."""

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit import layer_plan as lp
from attnkit.mixers import MixerCache, TokenMixer


class _Mean(TokenMixer):
    """A token mixer: the running mean of a projection of the real positions so far."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.v = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, *, mask=None, cache: MixerCache | None = None):
        return self.v(x).cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]


def _kinds(plan):
    return [(e.kind, e.name) for e in plan]


def test_an_int_is_that_many_full_layers():
    assert _kinds(lp.parse(3)) == [("full", "full")] * 3
    assert lp.parse(2, num_layers=2) == lp.parse(2)


def test_a_pattern_counts_its_groups_and_repeats_to_fill_num_layers():
    plan = lp.parse("3 gated_deltanet : 1 full")
    assert _kinds(plan) == [("part", "gated_deltanet")] * 3 + [("full", "full")]
    twelve = lp.parse("3 gated_deltanet:1 full", num_layers=12)
    assert _kinds(twelve) == _kinds(plan) * 3
    # a count of 1 may be left out; sliding:W keeps its colon
    gemma = lp.parse("5 sliding:512 : full")
    assert [(e.kind, e.window) for e in gemma] == [("sliding", 512)] * 5 + [("full", None)]
    assert _kinds(lp.parse("sliding:4:full")) == [("sliding", "sliding:4"), ("full", "full")]
    assert lp.describe(twelve) == " : ".join(["3 gated_deltanet : 1 full"] * 3)


def test_a_list_has_one_entry_per_layer_and_repeats_too():
    made = []

    def factory(embed_dim, num_heads, head_dim):
        made.append((embed_dim, num_heads, head_dim))
        return _Mean(embed_dim)

    plan = lp.parse(["retention", factory, "sliding:3"], num_layers=6)
    assert [e.kind for e in plan] == ["part", "module", "sliding"] * 2
    stack = ak.TransformerEncoder(plan_list := ["full", factory], 8, 2, num_layers=4)
    assert made == [(8, 2, 4), (8, 2, 4)]  # once per layer it fills: no shared parameters
    assert stack.layers[1].mixer is not stack.layers[3].mixer
    assert [e.kind for e in stack.plan] == ["full", "module"] * 2 and len(plan_list) == 2


def test_a_period_that_does_not_divide_num_layers_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"num_layers = 10 is not a multiple of the 4 layers of "):
        lp.parse("3 gated_deltanet : 1 full", num_layers=10)
    with pytest.raises(ValueError, match=r"num_layers = 3 repeats a pattern; with layers = 2"):
        lp.parse(2, num_layers=3)


@pytest.mark.parametrize(
    ("layers", "message"),
    [
        ("3 gated_deltanett : 1 full", r"unknown layer 'gated_deltanett'; did you mean "),
        ("2 ful", r"unknown layer 'ful'.*a layer is one of: full, sliding:W, .*gated_deltanet"),
        ("2 full :: 1 gla", r"an empty group is not COUNT NAME"),
        ("2 full : 3 4 gla", r"group '3 4 gla' is not COUNT NAME"),
        ("0 full", r"group '0 full' has a count of 0"),
        ("2 sliding : 1 full", r"'sliding' is not a sliding window; write sliding:W"),
        ("sliding:0", r"'sliding:0' is not a sliding window"),
        ("", r"an empty group"),
        ([], r"the plan holds no layer"),
        (["full", "2 full"], r"layers\[1\]: unknown layer '2 full'"),
        ("mixer.retention", r"unknown layer 'mixer.retention'"),
        ("part.dot", r"unknown layer 'part.dot'"),
    ],
)
def test_bad_plans_are_refused_with_the_options(layers, message):
    with pytest.raises(ValueError, match=message):
        lp.parse(layers)


def test_wrong_types_are_refused():
    with pytest.raises(ValueError, match=r"layers must be a positive int, got 2.0, or a plan"):
        lp.parse(2.0)
    with pytest.raises(ValueError, match="got True"):
        lp.parse(True)
    with pytest.raises(ValueError, match="got -1"):
        lp.parse(-1)
    with pytest.raises(TypeError, match=r"layers\[1\] must be a layer name .* got int"):
        lp.parse(["full", 3])
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        lp.parse("full", num_layers=0)


def test_one_module_for_several_layers_is_refused():
    mixer = _Mean(8)
    assert lp.parse(["full", mixer])[1].make is mixer
    with pytest.raises(ValueError, match=r"_Mean fills layers 1 and 3, which would share"):
        lp.parse(["full", mixer], num_layers=4)


def test_a_module_that_is_no_layer_is_refused_when_built():
    with pytest.raises(TypeError, match=r"the module given is a Linear; a layer takes"):
        ak.TransformerEncoder(["full", nn.Linear(8, 8)], 8, 2)
    with pytest.raises(TypeError, match=r"the factory <lambda> made is a ReLU"):
        ak.TransformerEncoder(["full", lambda **sizes: nn.ReLU()], 8, 2)


def test_names_lists_parts_and_mixers():
    offered = lp.names()
    assert offered[:2] == ["full", "sliding:W"]
    assert {"gated_deltanet", "mamba2", "retention", "gla"} <= set(offered)
    assert "scaled_dot" not in offered  # a score is no layer
    for name in ak.mixers.REGISTRY.available():  # a mixer whose name a part has is qualified
        assert (f"mixer.{name}" if name in offered[2:] else name) in offered


def test_layer_arguments_keep_the_full_layers_arguments_to_full_and_sliding_layers():
    layer = {"score": "additive", "position": "rope", "pattern": object(), "dropout": 0.1}
    full = lp.layer_arguments(lp.LayerEntry("full", "full"), layer, embed_dim=8, num_heads=2)
    assert full == layer
    sliding = lp.parse("sliding:3")[0]
    got = lp.layer_arguments(sliding, layer, embed_dim=8, num_heads=2)
    assert got == {"score": "additive", "position": "rope", "dropout": 0.1, "window": 3}
    part = lp.layer_arguments(lp.parse("gla")[0], layer, embed_dim=8, num_heads=2)
    assert set(part) == {"dropout", "attention"}
    assert isinstance(part["attention"], ak.linear_family.GatedLinearAttention)
    assert part["attention"].num_heads == 2 and part["attention"].head_dim == 4
    crossed = lp.layer_arguments(
        lp.parse("gla")[0], layer, embed_dim=8, num_heads=2, keeps_score=True
    )
    assert crossed["score"] == "additive"  # the cross-attention's
