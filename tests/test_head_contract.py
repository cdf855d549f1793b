"""The contract every per-head attention part meets (DESIGN 8, 9), over every part from the
per-head registry alone (:mod:`attnkit.head_registry`, and the causal form of each part with a
``causal`` flag), :class:`attnkit.Attention`, and two parts written here from
:class:`attnkit.HeadAttention`'s docstring alone: a minimal one (key masks and ``attend``,
nothing else) and one declaring every mask form, a bias and decoding. A part registered in one
file gets every check below with no list to update, and the minimal parts show that the base's
defaults make a part correct without knowing attnkit's internals.

Each part is built by its class's ``for_heads`` (E = 8, H = 2, d = 4, at most 8 keys) in
float64; inputs are q, k (2, H, 6, 4) and v (2, H, 6, 3), so that d_v ≠ d_k. The expectations
come from the equations, not from the part: masking a key is removing it (Brauwers eq. 4 sums
over the keys there are), what a padded key holds reaches nothing, a query without keys gets 0
(DESIGN 2), weights from a normalized alignment sum to 1 over the keys, a call asking for what
the part does not declare is refused with the capability named.

Properties inside :class:`attnkit.MultiHeadAttention` (padding equals truncation in every mask
form, float32 vs float64, ...) are in ``tests/test_slot_properties.py``; the base class's own
template and helpers in ``tests/test_head.py``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import attnkit as ak
from attnkit import head_registry
from attnkit.head import MASK_FORMS, HeadAttention
from attnkit.kv_cache import LayerCache

E, H, D, DV, N, MAX_LEN = 8, 2, 4, 3, 6, 8
F64 = torch.float64


class MinimalPart(ak.HeadAttention):
    """ReLU attention, w_ij = relu(q_i·k_j/√d), written from HeadAttention's docstring alone:
    it declares the mask forms it honours and implements attend(), and does nothing else (no
    validation, no care for NaN in padding or for queries without keys, no hooks)."""

    mask_forms = frozenset({"key"})

    def attend(self, q, k, v, *, mask, bias, need_weights):
        w = torch.relu(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5)
        if mask is not None:
            w = w * mask
        return ak.AttentionOutput(w @ v, w)


class EveryFormPart(MinimalPart):
    """The same, honouring every mask form and a bias, and decoding with a cache (each weight
    reads one query and one key)."""

    causal_form = True
    decodes_with_cache = True
    accepts_bias = True
    mask_forms = frozenset({"key", "padding", "causal", "full"})

    def attend(self, q, k, v, *, mask, bias, need_weights):
        e = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        w = torch.relu(e if bias is None else e + bias)
        if mask is not None:
            w = w * mask
        return ak.AttentionOutput(w @ v, w)


LOCAL = {"attention": ak.Attention, "minimal": MinimalPart, "every form": EveryFormPart}
REGISTERED = head_registry.available()


def _class(name: str) -> type[HeadAttention]:
    base = name.partition(" (")[0]
    return LOCAL[base] if base in LOCAL else head_registry.REGISTRY.get(base)


def _takes_causal(name: str) -> bool:
    return "causal" in inspect.signature(head_registry.REGISTRY.get(name)).parameters


PARTS = [*LOCAL, *REGISTERED, *[f"{n} (causal)" for n in REGISTERED if _takes_causal(n)]]


def _build(name: str) -> HeadAttention:
    torch.manual_seed(0)
    extra = {"causal": True} if name.endswith(" (causal)") else {}
    if name == "attention":
        part = ak.Attention()
    else:
        part = _class(name).for_heads(
            embed_dim=E, num_heads=H, head_dim=D, max_len=MAX_LEN, **extra
        )
    return part.double().eval()


def _dv(part) -> int:
    """The values' size for ``part``: DV ≠ D, unless it declares values of head_dim only."""
    return DV if part.any_value_size else D


def _inputs(part, seed: int = 0, n: int = N, b: int = 2) -> list[torch.Tensor]:
    """q, k (b, H, n, D) and v (b, H, n, d_v) for ``part``, standard normal from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, H, n, size, generator=g, dtype=F64) for size in (D, D, _dv(part))]


def _call(part, q, k, v, **kw):
    torch.manual_seed(1234)  # a part drawing at call time draws the same
    with torch.no_grad():
        return part(q, k, v, **kw)


def _causal(part) -> bool:
    """Whether the part attends causally by construction (its own causal mode)."""
    return getattr(part, "causal", False) is True


def _padding(lengths) -> torch.Tensor:
    """The key padding mask (2, 1, 1, N) of ``lengths``."""
    return ak.masks.from_lengths(torch.tensor(lengths), N)[:, None]


def _is_attention_output(out) -> bool:
    """Exactly an AttentionOutput (a part that computes more weights names them in ``extra``),
    whose ``extra``, if any, maps names to tensors."""
    if type(out) is not ak.AttentionOutput:
        return False
    extra = {} if out.extra is None else out.extra
    return isinstance(extra, dict) and all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in extra.items()
    )


def _assert_rows_equal(a, b, what):
    assert torch.isfinite(a).all(), f"{what}: not finite"
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=what)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_per_head_part_in_attnkit_is_registered_as_one():
    """Every concrete HeadAttention in attnkit is in the per-head registry (or is a base,
    needs a process group, or is the default part), so that this suite covers it; and a
    registered mechanism with the attention-slot call is a per-head part."""
    for name in ak.mechanisms.REGISTRY.own():
        cls = ak.mechanisms.REGISTRY.get(name)
        params = inspect.signature(cls.forward).parameters
        if all(p in params for p in ("q", "k", "v", "mask", "bias", "need_weights")):
            assert issubclass(cls, HeadAttention), name
    registered = {head_registry.REGISTRY.get(n) for n in REGISTERED}
    assert all(issubclass(cls, HeadAttention) for cls in registered)
    bases = {"_SpanPart", "LinearFamilyPart", "_DecayFamily", "LandmarkAttention"}
    # tested in tests/distributed with a process group
    needs_a_group = {"RingAttention", "RingLinearAttention"}
    for cls in _subclasses(HeadAttention):
        if not cls.__module__.startswith("attnkit.") or cls is ak.Attention:
            continue
        if cls.__name__ in bases | needs_a_group:
            continue
        assert cls in registered, f"{cls.__module__}.{cls.__qualname__} is not registered"


def test_every_part_declares_the_sizes_its_constructor_requires():
    """for_heads builds every registered part from its declaration alone (the suite's own
    builds go through it too); a required constructor argument is a declared size."""
    for name in REGISTERED:
        cls = head_registry.REGISTRY.get(name)
        if "for_heads" in vars(cls):
            continue  # builds itself
        required = [
            key
            for key, p in inspect.signature(cls).parameters.items()
            if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        assert set(required) <= set(cls.size_arguments), (name, required, cls.size_arguments)


@pytest.mark.parametrize("name", [*LOCAL, *REGISTERED])
def test_the_example_runs_and_is_the_registry_example(name):
    cls = _class(name)
    module, args, kwargs = cls.example()
    assert isinstance(module, cls) and len(args) == 3
    out = module(*args, **kwargs)
    assert _is_attention_output(out), type(out).__name__
    assert out.context.shape == (*args[0].shape[:-1], args[2].shape[-1])
    if name in REGISTERED:
        again, again_args, again_kwargs = head_registry.example(name)
        assert type(again) is cls and len(again_args) == 3 and set(again_kwargs) == set(kwargs)


@pytest.mark.parametrize("name", PARTS)
def test_output_is_an_attention_output_of_the_values_size_and_gradients_flow(name):
    """context (…, M, d_v) with d_v ≠ d_k, weights (…, M, N) when asked for and only then."""
    part = _build(name)
    q, k, v = (x.requires_grad_() for x in _inputs(part))
    out = part(q, k, v)
    assert _is_attention_output(out), type(out).__name__
    assert out.context.shape == (2, H, N, _dv(part)) and out.context.dtype == F64
    assert out.weights is None, "weights were not requested"
    (out.context * torch.linspace(-1, 1, _dv(part), dtype=F64)).sum().backward()
    for x, what in ((q, "q"), (k, "k"), (v, "v")):
        assert x.grad is None or torch.isfinite(x.grad).all(), f"{what}: gradient not finite"
    assert v.grad is not None and v.grad.abs().sum() > 0, "no gradient reaches the values"
    for pname, p in part.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), pname
    with torch.no_grad():
        weighted = part(q, k, v, need_weights=part.returns_weights)
    assert _is_attention_output(weighted), type(weighted).__name__
    torch.testing.assert_close(weighted.context, out.context.detach(), rtol=1e-12, atol=1e-12)
    # (…, M, N), or over what the part attends (areas of keys) for a part that names it
    assert weighted.weights is None or weighted.weights.shape[:-1] == (2, H, N)
    for wname, w in weighted.named_weights().items():  # per item and head, as the inputs
        assert w.shape[:2] == (2, H), wname


@pytest.mark.parametrize("name", [n for n in PARTS if not _class(n).any_value_size])
def test_a_part_for_values_of_head_dim_refuses_other_values_naming_them(name):
    part = _build(name)
    q, k, v = _inputs(part)
    with pytest.raises(ValueError, match=r"\bv\b.*\(2, 2, 6, 3\)"):
        _call(part, q, k, v[..., :DV])


@pytest.mark.parametrize("name", PARTS)
def test_key_padding_equals_truncation(name):
    """Each item with its keys after its length masked equals the item alone with those keys
    removed (the queries too, for a part causal by construction, whose rows past the length
    are padding)."""
    part = _build(name)
    q, k, v = _inputs(part, 1)
    for lengths in ((1, 4),):
        out = _call(part, q, k, v, mask=_padding(lengths)).context
        for b, n in enumerate(lengths):
            m = n if _causal(part) else N
            alone = _call(part, q[b : b + 1, :, :m], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
            got = out[b : b + 1, :, :m]
            _assert_rows_equal(got, alone.context, f"{name}: lengths {lengths}, item {b}")


@pytest.mark.parametrize("name", PARTS)
def test_nan_in_padded_keys_reaches_neither_the_output_nor_the_gradients(name):
    part = _build(name)
    pad = _padding((N, 4))
    r = torch.randn(2, H, N, _dv(part), dtype=F64, generator=torch.Generator().manual_seed(9))
    results = []
    for dirty in (False, True):
        q, k, v = _inputs(part, 2)
        if dirty:  # item 1 has 4 keys: NaN in everything after them
            k[1, :, 4:], v[1, :, 4:] = float("nan"), float("nan")
        for x in (q, k, v):
            x.requires_grad_()
        torch.manual_seed(1234)
        out = part(q, k, v, mask=pad).context
        (out * r).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    (clean, *clean_grads), (out, *grads) = results
    _assert_rows_equal(out, clean, f"{name}: output")
    for what, got, want in zip("qkv", grads, clean_grads, strict=True):
        if want is None:
            assert got is None, what
            continue
        _assert_rows_equal(got, want, f"{name}: gradient of {what}")
        assert torch.equal(got[1, :, 4:], torch.zeros_like(got[1, :, 4:])) or what == "q", what


@pytest.mark.parametrize("name", PARTS)
def test_a_query_without_keys_gets_zero(name):
    """Item 1's keys all masked: context 0 and weights 0, never NaN, and finite gradients."""
    part = _build(name)
    q, k, v = (x.requires_grad_() for x in _inputs(part, 3))
    mask = torch.ones(2, 1, 1, N, dtype=torch.bool)
    mask[1] = False
    torch.manual_seed(1234)
    out = part(q, k, v, mask=mask, need_weights=part.returns_weights)
    assert torch.isfinite(out.context).all()
    assert torch.equal(out.context[1], torch.zeros_like(out.context[1]))
    if not _causal(part):  # item 0 is untouched by item 1's mask
        _assert_rows_equal(out.context[:1], _call(part, q[:1], k[:1], v[:1]).context, name)
    for wname, w in out.named_weights().items():
        assert torch.equal(w[1], torch.zeros_like(w[1])), wname
    out.context.sum().backward()
    for x, what in ((q, "q"), (k, "k"), (v, "v")):
        assert x.grad is None or torch.isfinite(x.grad).all(), what


@pytest.mark.parametrize("name", PARTS)
def test_float64_calls_are_deterministic(name):
    """The same inputs give the same output, bit for bit, in eval mode (nothing drawn anew)."""
    part = _build(name)
    q, k, v = _inputs(part, 4)
    pad = _padding((N, 4))
    with torch.no_grad():
        first = part(q, k, v, mask=pad, need_weights=part.returns_weights)
        second = part(q, k, v, mask=pad, need_weights=part.returns_weights)
    assert torch.equal(first.context, second.context)
    for (wname, w), w2 in zip(
        first.named_weights().items(), second.named_weights().values(), strict=True
    ):
        assert torch.equal(w, w2), wname


@pytest.mark.parametrize("name", PARTS)
def test_an_empty_batch_gives_an_empty_output(name):
    part = _build(name)
    q, k, v = _inputs(part, 5, b=0)
    pad = torch.ones(0, 1, 1, N, dtype=torch.bool)
    for mask in (None, pad):
        out = _call(part, q, k, v, mask=mask, need_weights=part.returns_weights)
        assert out.context.shape == (0, H, N, _dv(part)), mask
        assert out.weights is None or out.weights.shape[:-1] == (0, H, N)


@pytest.mark.parametrize("name", PARTS)
def test_what_a_part_does_not_declare_is_refused_naming_the_capability(name):
    """A bias, a block mask, a score_mod, a cache or a query offset given to a part that does
    not declare it raises ValueError naming the part and the capability."""
    part = _build(name)
    q, k, v = _inputs(part, 6)
    bias = torch.zeros(N, N, dtype=F64)
    who = type(part).__name__
    if not part.accepts_bias:
        with pytest.raises(ValueError, match=f"{who} does not declare accepts_bias"):
            _call(part, q, k, v, bias=bias)
    else:
        assert _call(part, q, k, v, bias=bias).context.shape == (2, H, N, _dv(part))
    if type(part).forward is not HeadAttention.forward:
        return  # a part with a forward of its own takes only the keywords it declares
    for flag, call in (
        ("accepts_block_mask", {"block_mask": object()}),
        ("accepts_score_mod", {"score_mod": lambda e, b, h, i, j: e}),
        ("decodes_with_cache", {"cache": object()}),
        ("takes_q_offset", {"q_offset": 2}),
    ):
        if getattr(part, flag) or (flag == "takes_q_offset" and part.decodes_with_cache):
            continue
        if flag == "decodes_with_cache" and part.takes_cache:
            continue
        with pytest.raises(ValueError, match=f"{who} does not declare {flag}"):
            _call(part, q, k, v, **call)


@pytest.mark.parametrize(
    "name", [n for n in PARTS if _class(n).normalized_weights and _class(n).returns_weights]
)
def test_weights_declared_normalized_sum_to_one(name):
    """Each row over the keys sums to 1, and is 0 where every key is masked (DESIGN 2)."""
    part = _build(name)
    q, k, v = _inputs(part, 7)
    out = _call(part, q, k, v, mask=_padding((N, 4)), need_weights=True)
    assert out.weights is not None, "a part that normalizes returns its weights when asked"
    sums = out.weights.sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), rtol=1e-9, atol=1e-9)
    assert torch.equal(out.weights[1, ..., 4:], torch.zeros_like(out.weights[1, ..., 4:]))
    empty = torch.ones(2, 1, 1, N, dtype=torch.bool)
    empty[1] = False
    w = _call(part, q, k, v, mask=empty, need_weights=True).weights
    torch.testing.assert_close(w[0].sum(-1), torch.ones_like(w[0].sum(-1)), rtol=1e-9, atol=1e-9)
    assert torch.equal(w[1], torch.zeros_like(w[1]))


def _perturbed(x, where):
    """x (2, H, N, ·) with other values at the positions ``where`` (N,) of item 1."""
    other = x.clone()
    other[1][:, where] = torch.randn_like(other[1][:, where]) * 3
    return other


@pytest.mark.parametrize("name", PARTS)
def test_declared_mask_forms_are_honoured_and_others_refused(name):
    part = _build(name)
    q, k, v = _inputs(part, 1)
    forms = part.mask_forms
    assert forms <= set(MASK_FORMS) and "key" in forms, forms
    pad = _padding((N, 4))
    later = torch.arange(N) >= 4
    # "key": what a padded key holds reaches nothing
    out = _call(part, q, k, v, mask=pad).context
    moved = _call(part, q, _perturbed(k, later), _perturbed(v, later), mask=pad).context
    _assert_rows_equal(moved, out, f"{name}: padded keys leak")
    rows = pad & pad.transpose(-1, -2)  # key ∧ query padding
    causal = ak.masks.causal(N)
    g = torch.Generator().manual_seed(2)
    full = (torch.rand(N, N, generator=g) < 0.5) | torch.eye(N, dtype=torch.bool)
    full[2] = False  # a row that may attend nothing
    for form, mask in (("padding", rows), ("causal", causal), ("full", full)):
        if form in forms:
            continue
        with pytest.raises(ValueError, match="mask"):
            _call(part, q, k, v, mask=mask)
    if "padding" in forms:  # what a padded token holds reaches no real row
        out = _call(part, q, k, v, mask=rows).context
        x = [_perturbed(t, later) for t in (q, k, v)]
        _assert_rows_equal(_call(part, *x, mask=rows).context[1, :, :4], out[1, :, :4], name)
    causal_by_mask = forms & {"causal", "full"}
    if causal_by_mask or _causal(part):
        assert part.causal_form, f"{name} attends causally but does not declare causal_form"
        mask = causal if causal_by_mask else None
        out = _call(part, q, k, v, mask=mask).context
        x = [_perturbed(t, torch.arange(N) >= 3) for t in (q, k, v)]
        _assert_rows_equal(_call(part, *x, mask=mask).context[..., :3, :], out[..., :3, :], name)
    if "full" in forms:
        out = _call(part, q, k, v, mask=full).context
        assert torch.isfinite(out).all()
        _assert_rows_equal(out[..., 2, :], torch.zeros_like(out[..., 2, :]), f"{name}: empty row")


@pytest.mark.parametrize("name", PARTS)
def test_a_bias_is_honoured_when_declared_and_refused_otherwise(name):
    part = _build(name)
    q, k, v = _inputs(part, 3)
    bias = torch.randn(2, H, N, N, dtype=F64, generator=torch.Generator().manual_seed(4))
    mha = ak.MultiHeadAttention(E, H, attention=part).double().eval()
    x = torch.randn(2, N, E, dtype=F64)
    if part.accepts_bias:
        assert part.refusal(bias=True) is None
        plain = _call(part, q, k, v).context
        assert not torch.allclose(_call(part, q, k, v, bias=3 * bias).context, plain)
        assert torch.isfinite(mha(x, bias=bias[0, 0]).context).all()
        return
    assert type(part).__name__ in part.refusal(bias=True)
    with pytest.raises(ValueError, match="bias"):
        _call(part, q, k, v, bias=bias)
    with pytest.raises(ValueError, match=f"{type(part).__name__} does not declare accepts_bias"):
        mha(x, bias=bias[0, 0])


@pytest.mark.parametrize("name", PARTS)
def test_a_kv_cache_equals_the_causal_pass_when_declared_and_is_refused_otherwise(name):
    part = _build(name)
    mha = ak.MultiHeadAttention(E, H, attention=part).double().eval()
    x = torch.randn(1, 5, E, dtype=F64, generator=torch.Generator().manual_seed(5))
    if not part.decodes_with_cache:
        assert "decodes_with_cache" in part.refusal(cache=True)
        with pytest.raises(ValueError, match="decodes_with_cache"):
            mha(x[:, :2], cache=LayerCache())
        return
    assert part.refusal(cache=True) is None
    causal_by_mask = part.mask_forms & {"causal", "full"}
    mask = ak.masks.causal(5) if causal_by_mask and not _causal(part) else None
    with torch.no_grad():
        whole = mha(x, mask=mask).context
        cache = LayerCache()
        steps = [mha(x[:, :2], cache=cache, mask=None if mask is None else mask[:2, :2]).context]
        steps += [mha(x[:, t : t + 1], cache=cache).context for t in range(2, 5)]
    _assert_rows_equal(torch.cat(steps, 1), whole, f"{name}: cached steps vs causal pass")


@pytest.mark.parametrize("name", PARTS)
def test_block_masks_and_score_mods_are_refused_unless_declared(name):
    from attnkit import patterns as pt

    part = _build(name)
    x = torch.randn(2, N, E, dtype=F64)
    for flag, layer in (
        ("accepts_score_mod", {"score_mod": lambda e, b, h, i, j: e}),
        ("accepts_block_mask", {"pattern": pt.sliding_window(2)}),
    ):
        if getattr(part, flag):
            mha = ak.MultiHeadAttention(E, H, attention=part, **layer).double().eval()
            assert torch.isfinite(mha(x).context).all()
        else:
            with pytest.raises(ValueError, match=f"{type(part).__name__} does not declare {flag}"):
                ak.MultiHeadAttention(E, H, attention=part, **layer)


def _takes_dtype(name: str) -> bool:
    return "dtype" in inspect.signature(_class(name)).parameters


@pytest.mark.parametrize("name", [n for n in PARTS if n not in LOCAL and _takes_dtype(n)])
def test_a_part_cast_to_float64_holds_the_buffers_of_one_built_in_float64(name):
    """Buffers derived from hyperparameters (decays, seeded random features) are exact after
    ``.double()``, not the float32 values cast (attnkit.derived)."""
    extra = {"causal": True} if name.endswith(" (causal)") else {}
    sizes = {"embed_dim": E, "num_heads": H, "head_dim": D, "max_len": MAX_LEN, **extra}
    torch.manual_seed(0)
    cast = _class(name).for_heads(**sizes).double()
    torch.manual_seed(0)
    built = _class(name).for_heads(**sizes, dtype=F64)
    for (key, x), (_, y) in zip(cast.named_buffers(), built.named_buffers(), strict=True):
        if x.is_floating_point():
            assert x.dtype == y.dtype == F64, f"{name}: {key}"
            assert torch.equal(x, y), f"{name}: {key} differs by {(x - y).abs().max().item()}"
