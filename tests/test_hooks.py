"""Named hook points: recorded values and patched runs against the same computation by hand."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import Tensor

import attnkit as ak
from attnkit import hooks

E, H, N, B = 8, 2, 5, 2
D = E // H
LAYER = "layers.{}.self_attention.module"


def _model(layers: int = 2, **kw) -> ak.TransformerEncoder:
    torch.manual_seed(0)
    model = ak.TransformerEncoder(layers, E, H, dtype=torch.float64, **kw).eval()
    with torch.no_grad():  # biases of zero would hide a bias left out by hand
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    return model


def _inputs(seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, N, E, generator=g, dtype=torch.float64)


def _mha_by_hand(mha, x: Tensor, *, context=None, mask=None, align=None) -> dict[str, Tensor]:
    """Brauwers eqs. 38-40 written out from the layer's weights: every point's value.
    ``context(h_ctx)`` rewrites the per-head context (B, H, N, d); ``mask`` (…, N, N) True =
    may attend; ``align`` maps masked scores to weights (softmax by default)."""
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q = x @ w[:E].T + b[:E]
    k = x @ w[E : 2 * E].T + b[E : 2 * E]
    v = x @ w[2 * E :].T + b[2 * E :]
    q, k, v = (t.reshape(B, N, H, D).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    masked = scores if mask is None else scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(masked, -1) if align is None else align(masked)
    ctx = weights @ v
    if context is not None:
        ctx = context(ctx)
    output = ctx.transpose(1, 2).reshape(B, N, E) @ mha.out_proj.weight.T + mha.out_proj.bias
    return {"q": q, "k": k, "v": v, "scores": scores, "weights": weights, "context": ctx,
            "output": output}  # fmt: skip


def _model_by_hand(model, x: Tensor, edits=None) -> tuple[Tensor, dict[str, Tensor]]:
    """The post-norm encoder layer by layer, each attention by hand; ``edits[i]`` holds the
    keyword arguments of layer i's :func:`_mha_by_hand`. Returns the output and every point."""
    points = {}
    for i, layer in enumerate(model.layers):
        mha = layer.self_attention.module
        got = _mha_by_hand(mha, x, **(edits or {}).get(i, {}))
        points |= {f"{LAYER.format(i)}.{p}": t for p, t in got.items()}
        x = layer.norm1(x + got["output"])
        x = layer.norm2(x + layer.ff(x))
    return x, points


def test_the_manual_model_is_the_model():
    model, x = _model(), _inputs(1)
    torch.testing.assert_close(_model_by_hand(model, x)[0], model(x))


def test_recorded_points_equal_the_manual_projections():
    model, x = _model(), _inputs(1)
    with hooks.record(model) as cache:
        model(x)
    _, want = _model_by_hand(model, x)
    assert list(cache) == list(want)  # every point, in the order of the computation
    for name, value in want.items():
        torch.testing.assert_close(cache[name], value, msg=name)
        assert not cache[name].requires_grad


def test_names_filter_keeps_only_the_chosen_points():
    model, x = _model(), _inputs(1)
    with hooks.record(model, names=lambda n: n.endswith("weights")) as cache:
        model(x)
    assert list(cache) == [f"{LAYER.format(i)}.weights" for i in (0, 1)]
    one = f"{LAYER.format(1)}.k"
    with hooks.record(model, names=one) as single:
        model(x)
    assert list(single) == [one]
    with hooks.record(model, names={one, f"{LAYER.format(0)}.q"}) as two:
        model(x)
    assert set(two) == {one, f"{LAYER.format(0)}.q"}


def test_recording_without_weights_leaves_the_output_bit_identical():
    # q/k/v/output points do not make the parts compute weights: the same kernel runs.
    model = _model()
    x = _inputs(1).float()
    model = model.float()
    plain = model(x)
    with hooks.record(model, names=lambda n: not n.endswith(("scores", "weights"))):
        assert not hooks.listening()
        same = model(x)
    assert torch.equal(plain, same)


def test_record_keeps_the_graph_when_asked():
    model, x = _model(), _inputs(1)
    name = f"{LAYER.format(0)}.weights"
    with hooks.record(model, names=name, detach=False) as cache:
        model(x)
    assert cache[name].requires_grad


def test_patching_a_heads_context_to_another_inputs_equals_the_manual_model():
    model, x1, x2 = _model(), _inputs(1), _inputs(2)
    head, name = 1, f"{LAYER.format(1)}.context"
    with hooks.record(model, names=name) as cache:
        model(x2)
    with hooks.patch(model, {name: hooks.replace_heads(cache[name], [head])}):
        got = model(x1)

    # By hand: layer 1's context of x2 (layers 0 and 1 on x2), its head placed into x1's run.
    _, on_x2 = _model_by_hand(model, x2)
    source = on_x2[name]

    def place(ctx: Tensor) -> Tensor:
        ctx = ctx.clone()
        ctx[:, head] = source[:, head]
        return ctx

    want, _ = _model_by_hand(model, x1, {1: {"context": place}})
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, model(x1))  # the patch changed something


def test_patching_a_point_with_a_tensor_replaces_it():
    model, x1, x2 = _model(), _inputs(1), _inputs(2)
    name = f"{LAYER.format(0)}.output"
    _, on_x2 = _model_by_hand(model, x2)
    with hooks.patch(model, {name: on_x2[name]}):
        got = model(x1)
    # Layer 0's output replaced wholesale: the residual still carries x1.
    layer0, layer1 = model.layers
    h = layer0.norm1(x1 + on_x2[name])
    h = layer0.norm2(h + layer0.ff(h))
    torch.testing.assert_close(got, layer1(h))


def test_head_ablation_equals_zeroing_the_heads_context_by_hand():
    model, x = _model(), _inputs(3)
    with hooks.ablate_heads(model, {LAYER.format(0): [1], LAYER.format(1): 0}):
        got = model(x)

    def zero(head):
        def fn(ctx):
            ctx = ctx.clone()
            ctx[:, head] = 0.0
            return ctx

        return fn

    want, _ = _model_by_hand(model, x, {0: {"context": zero(1)}, 1: {"context": zero(0)}})
    torch.testing.assert_close(got, want)


def test_knock_out_equals_a_mask():
    model, x = _model(), _inputs(4)
    pairs = [(0, 1), (2, 2), (4, 0)]
    with hooks.knock_out(model, {LAYER.format(1): pairs}):
        got = model(x)
    keep = torch.ones(N, N, dtype=torch.bool)
    for i, j in pairs:
        keep[i, j] = False
    want, _ = _model_by_hand(model, x, {1: {"mask": keep}})
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("align", ["sparsemax", "entmax15"])
def test_knock_out_equals_the_layers_mask_for_other_alignments(align):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, align=align, dtype=torch.float64)
    x = _inputs(5) * 3  # sharp enough for sparse weights
    knocked = torch.zeros(H, N, N, dtype=torch.bool)
    knocked[0, 1, 3] = knocked[1, 4, 0] = knocked[1, 4, 4] = True
    knocked[0, 2, :] = True  # a whole row: context 0, as a mask gives
    with hooks.knock_out(mha, {"": knocked}):
        got = mha(x, need_weights=True)
    want = mha(x, mask=~knocked.unsqueeze(0), need_weights=True)  # (1, H, N, N): per head
    torch.testing.assert_close(got.context, want.context)
    torch.testing.assert_close(got.weights, want.weights)


def test_patched_weights_give_the_context_by_hand():
    model, x = _model(), _inputs(6)
    name = f"{LAYER.format(0)}.weights"
    uniform = torch.full((B, H, N, N), 1.0 / N, dtype=torch.float64)
    with hooks.patch(model, {name: uniform}):
        got = model(x)
    want, _ = _model_by_hand(model, x, {0: {"align": lambda s: uniform}})
    torch.testing.assert_close(got, want)


def test_patched_scores_are_aligned_again():
    model, x = _model(), _inputs(7)
    name = f"{LAYER.format(1)}.scores"
    with hooks.patch(model, {name: lambda s: 2 * s}):
        got = model(x)
    want, _ = _model_by_hand(model, x, {1: {"align": lambda s: torch.softmax(2 * s, -1)}})
    torch.testing.assert_close(got, want)


def test_patched_q_flows_into_the_scores():
    mha = _model(1).layers[0].self_attention.module
    x = _inputs(8)
    with hooks.record(mha) as plain:
        mha(x)
    q = plain["q"].clone()
    q[:, 0] *= -1  # head 0's queries negated
    with hooks.patch(mha, {"q": hooks.replace_heads(q, 0)}), hooks.record(mha) as cache:
        mha(x)
    # A record sees the patched value, whichever block is outside.
    torch.testing.assert_close(cache["q"], q)
    torch.testing.assert_close(cache["scores"][:, 0], -plain["scores"][:, 0])
    torch.testing.assert_close(cache["scores"][:, 1], plain["scores"][:, 1])


def test_grouped_query_points_keep_the_kv_heads():
    mha = ak.MultiHeadAttention(E, 4, num_kv_heads=2, dtype=torch.float64)
    with hooks.record(mha, names=["k", "v", "q", "weights"]) as cache:
        mha(_inputs(9))
    assert cache["q"].shape == (B, 4, N, 2)
    assert cache["k"].shape == cache["v"].shape == (B, 2, N, 2)
    assert cache["weights"].shape == (B, 4, N, N)


def test_each_decoding_step_is_one_call():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, dtype=torch.float64)
    cache = ak.kv_cache.LayerCache()
    x = _inputs(10)
    with hooks.record(mha, names="k") as rec:
        for t in range(3):
            mha(x[:, t : t + 1], cache=cache)
    calls = rec.calls("k")
    assert len(calls) == 3 and all(c.shape == (B, H, 1, D) for c in calls)
    with pytest.raises(ValueError, match="recorded 3 times"):
        rec["k"]


def test_modules_outside_the_model_are_not_recorded():
    inside, outside = _model(1), _model(1)
    with hooks.record(inside) as cache:
        outside(_inputs(1))
    assert len(cache) == 0


def test_bad_names_and_patches_are_refused():
    model = _model()
    with (
        pytest.raises(
            ValueError, match=r"did you mean 'layers\.0\.self_attention\.module\.weights'"
        ),
        hooks.record(model, names="layers.0.self_attention.module.weight"),
    ):
        pass
    with (
        pytest.raises(ValueError, match="one of q, k, v"),
        hooks.patch(model, {"layers.9.self_attention.module.q": lambda t: t}),
    ):
        pass
    with (
        pytest.raises(TypeError, match="must be a tensor"),
        hooks.patch(model, {f"{LAYER.format(0)}.q": 3}),
    ):
        pass
    with pytest.raises(TypeError, match="names must be"), hooks.record(model, names=3):
        pass
    name = f"{LAYER.format(0)}.q"
    with (
        pytest.raises(ValueError, match="returned shape"),
        hooks.patch(model, {name: lambda t: t[..., :1]}),
    ):
        model(_inputs(1))
    with (
        pytest.raises(ValueError, match="head 5 is not one of the 2 heads"),
        hooks.ablate_heads(model, {LAYER.format(0): 5}),
    ):
        model(_inputs(1))
    with (
        pytest.raises(ValueError, match="outside the scores"),
        hooks.knock_out(model, {LAYER.format(0): [(0, N)]}),
    ):
        model(_inputs(1))
    with pytest.raises(KeyError, match="no recorded point"):
        hooks.ActivationCache()["q"]


def test_a_patch_never_applied_is_warned_about():
    model = _model()
    with (
        pytest.warns(UserWarning, match="nothing was patched"),
        hooks.patch(model, {f"{LAYER.format(0)}.q": lambda t: t}),
    ):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with hooks.patch(model, {f"{LAYER.format(0)}.q": lambda t: t}):
            model(_inputs(1))


def test_scores_cannot_be_patched_without_an_alignment():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, attention=ak.linear_family.Retention.example()[0])
    with pytest.raises(ValueError, match="cannot patch"), hooks.patch(mha, {"scores": lambda s: s}):
        mha(_inputs(1).float())
