"""Channel, spatial and CBAM attention and attention gates against loops written from their
papers' equations (Hu et al. 2018 eqs. 2-4; Woo et al. 2018 eqs. 1-3; Oktay et al. 2018
eqs. 1-2)."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.vision import (
    CBAM,
    AttentionGate,
    ChannelAttention,
    SAGANSelfAttention,
    SpatialAttention,
)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _mlp(fc1, fc2, z: list[float]) -> list[float]:
    """W_2 δ(W_1 z) with biases, δ = ReLU, one unit at a time."""
    hidden = [
        max(0.0, sum(float(fc1.weight[j, c]) * z[c] for c in range(len(z))) + float(fc1.bias[j]))
        for j in range(fc1.out_features)
    ]
    return [
        sum(float(fc2.weight[c, j]) * hidden[j] for j in range(len(hidden))) + float(fc2.bias[c])
        for c in range(fc2.out_features)
    ]


@pytest.mark.parametrize("pools", [("avg",), ("avg", "max")])
@torch.no_grad()
def test_channel_attention_matches_se_and_cbam_formulas(pools):
    torch.manual_seed(0)
    module = ChannelAttention(6, 2, pools=pools).double()
    x = torch.randn(2, 6, 3, 4, dtype=torch.float64)
    out = module(x)
    for b in range(2):
        avg = [float(x[b, c].sum()) / 12 for c in range(6)]  # z_c, SE eq. 2
        mx = [float(x[b, c].max()) for c in range(6)]
        score = _mlp(module.fc1, module.fc2, avg)
        if "max" in pools:  # CBAM eq. 2: the same MLP on both descriptors, summed
            score = [a + m for a, m in zip(score, _mlp(module.fc1, module.fc2, mx), strict=True)]
        s = [_sigmoid(v) for v in score]  # SE eq. 3
        torch.testing.assert_close(out.weights[b], torch.tensor(s, dtype=torch.float64))
        for c in range(6):  # SE eq. 4
            torch.testing.assert_close(out.output[b, c], s[c] * x[b, c])


def test_squeeze_excitation_with_the_gate_forced_to_one_is_the_identity():
    module = ChannelAttention(4, 2)
    with torch.no_grad():
        module.fc2.weight.zero_()
        module.fc2.bias.fill_(1e4)  # σ(1e4) = 1
    x = torch.randn(2, 4, 3, 3)
    torch.testing.assert_close(module(x).output, x)


@torch.no_grad()
def test_spatial_attention_matches_cbam_eq_3():
    torch.manual_seed(0)
    module = SpatialAttention(3).double()
    x = torch.randn(1, 4, 5, 6, dtype=torch.float64)
    out = module(x)
    w, bias = module.conv.weight[0], float(module.conv.bias[0])
    for i in range(5):
        for j in range(6):
            total = bias
            for di in range(-1, 2):
                for dj in range(-1, 2):
                    y, z = i + di, j + dj
                    if 0 <= y < 5 and 0 <= z < 6:  # zero padding
                        pooled = (float(x[0, :, y, z].mean()), float(x[0, :, y, z].max()))
                        total += sum(float(w[p, di + 1, dj + 1]) * pooled[p] for p in range(2))
            torch.testing.assert_close(out.weights[0, i, j].item(), _sigmoid(total))
    torch.testing.assert_close(out.output, x * out.weights[:, None])


def test_cbam_is_channel_then_spatial():
    torch.manual_seed(0)
    module = CBAM(6, 2, 3)
    x = torch.randn(2, 6, 4, 5)
    out = module(x)
    first = module.channel(x).output
    torch.testing.assert_close(out.output, module.spatial(first).output)
    torch.testing.assert_close(out.channel_weights, module.channel(x).weights)


def _gate_loop(module, x, g):
    """q_att = ψᵀ ReLU(W_xᵀ x_i + W_gᵀ g_i + b_g) + b_ψ, α_i = σ(q_att), x̂_i = α_i x_i, pixel
    by pixel (x and g on the same grid)."""
    wx, wg, bg = module.W_x.weight[:, :, 0, 0], module.W_g.weight[:, :, 0, 0], module.W_g.bias
    psi, bpsi = module.psi.weight[:, :, 0, 0], module.psi.bias
    c = module.n_coefficients
    group = x.shape[1] // c
    alpha = torch.zeros(x.shape[0], c, *x.shape[2:], dtype=x.dtype)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for i in range(x.shape[2]):
            for j in range(x.shape[3]):
                hidden = torch.relu(wx @ x[b, :, i, j] + wg @ g[b, :, i, j] + bg)
                for k in range(c):
                    a = _sigmoid(float(psi[k] @ hidden + bpsi[k]))
                    alpha[b, k, i, j] = a
                    sl = slice(k * group, (k + 1) * group)
                    out[b, sl, i, j] = a * x[b, sl, i, j]
    return out, alpha


@pytest.mark.parametrize("coefficients", [1, 2])
def test_attention_gate_matches_oktay_eqs_1_2(coefficients):
    torch.manual_seed(0)
    module = AttentionGate(4, 3, 5, coefficients=coefficients).double()
    x, g = torch.randn(2, 4, 3, 4).double(), torch.randn(2, 3, 3, 4).double()
    out = module(x, g)
    with torch.no_grad():
        ref_out, ref_alpha = _gate_loop(module, x, g)
    torch.testing.assert_close(out.coefficients, ref_alpha)
    torch.testing.assert_close(out.output, ref_out)


def test_attention_gate_gates_every_pixel_independently():
    """Sigmoid coefficients do not compete: two pixels can both pass fully (a softmax could
    not), and a coarse gating signal is resampled to the skip grid."""
    module = AttentionGate(2, 2, 2)
    with torch.no_grad():
        module.psi.weight.zero_()
        module.psi.bias.fill_(1e4)
    x, g = torch.randn(1, 2, 4, 4), torch.randn(1, 2, 2, 2)
    out = module(x, g)
    assert out.coefficients.shape == (1, 1, 4, 4)
    torch.testing.assert_close(out.output, x)
    assert float(out.coefficients.detach().sum()) == pytest.approx(16)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="pools must be"):
        ChannelAttention(4, pools=("mean",))
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        SpatialAttention(4)
    with pytest.raises(ValueError, match="coefficients = 3 must divide d_x = 4"):
        AttentionGate(4, 2, 2, coefficients=3)
    with pytest.raises(ValueError, match=r"x must be a feature map \(B, C, H, W\)"):
        ChannelAttention(4)(torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="g has 3 channels"):
        AttentionGate(4, 2, 2)(torch.randn(1, 4, 2, 2), torch.randn(1, 3, 2, 2))


def test_sagan_matches_its_equations_and_starts_as_the_identity():
    """β_{j,i} = softmax_i(f(x_i)ᵀ g(x_j)), o_j = W_v Σ_i β_{j,i} h(x_i), y = γ o + x."""
    torch.manual_seed(0)
    module = SAGANSelfAttention(4, 2, gamma=0.7).double()
    x = torch.randn(2, 4, 2, 3, dtype=torch.float64)
    out = module(x)

    def conv(layer, v):  # a 1×1 convolution of one position's vector
        return layer.weight[:, :, 0, 0] @ v + layer.bias

    with torch.no_grad():
        for b in range(2):
            cols = [x[b, :, i, j] for i in range(2) for j in range(3)]
            for jj, xj in enumerate(cols):
                s = [float(conv(module.f, xi) @ conv(module.g, xj)) for xi in cols]
                z = sum(math.exp(v - max(s)) for v in s)
                beta = [math.exp(v - max(s)) / z for v in s]
                torch.testing.assert_close(out.weights[b, jj], torch.tensor(beta).double())
                o = conv(
                    module.v,
                    sum(bi * conv(module.h, xi) for bi, xi in zip(beta, cols, strict=True)),
                )
                torch.testing.assert_close(out.output[b, :, jj // 3, jj % 3], 0.7 * o + xj)
    fresh = SAGANSelfAttention(4, 2)  # γ = 0 at the start: the identity
    assert fresh.gamma.item() == 0.0
    torch.testing.assert_close(fresh(x.float()).output, x.float())
