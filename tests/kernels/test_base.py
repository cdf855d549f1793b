"""Kernels as registered parts: listing, forced and automatic selection with reasons, a new
kernel and a new streaming alignment added from this file alone."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit import kernels
from attnkit.alignments import Alignment, AlignOutput
from attnkit.alignments.streaming import Streaming
from attnkit.kernels import Call, Kernel, dense


def _call(**kw) -> Call:
    q, k = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    base = {
        "q": q,
        "k": k,
        "v": k,
        "score": ak.scores.ScaledDot(),
        "align": ak.alignments.Softmax(),
    }
    base.update(kw)
    m = 1 if base["q"] is None else base["q"].shape[-2]
    return Call(shape=torch.Size((2, m, base["k"].shape[-2])), **base)


def test_available_lists_the_kernels_by_priority():
    names = kernels.available()
    assert names.index("sdpa") < names.index("chunked") < names.index("dense")
    assert [kernels.get(n).priority for n in names] == sorted(
        (kernels.get(n).priority for n in names), reverse=True
    )
    assert kernels.get("dense").priority < kernels.get("chunked").priority


def test_unknown_kernel_names_the_closest():
    with pytest.raises(ValueError, match="did you mean 'chunked'"):
        kernels.get("chunkd")
    with pytest.raises(TypeError, match="kernel"):
        kernels.get(3)  # type: ignore[arg-type]


def test_automatic_selection():
    assert kernels.select(_call()).name == "sdpa"
    assert kernels.select(_call(need_weights=True)).name == "dense"
    assert kernels.select(_call(align=ak.alignments.Sparsemax())).name == "dense"
    assert kernels.select(_call(chunk_size=2)).name == "chunked"


def test_forced_kernel_that_cannot_run_gives_its_reasons():
    q = torch.randn(1, 3, 4)
    with pytest.raises(ValueError, match=r"kernel 'sdpa' cannot evaluate.*not in dot-product form"):
        ak.attention(q, q, score=ak.scores.Additive(4, 4, 3), kernel="sdpa")
    with pytest.raises(ValueError, match=r"does not return the weights"):
        ak.attention(q, q, kernel="sdpa", need_weights=True)
    with pytest.raises(ValueError, match=r"learned; the chunked kernel needs a fixed"):
        ak.attention(q, q, align=ak.alignments.Entmax(1.5, learnable=True), kernel="chunked")
    with pytest.raises(ValueError, match=r"chunked kernel does not apply dropout"):
        ak.attention(q, q, kernel="chunked", dropout=0.5)
    with pytest.raises(ValueError, match=r"unknown kernel 'flash'"):
        ak.attention(q, q, kernel="flash")


def test_every_kernel_agrees_with_dense_when_forced():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 6, 4), torch.randn(2, 6, 5)
    mask = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    ref = ak.attention(q, k, v, mask=mask, kernel="dense").context
    for name in ("sdpa", "chunked"):
        out = ak.attention(q, k, v, mask=mask, kernel=name).context
        torch.testing.assert_close(out, ref)


@pytest.fixture
def sandbox():
    """Kernels registered inside a test leave the registry as it was."""
    table = kernels.REGISTRY.snapshot()
    yield
    kernels.REGISTRY.restore(table)


def test_kernels_live_in_the_shared_registry():
    from attnkit.registry import Registry

    assert isinstance(kernels.REGISTRY, Registry) and kernels.REGISTRY in Registry.instances
    assert kernels.REGISTRY.get("dense") is dense.Dense
    assert dense.Dense.registered_name == "dense"
    assert isinstance(kernels.REGISTRY.build("dense"), dense.Dense)
    with pytest.raises(ValueError, match=r"unknown kernel 'dnse'; did you mean 'dense'"):
        kernels.REGISTRY.get("dnse")


def test_the_chosen_kernel_follows_the_table(sandbox):
    """REGISTRY.chosen(None) is the instance of the kernel selection tries first, chosen(name)
    the named one; both are looked up again once the table changes (a kernel registered with a
    higher priority takes over), and an unknown name fails as get does."""
    first = kernels.REGISTRY.available()[0]
    assert kernels.REGISTRY.chosen(None) is kernels.get(first)
    assert kernels.REGISTRY.chosen("dense") is kernels.get("dense")

    class Eager(dense.Dense):
        name = "eager_first"
        priority = 10_000

    kernels.register(Eager)
    assert isinstance(kernels.REGISTRY.chosen(None), Eager)
    assert kernels.REGISTRY.chosen("dense") is kernels.get("dense")
    with pytest.raises(ValueError, match=r"unknown kernel 'flash'"):
        kernels.REGISTRY.chosen("flash")


def test_registering_twice(sandbox):
    kernels.register(kernels.get("dense"))  # the same definition again: silent
    kernels.register(dense.Dense)
    assert kernels.get("dense").name == "dense"
    other = type("Dense", (Kernel,), {"name": "dense", "priority": 0, "__module__": "elsewhere"})
    with pytest.raises(ValueError, match="kernel 'dense' is already registered"):
        kernels.register(other)
    with pytest.raises(TypeError, match="Kernel subclass or instance"):
        kernels.register(dense.attend)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must set priority to an int"):
        kernels.register(type("NoPriority", (Kernel,), {"name": "no-priority"}))


class _Counting(Kernel):
    """A kernel defined in a test: evaluates densely and counts its calls."""

    name = "test-counting"
    priority = 99
    needs_dot_product_score = True
    calls = 0

    def prefers(self, call: Call) -> bool:
        return call.k.shape[-2] == 7  # only for N = 7

    def attend(self, call: Call):
        type(self).calls += 1
        return kernels.get("dense").attend(call)


def test_a_new_kernel_plugs_in_without_editing_attnkit(sandbox):
    kernels.register(_Counting())
    q = torch.randn(1, 2, 4)
    ak.attention(q, torch.randn(1, 7, 4))  # automatic: highest priority that prefers it
    assert _Counting.calls == 1
    ak.attention(q, torch.randn(1, 5, 4))
    assert _Counting.calls == 1
    with pytest.raises(ValueError, match="Additive score is not in dot-product form"):
        ak.attention(q, q, score=ak.scores.Additive(4, 4, 3), kernel="test-counting")


def _probe(**capabilities) -> Kernel:
    """An unregistered kernel with the given capabilities (the others at their defaults)."""
    return type("Probe", (Kernel,), {"name": "probe", "priority": -1, **capabilities})()


def _learned_entmax():
    return ak.alignments.Entmax(1.5, learnable=True)


def _key_mixing():
    return ak.scores.Convolutional(4)


# (capability, value that refuses, value that accepts, what the call uses, the reason's words)
CAPABILITIES = [
    ("supports_dtypes", frozenset({torch.float64}), None, {}, "takes float64 inputs, not float32"),
    ("supports_devices", frozenset({"cuda"}), None, {}, "runs on cuda, not on cpu"),
    ("max_tokens", 4, 5, {}, "at most 4 queries and keys, got M = 3, N = 5"),
    (
        "needs_dot_product_score",
        True,
        False,
        {"score": ak.scores.Additive(4, 4, 3)},
        "the Additive score is not in dot-product form",
    ),
    (
        "supports_multi_dimensional",
        False,
        True,
        {"score": ak.scores.Additive(4, 4, 3, d_out=4)},
        "does not evaluate multi-dimensional scores",
    ),
    (
        "needs_softmax",
        True,
        False,
        {"align": ak.alignments.Sparsemax()},
        "the Sparsemax alignment is not softmax with a constant temperature",
    ),
    (
        "needs_streaming_alignment",
        True,
        False,
        {"align": ak.alignments.Hard()},
        "the Hard alignment does not implement the streaming protocol",
    ),
    (
        "masks_key_mixing_scores",
        False,
        True,
        {"q": None, "score": _key_mixing(), "mask": torch.ones(5, dtype=torch.bool)},
        "score Convolutional mixes neighbouring keys",
    ),
    ("returns_weights", False, True, {"need_weights": True}, "does not return the weights"),
    ("accepts_mask", False, True, {"mask": torch.ones(5, dtype=torch.bool)}, "takes no mask"),
    ("accepts_bias", False, True, {"bias": torch.zeros(3, 5)}, "takes no bias"),
    (
        "accepts_block_mask",
        False,
        True,
        {"block_mask": "causal"},
        "takes no block mask (block masks and score_mod run on the chunked",
    ),
    (
        "accepts_score_mod",
        False,
        True,
        {"score_mod": lambda e, b, h, i, j: e},
        "takes no score_mod (score_mod runs on the chunked",
    ),
    ("accepts_dropout", False, True, {"dropout": 0.25}, "does not apply dropout (dropout=0.25)"),
    ("accepts_chunk_size", False, True, {"chunk_size": 2}, "chunk_size is not an argument"),
    (
        "needs_equal_head_sizes",
        True,
        False,
        {"v": torch.randn(2, 5, 3)},
        "needs as many value features as query and key features (d_v = 3, d = 4)",
    ),
    ("needs_block_mask", True, False, {}, "evaluates block-sparse calls only (a block_mask)"),
    (
        "gradients",
        "inputs",
        "all",
        {"bias": torch.zeros(3, 5, requires_grad=True)},
        "gives gradients for q, k and v only",
    ),
    (
        "gradients",
        "none",
        "inputs",
        {"q": torch.randn(2, 3, 4, requires_grad=True)},
        "gives no gradients (one is required)",
    ),
]


@pytest.mark.parametrize("capability", CAPABILITIES, ids=[c[0] for c in CAPABILITIES])
def test_each_unmet_capability_gives_one_reason(capability):
    attr, refuses, accepts, kw, words = capability
    kw = dict(kw)
    if kw.get("block_mask") == "causal":
        from attnkit import patterns as pt

        kw["q"] = torch.randn(2, 5, 4)
        kw["block_mask"] = pt.block_mask(pt.causal(), 5)
    call = _call(**kw)
    reasons = _probe(**{attr: refuses}).reasons_not_supported(call)
    assert len(reasons) == 1 and words in reasons[0], reasons
    assert _probe(**{attr: accepts}).reasons_not_supported(call) == []
    if kw:  # a call that does not use the capability is not refused for it
        assert _probe(**{attr: refuses}).reasons_not_supported(_call()) == []


def test_score_mod_on_a_multi_dimensional_score_is_refused_by_every_kernel():
    call = _call(score=ak.scores.Additive(4, 4, 3, d_out=4), score_mod=lambda e, b, h, i, j: e)
    for name in kernels.available():
        kernel = kernels.get(name)
        reasons = kernel.reasons_not_supported(call)
        assert reasons
        if kernel.accepts_score_mod and kernel.supports_multi_dimensional:
            assert any("single-dimensional" in r for r in reasons)
    assert any("single-dimensional" in r for r in kernels.get("dense").reasons_not_supported(call))
    with pytest.raises(ValueError, match=r"no registered kernel can evaluate this call.*'dense'"):
        ak.attention(call.q, call.k, score=call.score, score_mod=call.score_mod)


def test_extra_reasons_follow_the_capability_reasons():
    class Picky(Kernel):
        name = "picky"
        priority = 0
        returns_weights = False

        def extra_reasons(self, call: Call) -> list[str]:
            return ["odd key count"] if call.k.shape[-2] % 2 else []

    reasons = Picky().reasons_not_supported(_call(need_weights=True))
    assert reasons == [
        "the picky kernel does not return the weights (need_weights=True)",
        "odd key count",
    ]


class NormalisedSigmoid(Streaming, Alignment):
    """A toy streaming alignment: a_l = σ(e_l) / Σ_j σ(e_j).

    Streaming: statistic log Σ σ(e); weights σ(e)/Z; backward: ∂a_l/∂e_j = σ'(e_l)/Z·δ_lj −
    a_l σ'(e_j)/Z, so ∂L/∂e = s ⊙ (∂L/∂a − Σ_l a_l ∂L/∂a_l) with s = σ'(e)/Z and r = a.
    """

    label = ak.taxonomy.AlignmentKind.GLOBAL

    def forward(self, scores, mask=None, *, query=None):
        w = torch.sigmoid(scores)
        if mask is not None:
            w = torch.where(mask, w, 0.0)
        total = w.sum(-1, keepdim=True)
        return AlignOutput(w / torch.where(total > 0, total, 1.0))

    def stream_statistic(self, tiles):
        return torch.log(sum(torch.sigmoid(e).sum(-1, keepdim=True) for e in tiles()))

    def stream_weights(self, e, stat):
        return torch.sigmoid(e) / stat.exp()

    def stream_slope(self, p, stat):
        # σ' = σ(1 − σ) = (pZ)(1 − pZ); s = σ'/Z
        z = stat.exp()
        return p * (1 - p * z), p


@pytest.mark.parametrize("chunk", [1, 2, 5, 16])
def test_a_streaming_alignment_defined_here_runs_chunked_exactly(chunk):
    torch.manual_seed(1)
    align = NormalisedSigmoid()
    score = ak.scores.Additive(4, 4, 6).double()
    q = torch.randn(2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 9, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 9, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 5, 9) > 0.3
    mask[1, 2] = False
    # reference: the formula, written out densely
    e = score(q, k)
    sig = torch.where(mask, torch.sigmoid(e), 0.0)
    total = sig.sum(-1, keepdim=True)
    ref = (sig / torch.where(total > 0, total, 1.0)) @ v
    out = ak.attention(q, k, v, score=score, align=align, mask=mask, chunk_size=chunk)
    torch.testing.assert_close(out.context, ref)
    r = torch.randn_like(ref)
    wrt = [q, k, v, *score.parameters()]
    g_out = torch.autograd.grad((out.context * r).sum(), wrt)
    g_ref = torch.autograd.grad((ref * r).sum(), wrt)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b)
    assert math.isclose(float(out.context[1, 2].detach().abs().sum()), 0.0)


def test_equal_head_sizes_are_read_from_the_score_dot_form():
    """A score whose dot form projects the keys compares them at its own width: d_v is
    checked against that width, not against d_k."""
    score = ak.scores.build("general", d_q=4, d_k=6)
    q, k = torch.randn(2, 3, 4), torch.randn(2, 5, 6)
    assert kernels.base.head_size(_call(q=q, k=k, v=k, score=score)) == 6
    probe = _probe(needs_equal_head_sizes=True)
    assert probe.reasons_not_supported(_call(q=q, k=k, v=k, score=score)) == []
    reasons = probe.reasons_not_supported(_call(q=q, k=k, v=torch.randn(2, 5, 4), score=score))
    assert reasons == [
        "the probe kernel needs as many value features as query and key features (d_v = 4, d = 6)"
    ]


def test_runs_compiled_refuses_inside_torch_compile():
    from unittest import mock

    probe = _probe(runs_compiled=False)
    assert probe.reasons_not_supported(_call()) == []
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        reasons = probe.reasons_not_supported(_call())
    assert reasons == ["the probe kernel does not run inside torch.compile"]
