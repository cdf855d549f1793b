"""QK-norm: RMSNorm / LayerNorm on each head's q and k, written out, before the scaled dot."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.logits import QKNormAttention


def _rms(x, g, eps):
    return g * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _layer(x, g, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return g * (x - mu) / torch.sqrt(var + eps) + b


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_matches_the_formula(norm):
    torch.manual_seed(0)
    part = QKNormAttention(8, norm=norm, eps=1e-5).double()
    with torch.no_grad():
        for p in part.parameters():
            p.uniform_(0.5, 1.5)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) * 5 for n in (4, 6, 6))
    pad = ak.masks.from_lengths(torch.tensor([6, 3]), 6)[:, None]
    out = part(q, k, v, mask=pad, need_weights=True)
    if norm == "rms":
        qn, kn = _rms(q, part.q_norm.weight, 1e-5), _rms(k, part.k_norm.weight, 1e-5)
    else:
        qn = _layer(q, part.q_norm.weight, part.q_norm.bias, 1e-5)
        kn = _layer(k, part.k_norm.weight, part.k_norm.bias, 1e-5)
    e = (qn @ kn.transpose(-1, -2) / math.sqrt(8)).masked_fill(~pad, float("-inf"))
    a = torch.softmax(e, -1)
    torch.testing.assert_close(out.weights, a)
    torch.testing.assert_close(out.context, a @ v)


def test_logits_stay_bounded_however_large_q_and_k():
    part = QKNormAttention(4).double()
    q = torch.randn(1, 1, 3, 4, dtype=torch.float64) * 1e6
    e = part(q, q, q, need_weights=True).scores
    assert e.abs().max() <= math.sqrt(4) * 1.0001  # |q̂·k̂| ≤ d, divided by √d


def test_in_multihead_attention_and_decoding():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, attention=QKNormAttention(4)).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    cache = ak.kv_cache.LayerCache()
    steps = torch.cat([mha(x[:, i : i + 1], cache=cache).context for i in range(5)], 1)
    torch.testing.assert_close(steps, mha(x, mask=ak.masks.causal(5)).context)


def test_refusals():
    with pytest.raises(ValueError, match="norm must be one of"):
        QKNormAttention(4, norm="batch")
    with pytest.raises(ValueError, match=r"head_dim=4"):
        QKNormAttention(4)(torch.randn(1, 3, 5), torch.randn(1, 3, 5), torch.randn(1, 3, 5))
    with pytest.raises(TypeError, match=r"attention must be an attnkit\.HeadAttention"):
        QKNormAttention(4, attention="softmax")


def test_one_report_per_call_and_nan_padding_reaches_nothing():
    """On the template: the weights are reported once, as the part's (not again by the inner
    part), and NaN in padded keys and values reaches neither the output nor the gradients."""
    torch.manual_seed(1)
    part = QKNormAttention(4).double()
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    pad = ak.masks.from_lengths(torch.tensor([5, 3]), 5)[:, None]
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, 3:], v_bad[1, :, 3:] = float("nan"), float("inf")
    k_bad.requires_grad_()
    v_bad.requires_grad_()
    with ak.hooks.listen() as reports:
        out = part(q, k_bad, v_bad, mask=pad)
    assert [r.module for r in reports] == [part]
    qn, kn = _rms(q, part.q_norm.weight, 1e-6), _rms(k, part.k_norm.weight, 1e-6)
    e = (qn @ kn.transpose(-1, -2) / 2.0).masked_fill(~pad, float("-inf"))
    a = torch.softmax(e, -1)
    torch.testing.assert_close(reports[0].weights, a)
    torch.testing.assert_close(out.context, a @ v)
    out.context.sum().backward()
    assert torch.isfinite(k_bad.grad).all() and torch.isfinite(v_bad.grad).all()
    assert (k_bad.grad[1, :, 3:] == 0).all() and (v_bad.grad[1, :, 3:] == 0).all()


def test_the_inner_part_is_told_the_keys_are_finite_once_the_template_cleared_them():
    """With a mask the template has zeroed every key that is not finite, so the inner call
    is told ``finite=True`` (it scans nothing again); without one, what the caller said."""

    class Spy(ak.Attention):
        def forward(self, *args, **kw):
            self.facts = (kw.get("checked"), kw.get("finite"))
            return super().forward(*args, **kw)

    part = QKNormAttention(4, attention=Spy()).double()
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    k[1, :, 4] = float("nan")
    pad = ak.masks.from_lengths(torch.tensor([5, 4]), 5)[:, None]
    assert torch.isfinite(part(q, k, v, mask=pad).context).all()
    assert part.attention.facts == (False, True)
    part(q, q, v)
    assert part.attention.facts == (False, False)
    part(q, q, v, checked=True, finite=True)
    assert part.attention.facts == (True, True)
