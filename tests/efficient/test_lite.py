"""Lite Transformer's long-short range attention (Wu et al. 2020): attention on half of the
channels, a lightweight convolution (GLU, softmax-normalised shared kernels) on the other half,
checked against a loop of the convolution's definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnkit as ak
from attnkit.efficient import LongShortRangeAttention

D = torch.float64


def _conv_reference(branch, x, lengths):
    h = F.glu(branch.glu_in(x), -1)
    w = torch.softmax(branch.kernel, -1)
    per_group = branch.channels // branch.groups
    out = torch.zeros_like(h)
    k = branch.kernel_size
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for c in range(branch.channels):
                for u in range(k):
                    s = t + u - k // 2
                    if 0 <= s < int(lengths[b]):
                        out[b, t, c] += w[c // per_group, u] * h[b, s, c]
    return branch.out(out)


def test_branches_split_the_channels():
    torch.manual_seed(0)
    layer = LongShortRangeAttention(8, 2, kernel_size=5).to(D)
    x = torch.randn(2, 7, 8, dtype=D)
    lengths = torch.tensor([7, 5])
    mask = ak.masks.from_lengths(lengths, 7)
    out = layer(x, mask=mask, need_weights=True)
    long = layer.attention(x[..., :4], mask=mask, need_weights=True)
    torch.testing.assert_close(out.output[..., :4], long.context)
    torch.testing.assert_close(out.weights, long.weights)
    real = torch.arange(7) < lengths[:, None]
    short = _conv_reference(layer.conv, x[..., 4:], lengths)
    torch.testing.assert_close(out.output[..., 4:][real], short[real])
    # the short branch sees a window of 5 only: the output at 0 ignores inputs from 3 on
    x = x.clone().requires_grad_()
    layer(x).output[:, 0, 4:].sum().backward()
    assert (x.grad[:, 3:, 4:] == 0).all() and (x.grad[:, :3, 4:] != 0).any()


def test_kernels_are_distributions_and_learned():
    layer = LongShortRangeAttention(8, 2)
    torch.testing.assert_close(layer.conv.weights().sum(-1), torch.ones(2))
    layer(torch.randn(2, 5, 8)).output.square().sum().backward()
    assert layer.conv.kernel.grad.abs().sum() > 0


def test_bad_arguments_and_masks_it_cannot_honour():
    with pytest.raises(ValueError, match="embed_dim must be even"):
        LongShortRangeAttention(7, 1)
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        LongShortRangeAttention(8, 2, kernel_size=4)
    layer = LongShortRangeAttention(8, 2)
    with pytest.raises(ValueError, match="key-padding masks"):
        layer(torch.randn(2, 5, 8), mask=ak.masks.causal(5))
    with pytest.raises(ValueError, match=r"needs x \(B, N, 8\)"):
        layer(torch.randn(2, 5, 6))
