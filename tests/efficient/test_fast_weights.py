"""The fast-weight programmer against the update of Schlag, Irie and Schmidhuber (2021, eqs. 1-4)
written as a float64 loop over positions, forward and gradients, with and without a key padding
mask."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.efficient import FastWeightProgrammer


def _phi(x, name):
    return torch.nn.functional.elu(x) + 1 if name == "elu+1" else torch.relu(x)


def _reference(q, k, v, keep, name):
    """W_t = W_{t−1} + v_t ⊗ φ(k_t), z_t = z_{t−1} + φ(k_t), y_t = W_t φ(q_t) / z_t·φ(q_t),
    skipping the update at padded positions; y_t = 0 where the denominator is 0."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            w = torch.zeros(v.shape[-1], q.shape[-1], dtype=q.dtype)
            z = torch.zeros(q.shape[-1], dtype=q.dtype)
            for t in range(q.shape[-2]):
                if keep[b, t]:
                    fk = _phi(k[b, h, t], name)
                    w = w + torch.outer(v[b, h, t], fk)
                    z = z + fk
                fq = _phi(q[b, h, t], name)
                den = z @ fq
                if den != 0:
                    out[b, h, t] = w @ fq / den
    return out


@pytest.mark.parametrize("name, padded", [("elu+1", False), ("elu+1", True), ("relu", True)])
def test_matches_the_update_loop_forward_and_gradients(name, padded):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    v = v[..., :3].clone()  # d_v != d
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    lengths = torch.tensor([7, 4]) if padded else torch.tensor([7, 7])
    keep = torch.arange(7)[None, :] < lengths[:, None]
    mask = ak.masks.from_lengths(lengths, 7)[:, None] if padded else None
    out = FastWeightProgrammer(name)(q, k, v, mask=mask).context
    ref = _reference(q, k, v, keep, name)
    gap = float((out - ref).detach().abs().max())
    print(f"fast weights ({name}, padded={padded}) vs loop: max abs diff {gap:.2e}")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    r = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * r).sum(), (q, k, v))
    want = torch.autograd.grad((ref * r).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_a_zero_denominator_gives_zero_and_no_nan_gradient():
    """With φ = ReLU and every query feature 0, the denominator is 0: the output and the
    gradients stay 0 (not NaN)."""
    q = -torch.ones(1, 1, 4, 3, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out = FastWeightProgrammer("relu")(q, k, v).context
    assert not out.any()
    for grad in torch.autograd.grad(out.sum(), (q, k, v)):
        assert not grad.isnan().any()
