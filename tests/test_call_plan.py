"""A layer's plan per kind of call (attnkit.call_plan): resolved once, checked by size after, equal
to the general path, dropped when the layer changes, and stepping aside when it cannot be sure."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit import call_plan, checks, kernels
from attnkit.kernels import dense

E, H = 12, 3


def _twin(layer: ak.MultiHeadAttention, **kw) -> ak.MultiHeadAttention:
    """The same layer evaluated by the dense kernel (a reference independent of SDPA)."""
    ref = ak.MultiHeadAttention(E, H, kernel="dense", num_kv_heads=layer.num_kv_heads, **kw).to(
        next(layer.parameters()).dtype
    )
    ref.load_state_dict(layer.state_dict())
    return ref


def test_the_first_call_of_a_kind_is_validated_in_full_and_later_ones_by_size():
    mha = ak.MultiHeadAttention(E, H)
    x = torch.randn(2, 5, E)
    with mock.patch.object(checks, "part_matches", wraps=checks.part_matches) as walk:
        mha(x)
        assert walk.call_count == 1 and len(mha._plans) == 1
        mha(torch.randn(3, 7, E))  # same kind, other sizes: no second walk
        assert walk.call_count == 1 and len(mha._plans) == 1
        mha(x, mask=ak.masks.causal(5))  # a new kind: validated, planned
        assert walk.call_count == 2 and len(mha._plans) == 2
    # a planned kind still refuses bad sizes, with the full check's message
    with pytest.raises(ValueError, match="query has 11 features"):
        mha(torch.randn(2, 5, 11))
    with pytest.raises(ValueError, match=r"mask of shape \(6, 6\) does not broadcast"):
        mha(x, mask=ak.masks.causal(6))
    with pytest.raises(ValueError, match="N = 0"):
        mha(x, torch.randn(2, 0, E))


def test_sizes_the_quick_check_cannot_confirm_are_validated_in_full():
    mha = ak.MultiHeadAttention(E, H)
    q, kv = torch.randn(2, 4, E), torch.randn(2, 6, E)
    mha(q, kv, kv)
    # key batch 1 broadcasts over the query batch: valid, left to the full checks
    assert not call_plan.fits(mha, q, kv[:1], kv[:1], None, None, 0)
    torch.testing.assert_close(
        mha(q, kv[:1], kv[:1]).context,
        mha(q, kv[:1].expand(2, 6, E), kv[:1].expand(2, 6, E)).context,
    )
    with pytest.raises(ValueError, match="do not broadcast"):
        mha(q, torch.randn(3, 6, E), torch.randn(3, 6, E))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [H, 1])
def test_planned_calls_equal_the_dense_kernel_under_stress(dtype, kv_heads):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, num_kv_heads=kv_heads).to(dtype)
    ref = _twin(mha)
    b, n = 3, 37
    x = torch.randn(b, n, E, dtype=dtype)
    x[0] += 1e4 * torch.randn(n, 1, dtype=dtype)  # large row offsets
    lengths = torch.tensor([n, 20, 1])
    pad = ak.masks.from_lengths(lengths, n)  # (B, 1, N)
    x[1, 20:] = float("nan")  # padding content reaches nothing
    causal = ak.masks.causal(n) & pad
    bias = torch.randn(b, 1, n, dtype=dtype)
    tol = {"atol": 1e-9, "rtol": 1e-9} if dtype == torch.float64 else {"atol": 3e-2, "rtol": 3e-2}
    for kw in ({"mask": pad}, {"mask": causal}, {"mask": pad, "bias": bias}):
        for _ in range(2):  # the first call plans the kind, the second uses the plan
            got = mha(x, **kw).context
        want = ref(x, **kw).context
        rows = lengths.view(-1, 1) > torch.arange(n)  # query rows of real tokens
        torch.testing.assert_close(got[rows], want[rows], **tol)
        assert torch.isfinite(got[rows]).all()
    # a row with no key allowed gives 0, as everywhere in attnkit
    none = torch.zeros(b, 1, n, dtype=torch.bool)
    none[1:] = True
    out = mha(x.nan_to_num(), mask=none).context
    out = mha(x.nan_to_num(), mask=none).context
    want = ref(x.nan_to_num(), mask=none).context
    torch.testing.assert_close(out, want, **tol)


def test_planned_gradients_equal_the_dense_kernel():
    torch.manual_seed(1)
    mha = ak.MultiHeadAttention(E, H, position="rope").double()
    ref = _twin(mha, position="rope")
    x = torch.randn(2, 9, E, dtype=torch.float64, requires_grad=True)
    mask = ak.masks.causal(9)
    mha(x, mask=mask)
    grads = []
    for layer in (mha, ref):
        out = layer(x, mask=mask).context
        grads.append(torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_planned_decoding_equals_the_causal_pass():
    torch.manual_seed(2)
    mha = ak.MultiHeadAttention(E, H, num_kv_heads=1, position="rope", gate="elementwise").double()
    x = torch.randn(2, 8, E, dtype=torch.float64)
    want = mha(x, mask=ak.masks.causal(8)).context
    cache = ak.kv_cache.LayerCache()
    steps = [mha(x[:, :3], mask=ak.masks.causal(3), cache=cache).context]
    steps += [mha(x[:, i : i + 1], cache=cache).context for i in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, 1), want)
    assert len(mha._plans) == 3  # the whole pass, the prefill and the step: three kinds


def test_a_plan_is_dropped_when_the_layer_changes_and_not_copied():
    mha = ak.MultiHeadAttention(E, H)
    x = torch.randn(2, 5, E)
    mha(x)
    assert len(copy.deepcopy(mha)._plans) == 0
    mha.double()
    assert len(mha._plans) == 0
    with pytest.raises(TypeError, match="float64"):
        mha(x)  # float32 input now refused by the full check, named
    mha(x.double())
    mha.attention = ak.Attention("scaled_dot", "sparsemax")
    assert len(mha._plans) == 0
    out = mha(x.double(), need_weights=True)
    assert (out.weights == 0).any()  # sparsemax, not the old plan's softmax


def test_the_direct_route_steps_aside_for_listeners_and_a_kernel_tried_first():
    mha = ak.MultiHeadAttention(E, H)
    x = torch.randn(2, 5, E)
    mha(x)
    with ak.hooks.listen() as reports:
        mha(x)
    assert len(reports) == 1 and reports[0].weights.shape == (2, H, 5, 5)

    used = []

    class First(dense.Dense):
        name = "first_for_test"
        priority = 1000

        def attend(self, call):
            used.append(1)
            return super().attend(call)

    saved = kernels.REGISTRY.snapshot()
    try:
        kernels.register(First)
        mha(x)
        assert used, "a kernel registered after the plan was made is tried first"
    finally:
        kernels.REGISTRY.restore(saved)
    used.clear()
    mha(x)
    assert not used


class _PerHeadScale(ak.qk_chain.QKTransform):
    """Scales each head's keys by its own factor: not the same for every head."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, heads).view(heads, 1, 1))

    def forward(self, q, k):
        return q, k * self.scale


@pytest.mark.parametrize("alike", [True, False])
def test_grouped_keys_are_placed_per_head_unless_every_head_is_alike(alike):
    """A grouped-query layer places each key head once only when its chain and scheme declare
    ``same_for_every_head``; a per-head step sees the keys per query head. Either way cached
    decoding equals the causal pass, and the whole pass equals the dense kernel."""
    torch.manual_seed(3)
    heads, kv_heads, d = 4, 2, 6
    step = ak.qk_chain.HeadNorm(d) if alike else _PerHeadScale(heads)
    mha = ak.MultiHeadAttention(
        24, heads, num_kv_heads=kv_heads, position="rope", qk=[step, "position"]
    ).double()
    with torch.no_grad():
        for p in step.parameters():
            p.copy_(torch.linspace(0.5, 2.0, p.numel()).view_as(p))
    ref = ak.MultiHeadAttention(
        24, heads, num_kv_heads=kv_heads, position="rope", qk=[step, "position"], kernel="dense"
    ).double()
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    mask = ak.masks.causal(7)
    want = ref(x, mask=mask).context
    mha(x, mask=mask)
    torch.testing.assert_close(mha(x, mask=mask).context, want)
    assert next(iter(mha._plans.values())).heads_alike is alike
    cache = ak.kv_cache.LayerCache()
    steps = [mha(x[:, :2], mask=ak.masks.causal(2), cache=cache).context]
    steps += [mha(x[:, i : i + 1], cache=cache).context for i in range(2, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), want)
