"""The contract every registered mechanism meets (DESIGN 7), from ``mechanisms.example`` alone:
one output family, batch == items, mask == truncation, gradients to every parameter (and a float64
gradcheck), float64 and bfloat16, ``.to()``, capture and ``describe``.

Over the mechanisms registered as such (``mechanisms.REGISTRY.own()``): the per-head attention
parts that the mechanism registry delegates to have their own registry and their own contract
(``tests/test_head_contract.py``)."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit import mechanisms

NAMES = mechanisms.REGISTRY.own()


def _map(x, fn):
    """Apply ``fn`` to every floating tensor in nested tuples, lists and dicts."""
    if isinstance(x, torch.Tensor):
        return fn(x) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_map(y, fn) for y in x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    return x


def _leaves(x):
    """The floating tensors in nested tuples, lists and dicts, in ``_map``'s order."""
    found = []
    _map(x, lambda t: found.append(t) or t)
    return found


def _item(x, b):
    """Batch item b of every tensor (floating or not), keeping the batch dim."""
    if isinstance(x, torch.Tensor):
        return x[b : b + 1]
    if isinstance(x, (list, tuple)):
        return type(x)(_item(y, b) for y in x)
    if isinstance(x, dict):
        return {k: _item(v, b) for k, v in x.items()}
    return x


def _example(name, dtype=torch.float64):
    torch.manual_seed(0)
    module, args, kwargs = mechanisms.example(name)
    module = module.to(dtype).eval()
    return module, _map(args, lambda t: t.to(dtype)), _map(kwargs, lambda t: t.to(dtype))


def _asking_for_weights(module, kwargs):
    """``kwargs`` with ``need_weights=True`` for a mechanism that computes weights on request."""
    if "need_weights" in inspect.signature(module.forward).parameters:
        return {**kwargs, "need_weights": True}
    return kwargs


@pytest.mark.parametrize("name", NAMES)
def test_one_output_family(name):
    module, args, kwargs = _example(name)
    out = module(*args, **_asking_for_weights(module, kwargs))
    assert isinstance(out, mechanisms.MechanismOutput)
    assert isinstance(out, tuple) and hasattr(type(out), "_fields")  # a typed (named) tuple
    assert out.representation.shape[0] == 2
    assert out.named_weights(), "a mechanism names at least one weight tensor"
    for wname, w in out.named_weights().items():
        assert w.shape[0] == 2, wname
        assert torch.isfinite(w).all(), wname
        # weights are non-negative unless the mechanism declares signed ones (linear attention
        # without a feature map: the decayed scores themselves)
        assert getattr(module, "signed_weights", False) or (w >= 0).all(), wname


def _alignments(name):
    module, _, _ = mechanisms.example(name)
    return [m for m in module.modules() if isinstance(m, ak.alignments.Alignment)]


@pytest.mark.parametrize("name", NAMES)
def test_aligns_through_an_alignment_module(name):
    assert _alignments(name), "weights come from an alignment module (ablation can swap it)"


# "(none)" (an unknown name, so the test fails) if no example had only normalized alignments.
@pytest.mark.parametrize(
    "name",
    [n for n in NAMES if _alignments(n) and all(a.normalized for a in _alignments(n))]
    or ["(none)"],
)
def test_weights_are_distributions_under_normalized_alignments(name):
    """Each row over the keys sums to 1, or is all zero where every key is padding (DESIGN 2)."""
    module, args, kwargs = _example(name)
    for wname, w in module(*args, **_asking_for_weights(module, kwargs)).named_weights().items():
        sums = w.sum(-1)
        empty = (w == 0).all(-1)
        torch.testing.assert_close(sums[~empty], torch.ones_like(sums[~empty]), msg=wname)


@pytest.mark.parametrize("name", NAMES)
def test_batch_equals_items(name):
    module, args, kwargs = _example(name)
    kwargs = _asking_for_weights(module, kwargs)
    batched = module(*args, **kwargs)
    for b in range(2):
        alone = module(*_item(args, b), **_item(kwargs, b))
        torch.testing.assert_close(
            batched.representation[b : b + 1], alone.representation, atol=1e-12, rtol=1e-10
        )
        for wname, w in batched.named_weights().items():
            torch.testing.assert_close(
                w[b : b + 1], alone.named_weights()[wname], atol=1e-12, rtol=1e-10, msg=wname
            )


def _truncated_inputs(module, args, kwargs, lengths):
    """The call with masks from ``masks.from_lengths`` for every mask the mechanism declares,
    and, per item, the call with the inputs each mask covers truncated and no masks."""
    named = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    batched, keep = dict(named), {}
    for mask_name, input_names in type(module).mask_inputs.items():
        x = named[input_names[0]]
        n = x.shape[-2]
        keep[mask_name] = torch.tensor(lengths[: x.shape[0]]) % n + 1
        mask = ak.masks.from_lengths(keep[mask_name], n)
        for _ in range(x.dim() - 3):  # (B, …, 1, n) for inputs with more dims, e.g. (B, S, W, d)
            mask = mask.unsqueeze(1)
        batched[mask_name] = mask.expand(*x.shape[:-2], 1, n)
    items = []
    for b in range(2):
        alone = {k: _item(v, b) for k, v in named.items()}
        for mask_name, input_names in type(module).mask_inputs.items():
            for input_name in input_names:
                alone[input_name] = alone[input_name][..., : int(keep[mask_name][b]), :]
            alone[mask_name] = None
        items.append(alone)
    return batched, items


@pytest.mark.parametrize("name", [n for n in NAMES if mechanisms.REGISTRY.get(n).mask_inputs])
@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(0, 11), min_size=2, max_size=2))
def test_mask_equals_truncation(name, lengths):
    """Any lengths per item (1 … n, from ``lengths % n + 1``)."""
    module, args, kwargs = _example(name)
    batched, items = _truncated_inputs(module, args, kwargs, lengths)
    out = module(**batched).representation
    for b, alone in enumerate(items):
        ref = module(**alone).representation
        got = out[b : b + 1][tuple(slice(0, s) for s in ref.shape)]  # drop padded query rows
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_every_parameter(name):
    module, args, kwargs = _example(name)
    args = _map(args, lambda t: t.requires_grad_())
    out = module(*args, **kwargs)
    rep = out.representation
    r = torch.randn(rep.shape, generator=torch.Generator().manual_seed(1), dtype=rep.dtype)
    # parameters a mechanism declares as trained by the policy gradient alone (REINFORCE on
    # its log_prob) get their gradient from log_prob instead
    policy = bool(getattr(module, "policy_parameters", ()))
    (rep * r).sum().backward(retain_graph=policy)
    if policy:
        out.log_prob.sum().backward()
    for pname, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname
    for x in _leaves(args):
        assert x.grad is not None and x.grad.abs().sum() > 0  # and the inputs


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_float64(name):
    """Analytical gradients w.r.t. every floating input match finite differences."""
    module, args, kwargs = _example(name)
    inputs = tuple(x.detach().requires_grad_() for x in _leaves(args))

    def representation(*xs):
        it = iter(xs)
        return module(*_map(args, lambda _: next(it)), **kwargs).representation

    assert torch.autograd.gradcheck(representation, inputs)


@pytest.mark.parametrize("name", NAMES)
def test_float64_and_bfloat16(name):
    ref = _example(name, torch.float64)
    out64 = ref[0](*ref[1], **ref[2]).representation
    assert out64.dtype == torch.float64
    m32, a32, k32 = _example(name, torch.float32)
    out32 = m32(*a32, **k32).representation
    torch.testing.assert_close(out32.double(), out64, atol=1e-5, rtol=1e-4)
    m16, a16, k16 = _example(name, torch.bfloat16)
    out16 = m16(*a16, **k16).representation
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()
    torch.testing.assert_close(out16.double(), out64, atol=0.1, rtol=0.1)


@pytest.mark.parametrize("name", NAMES)
def test_to_moves_every_parameter_and_buffer(name):
    module, args, kwargs = mechanisms.example(name)
    assert module.to(torch.float64) is module
    for tname, t in [*module.named_parameters(), *module.named_buffers()]:
        assert t.dtype == torch.float64 or not t.is_floating_point(), tname
    for sub_name, sub in module.named_modules():  # a plain tensor attribute would not move
        plain = [k for k, v in vars(sub).items() if isinstance(v, torch.Tensor)]
        assert not plain, f"{sub_name or name}: tensors outside parameters and buffers: {plain}"
    out = module(*_map(args, lambda t: t.double()), **_map(kwargs, lambda t: t.double()))
    assert out.representation.dtype == torch.float64
    assert all(w.dtype == torch.float64 for w in out.named_weights().values())
    module.to("meta")
    assert {t.device.type for t in [*module.parameters(), *module.buffers()]} <= {"meta"}


@pytest.mark.parametrize("name", NAMES)
def test_capture_sees_the_weights(name):
    module, args, kwargs = _example(name)
    with ak.evaluation.capture(module) as records:
        out = module(*args, **kwargs)
    assert records, "no weights reported to attnkit.hooks"
    for key, calls in records.items():
        assert all(w.shape[0] == 2 for w in calls), key
    # The weights the output names are those captured (per hop for stacked hops; the core
    # reports a single query's weights with their M = 1 row).
    captured = [w for calls in records.values() for w in calls]

    def seen(w):
        return any(c.numel() == w.numel() and torch.equal(c.reshape(w.shape), w) for c in captured)

    for wname, w in out.named_weights().items():
        w = w.detach()
        assert seen(w) or all(seen(w[:, i]) for i in range(w.shape[1])), wname


@pytest.mark.parametrize("name", NAMES)
def test_describe_gives_a_taxonomy_row(name):
    module, _, _ = mechanisms.example(name)
    row = ak.describe(module)
    assert row.scoring != "-" and row.alignment != "-"  # it scores and aligns something
    own = list(module.taxonomy_tags())
    assert own, "a mechanism places itself in the taxonomy"
    defaults = {dim: default for _, dim, default in ak.taxonomy.DIMENSIONS}
    cells = dict(zip([dim for _, dim, _ in ak.taxonomy.DIMENSIONS], row.cells(), strict=True))
    for tag in own:
        if tag != defaults[type(tag)]:  # a default gives way to what its parts say
            assert tag.value in cells[type(tag)].split(" + "), (tag, row)
    assert row.to_markdown(name).splitlines()[2].startswith(f"| {name} | ")


@pytest.mark.parametrize("name", [n for n in NAMES if mechanisms.REGISTRY.get(n).mask_inputs])
def test_padded_content_influences_nothing(name):
    """NaN in every padded feature (Issue 8.6: masked means removed) changes nothing."""
    module, args, kwargs = _example(name)
    named = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    clean = module(**named).representation
    dirty = dict(named)
    rows = None
    for mask_name, input_names in type(module).mask_inputs.items():
        for input_name in input_names:
            x = named[input_name].clone()
            real = named[mask_name].reshape(*x.shape[:-2], -1)[..., -x.shape[-2] :]
            x[~real.expand(x.shape[:-1])] = float("nan")
            dirty[input_name] = x
            rows = real.expand(x.shape[:-1])
    out = module(**dirty).representation
    if out.dim() >= 3 and rows is not None and out.shape[:2] == rows.shape:
        out, clean = out[rows], clean[rows]  # per-position outputs: padded rows are padding
    torch.testing.assert_close(out, clean, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", [n for n in NAMES if mechanisms.REGISTRY.get(n).mask_inputs])
def test_everything_masked_gives_zero_weights_and_finite_values(name):
    """Every mask all False (DESIGN 2: a fully masked row gives weights 0, never NaN), forward
    and backward."""
    module, args, kwargs = _example(name)
    named = dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)
    for mask_name, input_names in type(module).mask_inputs.items():
        x = named[input_names[0]]
        named[mask_name] = torch.zeros(*x.shape[:-2], 1, x.shape[-2], dtype=torch.bool)
    inputs = _leaves(named)
    for x in inputs:
        x.requires_grad_()
    out = module(**_asking_for_weights(module, named))
    assert torch.isfinite(out.representation).all()
    for wname, w in out.named_weights().items():
        assert (w == 0).all(), wname
    out.representation.sum().backward()
    for x in inputs:
        assert x.grad is None or torch.isfinite(x.grad).all()
