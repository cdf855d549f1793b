"""xPos against a loop over complex numbers from Sun et al.'s equations (each feature pair a
complex number rotated by e^{inθ_i} and scaled by ζ_i^{±n/γ}), the scores' dependence on n − m
alone (and on no centre), the decay it adds to RoPE, and cached decoding inside multi-head
attention equal to one causal pass."""

from __future__ import annotations

import cmath
import math

import pytest
import torch

import attnkit as ak
from attnkit.positions import XPos


def _loop(x, positions, *, key, base=10000.0, gamma=512.0, zeta=0.4, center=0):
    """f_q(x, n)_i = x_i e^{i n θ_i} ζ_i^{(n − c)/γ} (keys: ζ_i^{−(m − c)/γ}), pair i of the
    features read as the complex number x_{2i} + i·x_{2i+1}; θ_i = base^{−2i/d},
    ζ_i = (i/(d/2) + ζ₀)/(1 + ζ₀)."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in x.shape[:-2])).reshape(
        -1, x.dim() - 2
    ):
        lead = tuple(int(i) for i in idx)
        for row, n in enumerate(positions):
            for i in range(d // 2):
                theta = base ** (-2 * i / d)
                z = (i / (d / 2) + zeta) / (1 + zeta)
                power = (n - center) / gamma
                c = complex(float(x[(*lead, row, 2 * i)]), float(x[(*lead, row, 2 * i + 1)]))
                c = c * cmath.exp(1j * n * theta) * z ** (-power if key else power)
                out[(*lead, row, 2 * i)] = c.real
                out[(*lead, row, 2 * i + 1)] = c.imag
    return out


def _qk(m=5, n=7, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, length, d, generator=g, dtype=torch.float64) for length in (m, n))


@pytest.mark.parametrize(
    "kw, q_offset, k_offset",
    [({}, 0, 0), ({}, 3, 0), ({"scale_base": 4.0, "zeta": 0.2, "base": 100.0}, 2, 1),
     ({"scale_base": 8.0, "center": 5}, 4, 0)],
)  # fmt: skip
def test_matches_the_loop_from_the_equations(kw, q_offset, k_offset):
    q, k = _qk()
    out = XPos(**kw)(q, k, q_offset=q_offset, k_offset=k_offset)
    ref = {"base": kw.get("base", 1e4), "gamma": kw.get("scale_base", 512.0),
           "zeta": kw.get("zeta", 0.4), "center": kw.get("center", 0)}  # fmt: skip
    want_q = _loop(q, range(q_offset, q_offset + 5), key=False, **ref)
    want_k = _loop(k, range(k_offset, k_offset + 7), key=True, **ref)
    print(f"xpos vs loop: {float((out.q - want_q).abs().max()):.1e}")
    torch.testing.assert_close(out.q, want_q, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.k, want_k, rtol=1e-12, atol=1e-12)
    assert out.bias is None and out.values is None


def test_scores_are_ropes_times_the_decay_per_pair_and_read_only_the_distance():
    """q·k after xPos = Σ_i Re(q_i conj(k_i) e^{i(n−m)θ_i}) ζ_i^{(n−m)/γ}: RoPE's score per pair
    times the pair's decay; the same for every shift of both positions and every centre."""
    q, k = _qk(m=4, n=4, d=4, seed=1)
    gamma = 3.0
    scheme = XPos(scale_base=gamma)
    out = scheme(q, k, q_offset=2, k_offset=2)
    got = out.q @ out.k.transpose(-1, -2)
    want = torch.zeros_like(got)
    for i in range(2):  # per pair: RoPE's rotation of the pair alone, times ζ_i^{(n−m)/γ}
        pair = slice(2 * i, 2 * i + 2)
        theta = 1e4 ** (-2 * i / 4)
        zeta = (i / 2 + 0.4) / 1.4
        for a in range(4):
            for b in range(4):
                dist = a - b
                qc = complex(*q[..., a, pair].reshape(-1, 2)[0].tolist())
                kc = complex(*k[..., b, pair].reshape(-1, 2)[0].tolist())
                term = (qc * kc.conjugate() * cmath.exp(1j * dist * theta)).real
                want[0, 0, a, b] += term * zeta ** (dist / gamma)
    torch.testing.assert_close(got[0, 0], want[0, 0], rtol=1e-12, atol=1e-12)
    for shift, center in ((0, 0), (11, 0), (40, 7), (3, -20)):
        moved = XPos(scale_base=gamma, center=center)(q, k, q_offset=shift, k_offset=shift)
        torch.testing.assert_close(moved.q @ moved.k.transpose(-1, -2), got)
    rope = ak.positions.Rotary()(q, k, q_offset=2, k_offset=2)
    assert not torch.allclose(rope.q @ rope.k.transpose(-1, -2), got)  # the decay is there


def test_a_key_further_back_is_damped_more():
    """With q = k on pair 1 alone, whose rotation is negligible (θ_1 = base^{−1/2}, base huge),
    a query's score for the key at distance t is |q_1|² ζ_1^{t/γ}: decreasing in t."""
    x = torch.tensor([0.0, 0.0, 1.0, 1.0], dtype=torch.float64).view(1, 1, 1, 4)
    scheme = XPos(base=1e30, scale_base=2.0)
    out = scheme(x, x.expand(1, 1, 8, 4), q_offset=7)
    scores = (out.q @ out.k.transpose(-1, -2))[0, 0, 0]
    zeta_1 = (1 / 2 + 0.4) / 1.4
    want = [2 * zeta_1 ** (t / 2.0) for t in range(7, -1, -1)]
    torch.testing.assert_close(scores, torch.tensor(want, dtype=torch.float64))
    assert bool((scores.diff() > 0).all())


def test_cached_decoding_equals_the_causal_pass_in_multihead_attention():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, position=XPos(scale_base=4.0)).double().eval()
    assert isinstance(ak.MultiHeadAttention(8, 2, position="xpos").position, XPos)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    full = mha(x, mask=ak.masks.causal(9)).context
    cache = ak.kv_cache.LayerCache()
    first = mha(x[:, :4], mask=ak.masks.causal(4), cache=cache).context
    rest = [mha(x[:, t : t + 1], cache=cache).context for t in range(4, 9)]
    torch.testing.assert_close(torch.cat([first, *rest], 1), full, rtol=1e-10, atol=1e-12)


def test_declarations():
    scheme = XPos()
    assert scheme.translation_invariant and not scheme.reads_total_length
    assert not scheme.per_token and not scheme.adds_bias  # queries and keys differ
    assert "xpos" in ak.positions.available()
    with pytest.raises(ValueError, match="per_token"):
        from attnkit.distributed.positions import RingPositions

        RingPositions(scheme)
    q, k = _qk()
    with pytest.raises(NotImplementedError, match="does not declare per_token"):
        scheme.transform_at(q, torch.arange(5), 5)
    out = scheme(q, k, q_offset=3)  # place() is the forward's transform of each side
    torch.testing.assert_close(scheme.place(q, torch.arange(3, 8), key=False), out.q)
    torch.testing.assert_close(scheme.place(k, torch.arange(7), key=True), out.k)


def test_float32_stays_finite_over_long_sequences_when_centred():
    """ζ_0^{−m/γ} passes float32's range past ~70·γ positions; centred, the same sequence
    stays finite and gives float64's scores."""
    q, k = (torch.randn(1, 1, 3, 4, dtype=torch.float64) for _ in range(2))
    far = 64 * 128  # 128·γ at γ = 64
    scheme = XPos(scale_base=64.0, center=far)
    out64 = scheme(q, k, q_offset=far, k_offset=far - 1)
    out32 = scheme(q.float(), k.float(), q_offset=far, k_offset=far - 1)
    torch.testing.assert_close(
        out32.q @ out32.k.transpose(-1, -2),
        (out64.q @ out64.k.transpose(-1, -2)).float(),
        rtol=1e-4,
        atol=1e-5,
    )
    raw = XPos(scale_base=64.0)(q.float(), k.float(), q_offset=far, k_offset=far - 1)
    assert not torch.isfinite(raw.k).all()  # uncentred: the keys' scale overflows
    assert math.isfinite(float(out32.k.abs().max()))


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="base must be > 1"):
        XPos(base=1.0)
    with pytest.raises(ValueError, match="scale_base must be > 0"):
        XPos(scale_base=0.0)
    with pytest.raises(ValueError, match="zeta must be > 0"):
        XPos(zeta=-0.1)
    with pytest.raises(TypeError, match="center must be an int"):
        XPos(center=1.5)
    with pytest.raises(ValueError, match="d must be even"):
        XPos()(torch.randn(1, 3, 5), torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match="q_offset must be an int >= 0"):
        XPos()(torch.randn(1, 3, 4), torch.randn(1, 3, 4), q_offset=-1)
