"""The kernel-path sweep: every registered kernel, and every path inside one, forced on a grid of
calls and compared with the dense reference kernel evaluated in float64 on the same inputs.

A target is a kernel (``select(call, kernel=name)``: the kernel picks its own path) or one
path of a kernel (:meth:`attnkit.kernels.Path.run`). The grid crosses score × alignment (every
registered example), mask forms (none, key padding, causal, a full boolean mask with a fully
masked row, a block mask built from a pattern with blocks that do not divide the sizes, a block
mask with key padding, a dense mask large enough to be turned into a block mask), d_v ≠ d_k,
B = 0 and M = 0, a bias with rows offset by ±1e4 or a row pushed to −1e9, gradients, and
float64 / float32 / bfloat16. On each case a target either declares the call (its reasons are
empty) and then equals the reference within its dtype's tolerance, or refuses it with a
ValueError that names it. A fixed-seed sample of the grid runs by default; the whole grid is
marked slow. A deliberately wrong kernel (its scale dropped) fails the sweep.
"""

from __future__ import annotations

import copy
import itertools
import random
from dataclasses import dataclass, replace
from unittest import mock

import pytest
import torch
from registered_parts import ALIGNMENTS, SCORES, Dims, build_attention, registered

import attnkit as ak
from attnkit import kernels
from attnkit import patterns as pt
from attnkit.core import prepare_call
from attnkit.kernels import Call, Kernel, chunked, dense, flex

D = 4  # query and key features
HEADS = 2
DTYPES = (torch.float64, torch.float32, torch.bfloat16)
# context tolerance against the float64 reference, relative to 1 + max |reference|
TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 4e-2}
# a row offset of 1e4 rounds the scores by 1e4·eps of the dtype: the weights move with it
OFFSET_TOL = {torch.float64: 1e-8, torch.float32: 5e-3, torch.bfloat16: 1e-1}
GRAD_TOL = {torch.float64: 1e-7, torch.float32: 2e-3}
SIZES = ((37, 45), (45, 45), (1, 19), (0, 9))
BATCHES = (0, 1, 2)
MASKS = ("none", "padding", "causal", "full", "block", "block+padding", "auto")
EXTRAS = ("none", "bias", "offset", "sink")
BLOCKS = ((8, 8), (5, 7))
PATTERNS = {
    "window": pt.sliding_window(6),
    "rows with no key": lambda b, h, i, j: (j <= i) & (i % 9 != 4),
}
AUTO_N = 1100  # a dense mask from 9 blocks of 128 a side on is evaluated block-sparsely
PAIRS = list(itertools.product(sorted(SCORES), sorted(ALIGNMENTS)))
# alignments that pick an argmax or a sample: not continuous in the scores
DISCONTINUOUS = {"hard", "reinforced"}


def targets() -> list[tuple[str, str | None]]:
    """Every registered kernel, and every path of each."""
    out = []
    for name in kernels.available():
        out.append((name, None))
        out.extend((name, path.name) for path in kernels.get(name).paths)
    return out


def _target_id(target: tuple[str, str | None]) -> str:
    return target[0] if target[1] is None else f"{target[0]}.{target[1]}"


@dataclass(frozen=True)
class Case:
    score: str
    align: str
    dtype: torch.dtype
    b: int
    m: int
    n: int
    mask: str
    d_v: int
    extra: str
    grad: bool
    blocks: tuple[int, int]
    pattern: str
    seed: int

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.score}×{self.align} {dtype} B={self.b} M={self.m} N={self.n} "
            f"mask={self.mask}({self.pattern}, {self.blocks}) d_v={self.d_v} "
            f"extra={self.extra} grad={self.grad}"
        )


def _fast(pair: tuple[str, str]) -> bool:
    """Whether the pair is dot-product softmax attention (what the fused paths serve)."""
    att = build_attention(*pair, Dims(max_len=64))
    return att.score.dot_product_form and att.align.softmax_temperature() is not None


FAST_PAIRS = [pair for pair in PAIRS if _fast(pair)]


def _grid() -> list[Case]:
    """The whole grid (the slow run): every pair × mask form × dtype, the other dimensions
    (sizes, batch, d_v, bias, gradients, blocks, pattern) cycled through so that each of their
    values meets every pair."""
    out = []
    others = itertools.cycle(
        itertools.product(SIZES, BATCHES, (D, 3), EXTRAS, (False, True), BLOCKS, sorted(PATTERNS))
    )
    for i, (pair, mask, dtype) in enumerate(itertools.product(PAIRS, MASKS, DTYPES)):
        (m, n), b, d_v, extra, grad, blocks, pattern = next(others)
        if mask == "auto":
            if pair not in FAST_PAIRS:
                continue
            b, m, n = 1, AUTO_N - 37, AUTO_N
        grad = grad and dtype != torch.bfloat16
        out.append(Case(*pair, dtype, b, m, n, mask, d_v, extra, grad, blocks, pattern, i))
    return out


def _sample(count: int, seed: int) -> list[Case]:
    """``count`` cases drawn with a fixed seed; most pairs are dot-product softmax and most masks
    block masks (the calls the fast paths serve), the rest any registered pair and mask form; a
    few dense masks large enough to be evaluated block-sparsely."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        pair = rng.choice(FAST_PAIRS if rng.random() < 0.6 else PAIRS)
        dtype = rng.choice(DTYPES)
        # block masks twice as often: the fast paths are block-sparse
        mask = rng.choice((*MASKS[:-1], "block", "block+padding")) if i % 25 else "auto"
        m, n = rng.choice(SIZES)
        b = rng.choice(BATCHES)
        if mask == "auto":
            pair, b, m, n = rng.choice(FAST_PAIRS), 1, AUTO_N - 37, AUTO_N
        out.append(
            Case(
                *pair,
                dtype=dtype,
                b=b,
                m=m,
                n=n,
                mask=mask,
                d_v=D if rng.random() < 0.7 else 3,
                extra=rng.choice(EXTRAS),
                grad=dtype != torch.bfloat16 and rng.random() < 0.3,
                blocks=rng.choice(BLOCKS),
                pattern=rng.choice(sorted(PATTERNS)),
                seed=rng.randrange(2**16),
            )
        )
    return out


def _inputs(case: Case):
    """The parts, q, k, v, mask, bias and block mask of a case, in float64."""
    dims = Dims(d_q=D, d_k=D, d_v=case.d_v, max_len=max(64, case.n))
    att = build_attention(case.score, case.align, dims)
    g = torch.Generator().manual_seed(case.seed)
    b, m, n = case.b, case.m, case.n
    q = torch.randn(b, HEADS, m, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, HEADS, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(b, HEADS, n, case.d_v, generator=g, dtype=torch.float64)
    padding = torch.rand(b, 1, 1, n, generator=g) > 0.25
    padding[..., 0] = True
    pattern = PATTERNS[case.pattern]
    mask = block_mask = None
    if case.mask == "padding":
        mask = padding
    elif case.mask == "causal":
        mask = torch.ones(m, n, dtype=torch.bool).tril()
    elif case.mask == "full":
        mask = torch.rand(b, HEADS, m, n, generator=g) > 0.4
        if m:
            mask[..., -1, :] = False  # a fully masked row
    elif case.mask in ("block", "block+padding") and m:
        block_mask = pt.block_mask(pattern, m, n, block_q=case.blocks[0], block_k=case.blocks[1])
        if case.mask == "block+padding":
            mask = padding
    elif case.mask in ("block", "block+padding"):  # M = 0: a dense mask of no rows
        mask = torch.zeros(m, n, dtype=torch.bool)
    elif case.mask == "auto":
        mask = pt.dense(pt.sliding_window(40), m, n)
    bias = None
    if case.extra != "none":
        bias = 0.5 * torch.randn(b, HEADS, m, n, generator=g, dtype=torch.float64)
        if case.extra == "offset" and m:
            sign = torch.tensor([1e4, -1e4], dtype=torch.float64).repeat((m + 1) // 2)[:m]
            bias = bias + sign.view(m, 1)  # every row offset by ±1e4
        elif case.extra == "sink" and m:
            bias[..., m // 2, :] = -1e9  # a row whose every score is −1e9
    return att, q, k, v, mask, bias, block_mask


def _call(att, q, k, v, mask, bias, block_mask, *, grad: bool) -> Call:
    q, k, v = (x.detach().requires_grad_(grad) for x in (q, k, v))
    return prepare_call(
        q,
        k,
        v,
        score=att.score,
        align=att.align,
        mask=mask,
        bias=bias,
        block_mask=block_mask,
    )


def _declared(target: tuple[str, str | None], call: Call) -> list[str]:
    kernel = kernels.get(target[0])
    reasons = kernel.reasons_not_supported(call)
    if target[1] is not None:
        reasons += kernel.path(target[1]).reasons_not_supported(call)
    return reasons


def _force(target: tuple[str, str | None], call: Call):
    name, path = target
    if path is None:
        return kernels.select(call, name).attend(call)
    return kernels.get(name).path(path).run(call)


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    a, b = out.detach().double(), ref.detach().double()
    diff = torch.where(torch.isnan(a) & torch.isnan(b), 0.0, (a - b).abs())
    assert not torch.isnan(diff).any(), f"{what}: NaN on one side only"
    if diff.numel():
        worst, scale = float(diff.max()), 1 + float(b.abs().max())
        assert worst <= tol * scale, (
            f"{what}: differs from the dense reference by {worst:.3g} > {tol} × {scale:.3g}"
        )


def check(target: tuple[str, str | None], case: Case, evaluate: bool = True) -> str:
    """:func:`_check` with grad mode on for a case that takes gradients, off for the others
    (inference: parameters that require a gradient then need none)."""
    with torch.set_grad_enabled(case.grad):
        return _check(target, case, evaluate)


def _check(target: tuple[str, str | None], case: Case, evaluate: bool = True) -> str:
    """Run ``target`` on ``case``: "refused" when it does not declare the call (and refuses it by
    name), "checked" when it declares it and equals the dense float64 reference ("declared",
    without evaluating, when ``evaluate`` is False); raises AssertionError otherwise.

    A row pushed to −1e9 or offset by ±1e4 in float32 or bfloat16 loses its scores, wholly or
    in part, in the rounding of the offset + e (inside the kernel, not in its inputs): there
    the reference is the dense kernel in the same dtype; so it is for alignments that pick an
    argmax or a sample (:data:`DISCONTINUOUS`), which a rounded score may turn to another key,
    and for bfloat16 (8 bits of mantissa: a window position predicted from a query, for one,
    moves by a quarter of a key at N = 45)."""
    att, q, k, v, mask, bias, block_mask = _inputs(case)
    dtype = case.dtype
    low = att.to(dtype)
    call = _call(
        low,
        *(x.to(dtype) for x in (q, k, v)),
        mask,
        None if bias is None else bias.to(dtype),
        block_mask,
        grad=case.grad,
    )
    label = _target_id(target)
    reasons = _declared(target, call)
    if reasons:
        with pytest.raises(ValueError) as refused:
            _force(target, call)
        assert repr(target[0]) in str(refused.value), f"{label} refused without its name"
        if target[1] is not None:
            assert repr(target[1]) in str(refused.value), f"{label} refused without its name"
        return "refused"
    if not evaluate:
        return "declared"
    # the reference: the dense kernel on the very same (rounded) inputs and parameters, float64
    rounds = (
        case.extra in ("sink", "offset")
        or registered(case.align) in DISCONTINUOUS
        or dtype == torch.bfloat16
    )
    work = dtype if rounds else torch.float64
    high = copy.deepcopy(low).to(work)
    ref_call = replace(
        call,
        q=None if call.q is None else call.q.detach().to(work).requires_grad_(case.grad),
        k=call.k.detach().to(work).requires_grad_(case.grad),
        v=call.v.detach().to(work).requires_grad_(case.grad),
        bias=None if call.bias is None else call.bias.to(work),
        score=high.score,
        align=high.align,
    )
    ref = kernels.get("dense").attend(ref_call).context
    out = _force(target, call).context
    what = f"{label} on {case}"
    assert out.dtype == dtype, f"{what}: context {out.dtype}"
    tol = (OFFSET_TOL if case.extra == "offset" else TOL)[dtype]
    _close(out, ref, tol, what)
    if case.grad and out.requires_grad:
        r = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
        wrt = [call.q, call.k, call.v]
        got = torch.autograd.grad((out * r.to(dtype)).sum(), wrt, allow_unused=True)
        want = torch.autograd.grad(
            (ref * r.to(work)).sum(), [ref_call.q, ref_call.k, ref_call.v], allow_unused=True
        )
        grad_tol = 100 * GRAD_TOL[dtype] if case.extra == "offset" else GRAD_TOL[dtype]
        for name, g, w, x in zip("qkv", got, want, wrt, strict=True):
            g = torch.zeros_like(x) if g is None else g
            w = torch.zeros_like(x, dtype=torch.float64) if w is None else w
            _close(g, w, grad_tol, f"{what}: d/d{name}")
    return "checked"


def _slow_target(target: tuple[str, str | None]) -> bool:
    """FlexAttention's set-up takes seconds per call even eagerly: its declared calls are
    evaluated in the slow run only (its refusals are checked in every run)."""
    return target[0] == "flex"


def _fast_sample(count: int, seed: int) -> list[Case]:
    """``count`` cases in the region the fast paths declare (dot-product softmax, a block mask,
    d_v = d_k, float32 or float64), the other dimensions drawn as in :func:`_sample`."""
    rng = random.Random(seed)
    return [
        replace(
            case,
            score=pair[0],
            align=pair[1],
            mask=rng.choice(("block", "block+padding")),
            d_v=D,
            dtype=rng.choice(DTYPES[:2]),
            m=max(case.m, 1),
        )
        for case, pair in zip(
            _sample(count, seed), (rng.choice(FAST_PAIRS) for _ in range(count)), strict=True
        )
        if case.mask != "auto"
    ]


def _plain_sample(seed: int) -> list[Case]:
    """Every dot-product softmax pair in every dtype, under no mask or a dense one (no block
    mask), the other dimensions cycled: a kernel that declares only part of the grid (one
    dtype, no block masks) is still compared with the reference on every such pair it
    declares (a kernel that drops scaled_dot's scale meets scaled_dot)."""
    rng = random.Random(seed)
    out = []
    for i, (pair, dtype) in enumerate(itertools.product(FAST_PAIRS, DTYPES)):
        m, n = SIZES[(i // 3) % 3]  # each pair at another size in each dtype
        out.append(
            Case(
                *pair,
                dtype=dtype,
                b=1 + i % 2,
                m=m,
                n=n,
                mask=MASKS[i % 4],  # none, padding, causal, full
                d_v=D,
                extra=EXTRAS[i % 2],  # none, bias
                grad=dtype != torch.bfloat16 and i % 3 == 0,
                blocks=BLOCKS[0],
                pattern="window",
                seed=rng.randrange(2**16),
            )
        )
    return out


SAMPLE = _sample(48, seed=2024) + _fast_sample(16, seed=7) + _plain_sample(seed=11)


@pytest.fixture(autouse=True)
def eager_flex():
    flex.set_compiled(False)
    yield
    flex.set_compiled(True)


@pytest.mark.parametrize("target", targets(), ids=_target_id)
def test_every_kernel_path_equals_the_dense_reference_or_refuses_by_name(target):
    results = [check(target, case, evaluate=not _slow_target(target)) for case in SAMPLE]
    # every target declares some sampled calls (the flex kernel's declared calls are evaluated
    # in the slow run), and refuses others (but the reference kernel)
    assert "checked" in results or _slow_target(target)
    assert "refused" in results or target == ("dense", None)


@pytest.mark.slow
@pytest.mark.parametrize("target", targets(), ids=_target_id)
def test_every_kernel_path_on_the_whole_grid(target):
    for case in _grid():
        check(target, case)


def test_the_sample_takes_every_path_of_the_chunked_kernel():
    """The sample is large enough for the block-sparse paths: the chunked kernel, left to
    choose, runs both its fused and its tiled path, and a large dense mask is turned into a
    block mask (explain says which path a call takes)."""
    taken = {"fused": 0, "tiled": 0}
    fused, tiled = chunked.Fused.attend, chunked.Tiled.attend

    def count(name, real):
        def run(self, call):
            taken[name] += 1
            return real(self, call)

        return run

    with (
        mock.patch.object(chunked.Fused, "attend", count("fused", fused)),
        mock.patch.object(chunked.Tiled, "attend", count("tiled", tiled)),
    ):
        for case in SAMPLE:
            check(("chunked", None), case)
    assert taken["fused"] >= 3 and taken["tiled"] >= 3, taken
    auto = next(c for c in SAMPLE if c.mask == "auto")
    att, q, k, v, mask, _, _ = _inputs(replace(auto, extra="none", grad=False, d_v=D))
    with torch.no_grad():
        told = kernels.explain(q, k, v, score=att.score, align=att.align, mask=mask)
    assert (told.chosen, told.path) == ("chunked", "fused")


def test_d_v_other_than_d_k_on_the_chunked_kernel_and_its_paths():
    """d_v ≠ d_k with a block mask or a dense mask turned into one, at sizes the blocks do not
    divide: the fused path refuses it by name, and the chunked kernel evaluates it on its tiled
    path."""
    for mask, (m, n) in itertools.product(("block", "block+padding", "auto"), SIZES[:3]):
        if mask == "auto":
            m, n = AUTO_N - 37, AUTO_N
        case = Case(
            "scaled_dot", "softmax", torch.float64, 1, m, n, mask, 3, "none", False, (8, 8),
            "window", 5,
        )  # fmt: skip
        assert check(("chunked", "fused"), case) == "refused"
        assert check(("chunked", None), case) == "checked"
        assert check(("chunked", "tiled"), case) == "checked"
    case = replace(case, d_v=D)  # the same calls with d_v = d_k take the fused path
    assert check(("chunked", "fused"), case) == "checked"


# ---- a wrong kernel must fail the sweep --------------------------------------------------------


class ScaleDropped(Kernel):
    """A deliberately wrong kernel: scaled dot-product softmax attention without the 1/√d."""

    name = "test-scale-dropped"
    priority = -100
    needs_dot_product_score = True
    supports_multi_dimensional = False
    needs_softmax = True
    returns_weights = False
    accepts_dropout = False

    def attend(self, call: Call):
        qp, kp, _ = call.score.dot_form(call.q, call.k)
        return dense.attend(
            qp, kp, call.v, ak.scores.Dot(), call.align, mask=call.mask, bias=call.bias,
            block_mask=call.block_mask, score_mod=call.score_mod,
        )  # fmt: skip


@pytest.fixture
def wrong_kernel():
    table = kernels.REGISTRY.snapshot()
    kernels.register(ScaleDropped())
    yield ("test-scale-dropped", None)
    kernels.REGISTRY.restore(table)


def test_a_kernel_with_its_scale_dropped_fails_the_sweep(wrong_kernel):
    assert wrong_kernel in targets()  # the sweep finds every registered kernel
    failures, refused = [], 0
    for case in SAMPLE:
        try:
            refused += check(wrong_kernel, case) == "refused"
        except AssertionError as err:
            failures.append(str(err))
    assert refused  # it declares only dot-product softmax, and refuses the rest by name
    assert failures, "the sweep did not catch a kernel that drops the scale"
    assert any("differs from the dense reference" in f for f in failures)
    # the same sweep passes the dense kernel on the same cases
    for case in SAMPLE:
        check(("dense", None), case)
