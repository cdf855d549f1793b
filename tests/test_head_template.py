"""HeadAttention's template: the holes and capabilities for parts whose calls are not the
plain one (keys made from the queries, weights never held whole, keys split across ranks,
refusals agreed on with a group), each against a plain softmax computed here; and every
per-head part in attnkit runs on it."""

from __future__ import annotations

import importlib
import math
import pkgutil

import pytest
import torch

import attnkit as ak
from attnkit.head import HeadAttention
from attnkit.output import AttentionOutput

D = torch.float64

# parts that override forward instead of implementing attend, with the reason
OWN_FORWARD = {
    ak.Attention: "the default part has a direct route of its own into the kernels (score x "
    "alignment, kernel selection), which the layers' plans call without the template",
}


class _Softmax(HeadAttention):
    """softmax(q kᵀ / √d) v over the mask, written out (weights 0 where masked)."""

    causal_form = True
    mask_forms = frozenset({"key", "padding", "causal", "full"})

    def attend(self, q, k, v, *, mask, bias, need_weights, **call):
        self.seen = call
        e = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if mask is not None:
            e = e.masked_fill(~mask, float("-inf"))
        w = torch.softmax(e, -1).nan_to_num(0.0)
        return AttentionOutput(w @ v, w if need_weights else None)


class _SharedKeys(_Softmax):
    """k = None: the keys are q / ‖q‖, and attend is told so."""

    def keys_and_values(self, q, k, v):
        if k is None:
            return q / q.norm(dim=-1, keepdim=True), v, {"shared": True}
        return k, v, {"shared": False}


class _NoWeights(_Softmax):
    returns_weights = False


class _Sharded(_Softmax):
    """A row without a key here: context 1 (as if its keys were elsewhere)."""

    sharded = True

    def attend(self, q, k, v, *, mask, bias, need_weights, **call):
        out = super().attend(q, k, v, mask=mask, bias=bias, need_weights=False)
        if mask is not None:
            empty = ~mask.any(-1, keepdim=True)
            out = out._replace(context=torch.where(empty, 1.0, out.context))
        return out


def _inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 2, 5, 4, generator=g, dtype=D) for _ in range(3))


def _softmax(q, k, v, mask=None):
    e = q @ k.transpose(-1, -2) / 2.0
    if mask is not None:
        e = e.masked_fill(~mask, float("-inf"))
    return torch.softmax(e, -1).nan_to_num(0.0) @ v


def test_a_part_makes_the_keys_of_a_call_that_leaves_them_out():
    q, k, v = _inputs()
    part = _SharedKeys()
    pad = ak.masks.from_lengths(torch.tensor([5, 3]), 5)[:, None]
    out = part(q, None, v, mask=pad).context
    assert part.seen == {"shared": True}
    torch.testing.assert_close(out, _softmax(q, q / q.norm(dim=-1, keepdim=True), v, pad))
    torch.testing.assert_close(part(q, k, v).context, _softmax(q, k, v))
    assert part.seen == {"shared": False}
    with pytest.raises(TypeError, match="_Softmax: k must be a tensor, got NoneType"):
        _Softmax()(q, None, v)  # the default hole: as given, and validated


def test_a_part_that_never_holds_weights_refuses_them_and_is_not_asked_for_hooks():
    q, k, v = _inputs()
    part = _NoWeights()
    with pytest.raises(ValueError, match=r"_NoWeights does not return weights \(returns_w"):
        part(q, k, v, need_weights=True)
    assert part.refusal(weights=True) and _Softmax().refusal(weights=True) is None
    with ak.hooks.listen() as reports:
        out = part(q, k, v).context
    assert reports == []  # the part is not asked for weights it never holds
    torch.testing.assert_close(out, _softmax(q, k, v))
    with ak.hooks.listen() as reports:
        _Softmax()(q, k, v)
    assert len(reports) == 1


def test_a_sharded_part_keeps_its_rows_without_a_key_here():
    """A row whose keys are all on other ranks is the part's own; the template sets such a
    row to 0 for a part that holds every key."""
    q, k, v = _inputs()
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[1] = False  # query 1: no key here
    sharded = _Sharded()(q, k, v, mask=mask).context
    plain = _Softmax()(q, k, v, mask=mask).context
    assert torch.equal(sharded[..., 1, :], torch.ones_like(sharded[..., 1, :]))
    assert torch.equal(plain[..., 1, :], torch.zeros_like(plain[..., 1, :]))
    rows = [0, 2, 3, 4]
    torch.testing.assert_close(sharded[..., rows, :], _softmax(q, k, v, mask)[..., rows, :])


class _Agreeing(_Softmax):
    """Hands a refusal to the group (here: keeps it and returns a marker)."""

    def refused(self, error, q, k, v, **call):
        self.error, self.call = error, call
        return AttentionOutput(torch.full((1,), -1.0))


def test_a_refusal_before_attend_is_the_parts_to_give():
    """The default raises it; a part that agrees on refusals with a group is handed the error
    and the call (a bias it does not declare, a mask of the wrong dtype, an empty key set)."""
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="_Softmax does not declare accepts_bias"):
        _Softmax()(q, k, v, bias=torch.zeros(5, 5, dtype=D))
    part = _Agreeing()
    bias = torch.zeros(5, 5, dtype=D)
    assert part(q, k, v, bias=bias).context.item() == -1.0
    assert "does not declare accepts_bias" in str(part.error)
    assert part.call["bias"] is bias and part.call["mask"] is None
    part(q, k, v, mask=torch.ones(5, 5))
    assert isinstance(part.error, TypeError) and "mask must be boolean" in str(part.error)
    part(q, k[..., :0, :], v[..., :0, :])
    assert "the key set is empty" in str(part.error)
    part.error = None
    torch.testing.assert_close(part(q, k, v).context, _softmax(q, k, v))
    assert part.error is None


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_per_head_part_in_attnkit_runs_on_the_template():
    """No HeadAttention in attnkit overrides forward (the template's validation, masked-key
    exclusion, refusals and reports stay in one place) but those listed with a reason."""
    for module in pkgutil.walk_packages(ak.__path__, "attnkit."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    parts = {c for c in _subclasses(HeadAttention) if c.__module__.startswith("attnkit.")}
    assert len(parts) > 30  # every module was imported
    own = {c for c in parts if "forward" in vars(c)}
    named = {f"{c.__module__}.{c.__qualname__}" for c in own - set(OWN_FORWARD)}
    assert not named, f"parts that override forward instead of implementing attend: {named}"
    assert all(c in parts and "forward" in vars(c) for c in OWN_FORWARD)
