"""GatedRMSNorm: both orders against the direct formula and against the transformers modules
they stand for (Mamba-2's MambaRMSNormGated, Qwen3-Next's Qwen3NextRMSNormGated)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from mixers.hf_float64 import widened
from transformers.models.mamba2 import modeling_mamba2 as mamba2
from transformers.models.qwen3_next import modeling_qwen3_next as qwen

from attnkit.mixers.gated_norm import GatedRMSNorm


def formula(x, z, w, eps, group, order):
    """The norm written out over explicit groups."""
    if order == "gate_first":
        x = x * F.silu(z)
    parts = []
    for g in x.split(group, -1):
        parts.append(g / torch.sqrt((g**2).mean(-1, keepdim=True) + eps))
    y = w * torch.cat(parts, -1)
    return y * F.silu(z) if order == "norm_first" else y


@pytest.mark.parametrize(
    ("group", "order"), [(None, "norm_first"), (4, "gate_first"), (2, "norm_first")]
)
def test_equals_the_formula(group, order):
    torch.manual_seed(0)
    norm = GatedRMSNorm(8, eps=1e-5, group_size=group, order=order, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
    x, z = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    expected = formula(x, z, norm.weight, 1e-5, group or 8, order)
    torch.testing.assert_close(norm(x, z), expected, rtol=1e-12, atol=1e-12)


def test_a_sigmoid_gate_multiplies_the_norm_by_sigma_z():
    """Kimi Linear's and MiniMax's gate: (w ⊙ RMSNorm(x)) ⊙ σ(z), written out."""
    torch.manual_seed(3)
    norm = GatedRMSNorm(6, eps=1e-5, activation="sigmoid", dtype=torch.float64)
    with torch.no_grad():
        norm.weight.normal_()
    x, z = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    rms = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5)
    expected = norm.weight * rms / (1 + torch.exp(-z))
    torch.testing.assert_close(norm(x, z), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="activation must be one of silu, sigmoid"):
        GatedRMSNorm(6, activation="gelu")


def test_the_orders_differ_and_no_gate_is_a_plain_rmsnorm():
    torch.manual_seed(1)
    x, z = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    a = GatedRMSNorm(8, order="gate_first", dtype=torch.float64)
    b = GatedRMSNorm(8, order="norm_first", dtype=torch.float64)
    assert not torch.allclose(a(x, z), b(x, z))
    plain = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(a(x), plain)
    torch.testing.assert_close(b(x), plain)


@pytest.mark.parametrize("widen", [True, False])
def test_equals_transformers_modules(widen):
    """Both orders against the transformers modules: in float64 throughout (their float32 casts
    widened) to 1e-13, and as they are (computing in float32) to float32 precision."""
    tol = {"rtol": 1e-13, "atol": 1e-13} if widen else {"rtol": 1e-5, "atol": 1e-5}
    torch.manual_seed(2)
    x, z = torch.randn(2, 5, 12, dtype=torch.float64), torch.randn(2, 5, 12, dtype=torch.float64)
    context = widened(mamba2, qwen) if widen else contextlib.nullcontext()
    with context:
        theirs = mamba2.MambaRMSNormGated(12, group_size=4, eps=1e-5).double()
        ours = GatedRMSNorm(12, eps=1e-5, group_size=4, order="gate_first", dtype=torch.float64)
        with torch.no_grad():
            theirs.weight.normal_()
            ours.weight.copy_(theirs.weight)
        torch.testing.assert_close(ours(x, z), theirs(x, z), **tol)
        theirs = qwen.Qwen3NextRMSNormGated(12, eps=1e-6).double()
        ours = GatedRMSNorm(12, eps=1e-6, order="norm_first", dtype=torch.float64)
        with torch.no_grad():
            theirs.weight.normal_()
            ours.weight.copy_(theirs.weight)
        torch.testing.assert_close(ours(x, z), theirs(x, z), **tol)


def test_float32_and_bfloat16_keep_the_dtype():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    norm = GatedRMSNorm(8, order="gate_first", group_size=4, dtype=torch.bfloat16)
    y = norm(x, x)
    assert y.dtype == torch.bfloat16
    ref = GatedRMSNorm(8, order="gate_first", group_size=4)(x.float(), x.float())
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="group_size 3 must divide dim 8"):
        GatedRMSNorm(8, group_size=3)
    with pytest.raises(ValueError, match="order must be one of"):
        GatedRMSNorm(8, order="after")
    norm = GatedRMSNorm(8)
    with pytest.raises(ValueError, match=r"x must be \(…, 8\)"):
        norm(torch.randn(2, 7))
    with pytest.raises(ValueError, match="the gate z must have"):
        norm(torch.randn(2, 8), torch.randn(2, 4))
