"""Linear attention (Katharopoulos et al. 2020) and fast weight programmers (Schlag et al. 2021),
each checked against loops written from the papers' equations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnkit as ak
from attnkit.efficient import FastWeightProgrammer, LinearAttention

D = torch.float64


def _inputs(seed=0, lead=(2, 3), m=9, n=9, d=5, dv=4):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*lead, m, d, generator=g, dtype=D),
        torch.randn(*lead, n, d, generator=g, dtype=D),
        torch.randn(*lead, n, dv, generator=g, dtype=D),
    )


def _phi(x):
    return F.elu(x) + 1


def _loop(q, k, v, phi, *, causal=False, keep=None):
    """Katharopoulos eq. 4 (and eq. 8 for causal), one query and one key at a time."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in q.shape[:-2])).reshape(
        -1, q.dim() - 2
    ):
        b = tuple(idx.tolist())
        for i in range(q.shape[-2]):
            num, den = 0, 0
            for j in range(k.shape[-2]):
                if (causal and j > i) or (keep is not None and not keep[b[0]][j]):
                    continue
                s = phi(q[b][i]) @ phi(k[b][j])
                num, den = num + s * v[b][j], den + s
            out[b][i] = num / den if float(den.detach()) != 0 else 0
    return out


def test_non_causal_equals_the_loop_with_a_padding_mask():
    q, k, v = _inputs(m=6, n=8)
    lengths = torch.tensor([8, 5])
    mask = ak.masks.from_lengths(lengths, 8)[:, None]  # (B, 1, 1, N)
    out = LinearAttention()(q, k, v, mask=mask).context
    keep = [[j < int(n) for j in range(8)] for n in lengths]
    torch.testing.assert_close(out, _loop(q, k, v, _phi, keep=keep), atol=1e-12, rtol=1e-10)


def test_unmasked_elu_path_equals_the_loop_forward_and_gradients():
    """Without a mask the elu + 1 context is one autograd node with its own backward (the map's
    derivative read from the map); it must match the loop's autograd, also for inputs at and
    far below 0, and match float64 gradcheck."""
    q, k, v = (x.requires_grad_() for x in _inputs(7, m=6, n=8))
    with torch.no_grad():
        q[0, 0, 0, :2] = torch.tensor([0.0, -30.0])
        k[1, 2, 3, :2] = torch.tensor([-40.0, 0.0])
    part = LinearAttention()
    assert part._fused(q, k, v)
    out = part(q, k, v).context
    ref = _loop(q, k, v, _phi)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    r = torch.randn_like(out)
    got = torch.autograd.grad((out * r).sum(), (q, k, v))
    want = torch.autograd.grad((ref * r).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    small = [x[:1, :1, :4].detach().clone().requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: part(*x).context, small)
    # broadcast leading dims, a listener and the causal form take the general path
    assert not part._fused(q[:1], k, v)
    assert not LinearAttention(causal=True)._fused(q, k, v)
    with ak.hooks.listen():
        assert not part._fused(q, k, v)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_causal_equals_the_loop_the_step_loop_and_the_fast_weight_update(chunk_size):
    q, k, v = _inputs(1)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    part = LinearAttention(causal=True, chunk_size=chunk_size)
    out = part(q, k, v).context
    torch.testing.assert_close(out, _loop(q, k, v, _phi, causal=True), atol=1e-12, rtol=1e-10)
    state, steps = None, []
    for t in range(9):
        y, state = part.step(q[..., t, :], k[..., t, :], v[..., t, :], state)
        steps.append(y)
    torch.testing.assert_close(torch.stack(steps, -2), out, atol=1e-12, rtol=1e-10)
    fwp = FastWeightProgrammer()(q, k, v).context
    torch.testing.assert_close(fwp, out, atol=1e-12, rtol=1e-10)
    r = torch.randn(out.shape, dtype=D, generator=torch.Generator().manual_seed(3))
    g_lin = torch.autograd.grad((out * r).sum(), (q, k, v))
    g_fwp = torch.autograd.grad((fwp * r).sum(), (q, k, v))
    for a, b in zip(g_lin, g_fwp, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_fast_weights_are_the_sum_of_outer_products():
    """After the sequence, W = Σ_t v_t ⊗ φ(k_t) (Schlag et al. eq. 1): the last output reads it."""
    q, k, v = _inputs(2, lead=(1,), m=5, n=5)
    w = sum(torch.outer(v[0, t], _phi(k[0, t])) for t in range(5))
    z = sum(_phi(k[0, t]) for t in range(5))
    last = FastWeightProgrammer()(q, k, v).context[0, -1]
    torch.testing.assert_close(last, w @ _phi(q[0, -1]) / (z @ _phi(q[0, -1])))


@pytest.mark.parametrize(
    "make", [lambda: LinearAttention(causal=True, chunk_size=3), FastWeightProgrammer]
)
def test_causal_receptive_field_by_gradients(make):
    q, k, v = (x.requires_grad_() for x in _inputs(4, lead=(1,), m=8, n=8))
    out = make()(q, k, v).context
    for i in range(8):
        grads = torch.autograd.grad(out[0, i].sum(), (q, k, v), retain_graph=True)
        for g in grads:
            assert (g[0, i + 1 :] == 0).all()
        if i > 0:  # keys ≤ i matter (a lone key has weight 1 whatever its value)
            assert grads[1][0, : i + 1].abs().sum(-1).gt(0).all()
        assert grads[2][0, : i + 1].abs().sum(-1).gt(0).all()


def test_weights_are_the_normalised_kernel_and_give_the_context():
    q, k, v = _inputs(5, m=7, n=7)
    mask = ak.masks.from_lengths(torch.tensor([7, 4]), 7)[:, None]
    for causal in (False, True):
        out = LinearAttention(causal=causal)(q, k, v, mask=mask, need_weights=True)
        s = _phi(q) @ _phi(k).transpose(-1, -2)
        allowed = mask & (ak.masks.causal(7) if causal else True)
        s = torch.where(allowed, s, 0)
        torch.testing.assert_close(out.weights, s / s.sum(-1, keepdim=True))
        torch.testing.assert_close(out.weights @ v, out.context, atol=1e-12, rtol=1e-10)


def test_a_custom_feature_map_with_more_features():
    class Both(nn.Module):
        def forward(self, x):
            return torch.cat([F.relu(x), F.relu(-x)], -1)

    q, k, v = _inputs(6, m=4, n=6)
    out = LinearAttention(Both())(q, k, v).context
    phi = Both()
    torch.testing.assert_close(out, _loop(q, k, v, phi), atol=1e-12, rtol=1e-10)


def test_relu_features_that_vanish_give_zero_context():
    q, k, v = _inputs(7)
    q = -q.abs()  # φ(q) = 0 for every query
    out = LinearAttention("relu", causal=True)(q, k, v, need_weights=True)
    assert (out.context == 0).all() and (out.weights == 0).all()


def test_masks_it_cannot_honour_and_biases_are_refused():
    q, k, v = _inputs(8)
    with pytest.raises(ValueError, match="varies over queries"):
        LinearAttention()(q, k, v, mask=ak.masks.causal(9))
    with pytest.raises(ValueError, match="bias"):
        LinearAttention()(q, k, v, bias=torch.zeros(9, 9, dtype=D))
    with pytest.raises(ValueError, match="as many queries as keys"):
        LinearAttention(causal=True)(q[..., :4, :], k, v)
    with pytest.raises(ValueError, match="feature_map"):
        LinearAttention("softplus")
    with pytest.raises(ValueError, match="chunk_size"):
        LinearAttention(chunk_size=0)


def test_in_multi_head_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 10, 16)
    mha = ak.MultiHeadAttention(16, 4, attention=LinearAttention(causal=True))
    out = mha(x, need_weights=True)
    assert out.context.shape == (2, 10, 16) and out.weights.shape == (2, 4, 10, 10)
    assert (out.weights.triu(1) == 0).all()
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 4, 10))


def _causal_parts():
    from attnkit.efficient import FMMformer, Performer, RandomFeatureAttention

    return {
        "linear": LinearAttention(causal=True, chunk_size=3),
        "performer": Performer(4, causal=True),
        "rfa": RandomFeatureAttention(4, causal=True),
        "rfa gated": RandomFeatureAttention(4, causal=True, gate=True),
        "fmm": FMMformer(bandwidth=2, causal=True),
        "fast_weight": FastWeightProgrammer(),
    }


@pytest.mark.parametrize("name", sorted(_causal_parts()))
def test_queries_after_a_kv_cache_are_the_last_rows_of_the_causal_sequence(name):
    torch.manual_seed(0)
    part = _causal_parts()[name].double()
    n, m = 9, 3
    q, k, v = (torch.randn(2, n, 4, dtype=torch.float64) for _ in range(3))
    pad = torch.ones(2, 1, n, dtype=torch.bool)
    pad[1, :, 1] = False  # a padded key inside the cache
    whole = part(q, k, v, mask=pad, need_weights=True)
    with ak.hooks.listen() as reports:
        last = part(q[:, -m:], k, v, mask=pad, need_weights=True, q_offset=n - m)
    torch.testing.assert_close(last.context, whole.context[:, -m:])
    torch.testing.assert_close(last.weights, whole.weights[:, -m:])
    assert reports and all(r.weights.shape[-2:] == (m, n) for r in reports)
    # one query at a time, as a decoder reads: each equals its row of the whole sequence
    for i in range(n):
        one = part(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], mask=pad[..., : i + 1],
                   q_offset=i)  # fmt: skip
        torch.testing.assert_close(one.context, whole.context[:, i : i + 1])
    with pytest.raises(ValueError, match="need 8 keys"):
        part(q[:, -m:], k, v, q_offset=n - m - 1)
    with pytest.raises(ValueError, match="q_offset"):
        part(q, k, v, q_offset=-1)
