"""explain() names the kernel attention() runs and every other kernel's reasons: checked against
the kernel that actually runs (a spy on each kernel's attend), for every registered kernel (and a
kernel registered here) × calls that exercise each capability."""

from __future__ import annotations

import logging

import pytest
import torch

import attnkit as ak
from attnkit import kernels
from attnkit import patterns as pt
from attnkit.core import prepare_call
from attnkit.kernels import Call, Kernel, chunked, dense


class Toy(Kernel):
    """A kernel defined in this file alone: float64 on the CPU, short sequences, streaming
    alignments, no weights, no block mask, no dropout, an even number of keys."""

    name = "toy"
    priority = 99
    supports_dtypes = frozenset({torch.float64})
    supports_devices = frozenset({"cpu"})
    max_tokens = 8
    needs_streaming_alignment = True
    returns_weights = False
    accepts_block_mask = False
    accepts_dropout = False

    def extra_reasons(self, call: Call) -> list[str]:
        n = call.k.shape[-2]
        return [f"the toy kernel needs an even number of keys, got N = {n}"] if n % 2 else []

    def attend(self, call: Call) -> ak.AttentionOutput:
        return dense.Dense().attend(call)  # (not the registered instance, which tests spy on)


@pytest.fixture
def toy():
    table = kernels.REGISTRY.snapshot()
    kernels.register(Toy)  # the only step a new kernel needs
    yield
    kernels.REGISTRY.restore(table)


@pytest.fixture(params=[False, True], ids=["registered", "with-toy"])
def registered(request):
    """The registered kernels, and in the second run the toy kernel too."""
    if request.param:
        request.getfixturevalue("toy")


def _spy(monkeypatch) -> list[str]:
    """The names of the kernels whose attend runs from now on, in order."""
    names: list[str] = []
    for name in kernels.available():
        kernel = kernels.get(name)

        def spy(call, _name=name, _run=kernel.attend):
            names.append(_name)
            return _run(call)

        monkeypatch.setattr(kernel, "attend", spy)
    return names


def _case(name: str, dtype: torch.dtype):
    """(q, k, v, keyword arguments) of one call."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 6, 4, generator=g, dtype=dtype) for _ in range(3))
    kw: dict = {}
    if name == "mask":
        kw["mask"] = ak.masks.from_lengths(torch.tensor([6, 3]), 6)
    elif name == "bias":
        kw["bias"] = torch.randn(6, 6, generator=g, dtype=dtype)
    elif name == "block_mask":
        kw["block_mask"] = pt.block_mask(pt.causal(), 6)
    elif name == "score_mod":
        kw["score_mod"] = lambda e, b, h, i, j: e - 0.1 * (i - j).abs()
    elif name == "additive":
        kw["score"] = ak.scores.Additive(4, 4, 3).to(dtype)
    elif name == "multi_dimensional_score_mod":
        kw["score"] = ak.scores.Additive(4, 4, 3, d_out=4).to(dtype)
        kw["score_mod"] = lambda e, b, h, i, j: e
    elif name == "need_weights":
        kw["need_weights"] = True
    elif name == "sparsemax":
        kw["align"] = "sparsemax"
    elif name == "not_streaming":
        kw["align"] = ak.alignments.Entmax(1.5, learnable=True).to(dtype)
    elif name == "dropout":
        kw["dropout"] = 0.25
    elif name == "chunk_size":
        kw["chunk_size"] = 2
    elif name == "odd_keys":
        k, v = k[:, :5], v[:, :5]
    elif name == "long":
        k, v = torch.randn(2, 10, 4, dtype=dtype), torch.randn(2, 10, 4, dtype=dtype)
    elif name == "large":  # with DENSE_LIMIT lowered by the test: the chunked kernel prefers it
        kw["align"] = "sparsemax"
    return q, k, v, kw


CASES = [
    "plain",
    "mask",
    "bias",
    "block_mask",
    "score_mod",
    "additive",
    "multi_dimensional_score_mod",
    "need_weights",
    "sparsemax",
    "not_streaming",
    "dropout",
    "chunk_size",
    "odd_keys",
    "long",
    "large",
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_explain_names_the_kernel_that_runs(case, dtype, registered, monkeypatch):
    ran = _spy(monkeypatch)
    if case == "large":
        monkeypatch.setattr(chunked, "DENSE_LIMIT", 10)
    q, k, v, kw = _case(case, dtype)
    explained = kernels.explain(q, k, v, **kw)
    assert {x.kernel for x in explained.verdicts} == set(kernels.available())
    if explained.chosen is None:
        with pytest.raises(ValueError, match="can evaluate this call") as err:
            ak.attention(q, k, v, **kw)
        for verdict in explained.verdicts:  # every kernel's reasons are in the message
            for reason in explained.why_not(verdict.kernel):
                assert reason in str(err.value)
        assert ran == []
    else:
        ak.attention(q, k, v, **kw)
        assert ran == [explained.chosen]
        if explained.forced is None:
            # the kernels above the chosen one were passed over, each for a reason
            order = kernels.available()
            assert list(explained.skipped) == order[: order.index(explained.chosen)]
            assert all(explained.skipped.values())
        else:  # chunk_size= forces the chunked kernel
            assert case == "chunk_size" and explained.forced == "chunked"
            assert explained.skipped == {}
    # forcing each kernel: runs it when explain says it can, raises with its reasons otherwise
    for name in kernels.available():
        ran.clear()
        forced = kernels.explain(q, k, v, kernel=name, **kw)
        assert forced.forced == name
        reasons = forced.verdict(name).reasons
        if reasons:
            assert forced.chosen is None
            with pytest.raises(ValueError) as err:
                ak.attention(q, k, v, kernel=name, **kw)
            expected = f"kernel {name!r} cannot evaluate this call: " + "; ".join(reasons)
            assert str(err.value) == expected
        else:
            assert forced.chosen == name
            ak.attention(q, k, v, kernel=name, **kw)
            assert ran == [name]


def test_explain_of_a_call_equals_explain_of_its_arguments():
    q, k, v, kw = _case("mask", torch.float64)
    kw["align"] = "sparsemax"
    call = prepare_call(q, k, v, **kw)
    assert kernels.explain(call) == kernels.explain(q, k, v, **kw)
    assert kernels.explain(call, kernel="chunked").chosen == "chunked"
    with pytest.raises(TypeError, match="takes no k or v"):
        kernels.explain(call, k)
    with pytest.raises(ValueError, match="unknown kernel 'chunkd'; did you mean 'chunked'"):
        kernels.explain(q, k, v, kernel="chunkd")


def test_explanation_reads_as_a_table():
    q, k, v, _ = _case("plain", torch.float64)
    explained = kernels.explain(q, k, v, align="sparsemax")
    text = str(explained)
    assert explained.chosen == "dense"
    lines = text.splitlines()
    assert lines[0] == "kernel 'dense' evaluates this call (automatic selection, by priority)"
    assert len(lines) == 1 + len(kernels.available())
    sdpa_line = next(line for line in lines if line.strip().startswith("sdpa"))
    assert "not supported: the Sparsemax alignment is not softmax" in sdpa_line
    chunked_line = next(line for line in lines if line.strip().startswith("chunked"))
    assert "supported, but taken automatically only for a block mask" in chunked_line
    assert explained.why_not("dense") == []
    assert explained.skipped["sdpa"] == list(explained.verdict("sdpa").reasons)
    with pytest.raises(ValueError, match="not among the explained kernels"):
        explained.verdict("nope")
    # below the chosen kernel, priority is the reason
    plain = kernels.explain(q, k, v)
    assert plain.chosen == "sdpa"
    assert plain.why_not("dense") == ["supported, but 'sdpa' comes first by priority"]
    assert plain.skipped == {}


def test_a_kernel_registered_here_is_chosen_by_priority_and_explained(toy, monkeypatch):
    ran = _spy(monkeypatch)
    q, k, v, _ = _case("plain", torch.float64)
    assert kernels.available()[0] == "toy"
    assert kernels.explain(q, k, v).chosen == "toy"
    ak.attention(q, k, v)
    ak.attention(q, k, v, align="sparsemax")  # streams: the toy kernel takes it too
    assert ran == ["toy", "toy"]
    ran.clear()
    wide = torch.randn(2, 9, 4, dtype=torch.bfloat16)  # bf16, N = 9 > 8 and odd
    explained = kernels.explain(q.bfloat16(), wide, need_weights=True, align="hard")
    assert explained.why_not("toy") == [
        "the toy kernel takes float64 inputs, not bfloat16",
        "the toy kernel takes at most 8 queries and keys, got M = 6, N = 9",
        "the Hard alignment does not implement the streaming protocol "
        "(attnkit.alignments.streaming)",
        "the toy kernel does not return the weights (need_weights=True)",
        "the toy kernel needs an even number of keys, got N = 9",
    ]
    assert explained.chosen == "dense"
    assert "toy" in explained.skipped and "toy" in str(explained)
    with pytest.raises(ValueError) as err:
        ak.attention(q.bfloat16(), wide, need_weights=True, align="hard", kernel="toy")
    assert str(err.value).endswith("; ".join(explained.why_not("toy")))
    assert ran == []


def test_automatic_selection_logs_the_skipped_kernels(caplog):
    q, k, v, _ = _case("plain", torch.float64)
    with caplog.at_level(logging.DEBUG, logger="attnkit.kernels"):
        ak.attention(q, k, v, align="sparsemax")
    records = [r for r in caplog.records if r.name == "attnkit.kernels"]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG
    message = records[0].getMessage()
    assert message.startswith("kernel 'dense' chosen")
    for name, reasons in kernels.explain(q, k, v, align="sparsemax").skipped.items():
        assert f"{name!r} skipped: " + "; ".join(reasons) in message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="attnkit.kernels"):
        ak.attention(q, k, v, align="sparsemax")
    assert not [r for r in caplog.records if r.name == "attnkit.kernels"]
