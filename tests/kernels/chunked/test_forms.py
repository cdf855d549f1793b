"""Every spelling of an affine relative score_mod (ALiBi written any way, a relative function, a
bias table) reaches the fused block-sparse path and its once-per-distance evaluation, and
equals the dense reference; a score_mod of another form is evaluated exactly by the tiled
path."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit.kernels import chunked
from attnkit.kernels.chunked import forms

N, H, D = 70, 3, 8
SLOPES = torch.tensor([0.5, 0.125, 2.0**-5])


def _table() -> torch.Tensor:
    return torch.randn(H, 2 * 9 + 1, generator=torch.Generator().manual_seed(3))


def _bias(name: str, dtype=torch.float64) -> torch.Tensor:
    """The (H, N, N) bias of each score_mod, written out from its formula with loops."""
    out = torch.zeros(H, N, N, dtype=dtype)
    table = _table().to(dtype)
    for h in range(H):
        m = float(SLOPES[h])
        for i in range(N):
            for j in range(N):
                if name in ("alibi", "e + f", "s - m (q - kv)", "m (kv - q) + e", "relative"):
                    out[h, i, j] = -m * (i - j)
                elif name in ("symmetric alibi", "s - m |q - kv|"):
                    out[h, i, j] = -m * abs(i - j)
                elif name == "bias table":
                    out[h, i, j] = table[h, 9 + max(-9, min(9, i - j))]
    return out


SPELLINGS = {
    "alibi": lambda: ak.score_mods.alibi(SLOPES),
    "symmetric alibi": lambda: ak.score_mods.alibi(SLOPES, symmetric=True),
    "relative": lambda: ak.score_mods.relative(lambda h, d: -SLOPES[h] * d),
    "bias table": lambda: ak.score_mods.bias_table(_table()),
    "e + f": lambda: lambda e, b, h, q, kv: e + SLOPES[h].to(e.dtype) * (kv - q).to(e.dtype),
    "s - m (q - kv)": lambda: lambda s, b, h, q, kv: s - SLOPES[h].to(s.dtype) * (q - kv),
    "s - m |q - kv|": lambda: lambda s, b, h, q, kv: s - SLOPES[h].to(s.dtype) * (q - kv).abs(),
    "m (kv - q) + e": lambda: lambda e, b, h, q, kv: (SLOPES[h] * (kv - q)).to(e.dtype) + e,
}


def _reference(q, k, v, allowed, extra):
    e = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + extra
    return torch.softmax(e.masked_fill(~allowed, float("-inf")), -1) @ v


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(5)
    return [torch.randn(2, H, N, D, generator=g, dtype=dtype) for _ in range(3)]


def _spies():
    return (
        mock.patch.object(chunked.fused, "sparse_fused", side_effect=chunked.fused.sparse_fused),
        mock.patch.object(
            chunked.fused, "apply_score_mod", side_effect=chunked.fused.apply_score_mod
        ),
    )


@pytest.mark.parametrize("pattern", ["causal", "window"])
@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_spelling_takes_the_relative_fused_path_and_equals_the_reference(name, pattern):
    mod = SPELLINGS[name]()
    assert forms.form_of(mod) == ak.score_mods.Form(additive=True, relative=True)
    mask_mod = ak.patterns.causal() if pattern == "causal" else ak.patterns.sliding_window(20)
    bm = ak.patterns.block_mask(mask_mod, N, block_q=16, block_k=16)
    allowed = ak.patterns.dense(mask_mod, N, N)
    q, k, v = _inputs()
    fused, evaluations = _spies()
    with fused as spy, evaluations as f:
        out = ak.attention(q, k, v, block_mask=bm, score_mod=mod).context
    assert spy.call_count == 1
    assert f.call_count == 1  # the bias at every distance, once for the call
    torch.testing.assert_close(out, _reference(q, k, v, allowed, _bias(name)))


@pytest.mark.parametrize("name", ["alibi", "s - m (q - kv)", "bias table"])
def test_gradients_through_the_fused_backward_equal_the_reference(name):
    mod = SPELLINGS[name]()
    bm = ak.patterns.block_mask(ak.patterns.causal(), N, block_q=16, block_k=16)
    allowed = ak.patterns.dense(ak.patterns.causal(), N, N)
    leaves = [x.requires_grad_() for x in _inputs()]
    grad = torch.randn(2, H, N, D, dtype=torch.float64)
    spy = mock.patch.object(
        chunked.fused, "sparse_fused_grad", side_effect=chunked.fused.sparse_fused_grad
    )
    with spy as called:
        out = ak.attention(*leaves, block_mask=bm, score_mod=mod).context
    assert called.call_count == 1
    got = torch.autograd.grad(out, leaves, grad)
    want = torch.autograd.grad(_reference(*leaves, allowed, _bias(name)), leaves, grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


def test_a_trained_bias_table_takes_the_tiled_path_and_gets_its_gradient():
    table = torch.nn.Parameter(_table())
    mod = ak.score_mods.bias_table(table)
    bm = ak.patterns.block_mask(ak.patterns.causal(), N, block_q=16, block_k=16)
    allowed = ak.patterns.dense(ak.patterns.causal(), N, N)
    q, k, v = _inputs()
    with _spies()[0] as spy:
        out = ak.attention(q, k, v, block_mask=bm, score_mod=mod).context
    assert spy.call_count == 0  # the fused path gives gradients for q, k and v only
    (got,) = torch.autograd.grad(out.square().sum(), [table])
    ref_table = _table().requires_grad_()
    at = (torch.arange(N)[:, None] - torch.arange(N)[None, :]).clamp(-9, 9) + 9
    ref = _reference(q, k, v, allowed, ref_table.double()[:, at])
    (want,) = torch.autograd.grad(ref.square().sum(), [ref_table])
    torch.testing.assert_close(got, want)


NOT_AFFINE = {
    "softcap": (lambda: ak.score_mods.softcap(4.0), lambda e: 4.0 * torch.tanh(e / 4.0)),
    "lambda cap": (lambda: lambda e, b, h, q, kv: 4.0 * torch.tanh(e / 4.0),
                   lambda e: 4.0 * torch.tanh(e / 4.0)),
    "2e + f": (lambda: lambda e, b, h, q, kv: 2 * e + (q - kv).to(e.dtype),
               lambda e: 2 * e + (torch.arange(N)[:, None] - torch.arange(N)).double()),
    "alibi then cap": (
        lambda: ak.score_mods.compose(ak.score_mods.alibi(SLOPES), ak.score_mods.softcap(4.0)),
        lambda e: 4.0 * torch.tanh((e + _bias("alibi")) / 4.0),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(NOT_AFFINE))
def test_a_score_mod_of_another_form_is_exact_through_the_tiled_path(name):
    make, formula = NOT_AFFINE[name]
    mod = make()
    assert not forms.form_of(mod).additive
    bm = ak.patterns.block_mask(ak.patterns.causal(), N, block_q=16, block_k=16)
    allowed = ak.patterns.dense(ak.patterns.causal(), N, N)
    q, k, v = _inputs()
    with _spies()[0] as spy:
        out = ak.attention(q, k, v, block_mask=bm, score_mod=mod).context
    assert spy.call_count == 0
    e = formula(q @ k.transpose(-1, -2) / D**0.5)
    want = torch.softmax(e.masked_fill(~allowed, float("-inf")), -1) @ v
    torch.testing.assert_close(out, want)


def test_a_composition_of_relative_forms_is_relative_and_a_shift_keeps_it():
    both = ak.score_mods.compose(ak.score_mods.alibi(SLOPES), ak.score_mods.bias_table(_table()))
    assert forms.form_of(both) == ak.score_mods.Form(additive=True, relative=True)
    assert forms.form_of(ak.score_mods.shifted(both, 5)).relative
    # a plain function inside: the composition is read from its graph
    mixed = ak.score_mods.compose(ak.score_mods.alibi(SLOPES), lambda e, b, h, q, kv: e + 1.0)
    assert mixed.form() is None
    assert forms.form_of(mixed).relative
    q, k, v = _inputs()
    bm = ak.patterns.block_mask(ak.patterns.causal(), N, block_q=16, block_k=16)
    allowed = ak.patterns.dense(ak.patterns.causal(), N, N)
    out = ak.attention(q, k, v, block_mask=bm, score_mod=both).context
    torch.testing.assert_close(
        out, _reference(q, k, v, allowed, _bias("alibi") + _bias("bias table"))
    )
