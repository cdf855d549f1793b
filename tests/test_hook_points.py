"""The layer side of the named points: nothing happens without a block; blocks nest; forward
hooks exist only while a block is open."""

from __future__ import annotations

import torch
from torch import nn

import attnkit as ak
from attnkit import hook_points, hooks


class _Returns(nn.Module):
    """A module whose output point is its forward's first result (as a transformers module)."""

    def forward(self, x):
        return x * 2, "extra"


def test_without_a_block_every_point_returns_its_value_itself():
    x = torch.randn(3)
    m = nn.Identity()
    assert hook_points.emit(m, "q", x) is x
    assert all(a is x for a in hook_points.qkv(m, x, x, x))
    out = ak.AttentionOutput(x)
    assert hook_points.attention(m, out, x, x) is out
    assert not hook_points.forcing() and not hooks.listening()


def test_only_blocks_that_read_scores_or_weights_force_them():
    mha = ak.MultiHeadAttention(8, 2)
    with hooks.record(mha, names="q"):
        assert not hooks.listening()
    with hooks.record(mha, names=lambda n: n == "weights"):
        assert hooks.listening()
    with hooks.patch(mha, {"scores": lambda s: s}):
        assert hooks.listening()
        mha(torch.randn(1, 3, 8))
    assert not hooks.listening()


def test_nested_patches_apply_outer_first_and_records_see_the_result():
    mha = ak.MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    with hooks.record(mha, names="output") as plain:
        mha(x)
    with (
        hooks.record(mha, names="output") as outer,
        hooks.patch(mha, {"output": lambda t: t + 1}),
        hooks.patch(mha, {"output": lambda t: 2 * t}),
        hooks.record(mha, names="output") as inner,
    ):
        y = mha(x).context
    want = 2 * (plain["output"] + 1)
    for got in (y, outer["output"], inner["output"]):
        torch.testing.assert_close(got, want)


def test_forward_hooks_live_only_inside_blocks_one_per_module():
    model = nn.Sequential(_Returns())
    module = model[0]
    hook_points.output_from_forward([module])
    assert not module._forward_hooks
    with hooks.record(model) as a, hooks.patch(model, {"0.output": lambda t: t + 1}):
        assert len(module._forward_hooks) == 1
        y, extra = module(torch.ones(2))
    assert not module._forward_hooks
    torch.testing.assert_close(y, torch.full((2,), 3.0))
    assert extra == "extra"
    torch.testing.assert_close(a["0.output"], y)
    # A module outside the block's model is not hooked.
    with hooks.record(nn.Linear(1, 1)):
        assert not module._forward_hooks
