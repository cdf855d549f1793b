"""DiSAN against a loop over the paper's steps (float64): fc layer, directional multi-dimensional
token2token attention, fusion gate, concatenation, multi-dimensional source2token; directions
see only one side; padding equals truncation is in the mechanism contract."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.queries.disan import DiSAN

D = torch.float64


def _lin(layer, x):
    y = layer.weight.detach() @ x
    return y if layer.bias is None else y + layer.bias.detach()


def _elu(t):
    return torch.where(t > 0, t, torch.exp(t) - 1)


def _softmax_loop(scores):
    top = max(scores)
    z = sum(math.exp(s - top) for s in scores)
    return [math.exp(s - top) / z for s in scores]


def _disa_loop(part, x, length, forward, c=5.0):
    h = [_elu(_lin(part.fc, x[i])) for i in range(length)]
    d_h = h[0].shape[0]
    u = []
    for i in range(length):
        keys = [j for j in range(length) if (j < i if forward else j > i)]
        s = torch.zeros(d_h, dtype=D)
        for k in range(d_h):  # one distribution over the keys per feature
            if not keys:
                break
            f = [
                c * math.tanh(float(_lin(part.w1, h[i])[k] + _lin(part.w2, h[j])[k]) / c)
                for j in keys
            ]
            for j, a in zip(keys, _softmax_loop(f), strict=True):
                s[k] += a * h[j][k]
        gate = torch.sigmoid(_lin(part.fuse_s, s) + _lin(part.fuse_h, h[i]))
        u.append(gate * h[i] + (1 - gate) * s)
    return u


def test_disan_equals_the_paper_steps():
    torch.manual_seed(0)
    model = DiSAN(3, 2, dtype=D)
    x = torch.randn(2, 5, 3, dtype=D)
    lengths = [5, 3]
    out = model(x, ak.masks.from_lengths(torch.tensor(lengths), 5))
    for b, length in enumerate(lengths):
        fw = _disa_loop(model.forward_direction, x[b], length, True)
        bw = _disa_loop(model.backward_direction, x[b], length, False)
        u = [torch.cat([f, g]) for f, g in zip(fw, bw, strict=True)]
        for i in range(length):
            torch.testing.assert_close(out.tokens[b, i], u[i])
        g = [_lin(model.s2t_out, _elu(_lin(model.s2t_hidden, ui))) for ui in u]
        s = torch.zeros(4, dtype=D)
        for k in range(4):
            for i, p in enumerate(_softmax_loop([float(gi[k]) for gi in g])):
                s[k] += p * u[i][k]
        torch.testing.assert_close(out.encoding[b], s)


def test_directions_see_one_side_only():
    torch.manual_seed(1)
    model = DiSAN(3, 4, dtype=D)
    x = torch.randn(1, 6, 3, dtype=D)
    out = model(x)
    fw, bw = out.weights["forward"], out.weights["backward"]
    assert fw.shape == bw.shape == (1, 4, 6, 6)
    assert (fw.triu(0) == 0).all() and (bw.tril(0) == 0).all()  # never itself either
    assert (fw[:, :, 0] == 0).all()  # the first token has no key going forward
    x2 = x.clone()
    x2[:, 4:] += 1.0  # later tokens: the forward direction of token 3 does not see them
    u_fw = model.forward_direction(x, torch.ones(1, 6, dtype=torch.bool))[0]
    u_fw2 = model.forward_direction(x2, torch.ones(1, 6, dtype=torch.bool))[0]
    torch.testing.assert_close(u_fw[:, :4], u_fw2[:, :4])
    assert not torch.allclose(u_fw[:, 4:], u_fw2[:, 4:])


def test_errors():
    model = DiSAN(3, 2)
    with pytest.raises(ValueError, match=r"\(B, N, 3\)"):
        model(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="padding mask"):
        model(torch.randn(2, 5, 3), torch.ones(2, 5, 5, dtype=torch.bool))
