"""Synthesizer (Tay et al.): each synthetic form against a loop written from the paper's
equations (float64), the mixture with the synthetic weight zeroed against dot-product attention,
masks (padding and causal), the attention slot of MultiHeadAttention, and clear errors."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.efficient.synthesizer import (
    DenseSynthetic,
    DotProductLogits,
    FactorizedDenseSynthetic,
    FactorizedRandomSynthetic,
    RandomSynthetic,
    Synthesizer,
)

D = torch.float64


def _inputs(b=2, h=2, m=5, n=5, d=3, dv=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, m, d, generator=g, dtype=D),
        torch.randn(b, h, n, d, generator=g, dtype=D),
        torch.randn(b, h, n, dv, generator=g, dtype=D),
    )


def _attend_loop(logit, v, allowed):
    """softmax over the allowed keys of logit(i, j), then Σ_j a_ij v_j (Tay eq. 3), per row."""
    m, n = allowed.shape
    out = torch.zeros(m, v.shape[-1], dtype=D)
    for i in range(m):
        keys = [j for j in range(n) if allowed[i, j]]
        if not keys:
            continue
        e = [float(logit(i, j)) for j in keys]
        top = max(e)
        z = sum(math.exp(x - top) for x in e)
        for j, x in zip(keys, e, strict=True):
            out[i] += math.exp(x - top) / z * v[j]
    return out


def test_dense_synthesizer_equals_the_paper_loop():
    q, k, v = _inputs()
    dense = DenseSynthetic(3, max_len=7, d_hidden=6, num_heads=2).double()
    lengths = torch.tensor([5, 3])
    mask = ak.masks.from_lengths(lengths, 5)[:, None]  # (B, 1, 1, N)
    got = Synthesizer([dense])(q, k, v, mask=mask).context
    for b in range(2):
        for h in range(2):
            w1, b1, w2, b2 = (p[h].detach() for p in (dense.w1, dense.b1, dense.w2, dense.b2))

            def logit(i, j, b=b, h=h, w1=w1, b1=b1, w2=w2, b2=b2):
                x = q[b, h, i]
                hidden = [
                    max(0.0, float(sum(x[c] * w1[c, f] for c in range(3)) + b1[f]))
                    for f in range(6)
                ]
                return sum(hidden[f] * w2[f, j] for f in range(6)) + b2[j]

            allowed = torch.zeros(5, 5, dtype=torch.bool)
            allowed[:, : lengths[b]] = True
            ref = _attend_loop(logit, v[b, h], allowed)
            torch.testing.assert_close(got[b, h], ref)


def test_factorized_dense_pairs_every_factor_entry_once():
    q, k, _ = _inputs(m=4, n=6)
    part = FactorizedDenseSynthetic(3, a=2, b=3, num_heads=2).double()
    logits = part(q, k)
    for h in range(2):

        def factor(x, w1, b1, w2, b2):
            return torch.relu(x @ w1 + b1) @ w2 + b2

        fa = factor(q[:, h], part.w1a[h], part.b1a[h], part.w2a[h], part.b2a[h])  # (B, M, a)
        fb = factor(q[:, h], part.w1b[h], part.b1b[h], part.w2b[h], part.b2b[h])  # (B, M, b)
        for j in range(6):
            torch.testing.assert_close(logits[:, h, :, j], fa[..., j % 2] * fb[..., j // 2])
    # the a·b products are all distinct pairings: ℓ = a·b positions, none repeated
    pairs = {(j % 2, j // 2) for j in range(6)}
    assert len(pairs) == 6


def test_random_synthesizer_ignores_the_inputs_and_uses_R():
    q, k, v = _inputs(m=4, n=5)
    part = RandomSynthetic(6, num_heads=2).double()
    out = Synthesizer([part])(q, k, v, need_weights=True)
    r = part.r.detach()
    for b in range(2):
        for h in range(2):
            ref = _attend_loop(lambda i, j, h=h: r[h, i, j], v[b, h], torch.ones(4, 5, dtype=bool))
            torch.testing.assert_close(out.context[b, h], ref)
    other = Synthesizer([part])(q + 1, k - 2, v, need_weights=True)
    torch.testing.assert_close(other.weights, out.weights)  # no dependence on q or k


def test_fixed_random_is_a_buffer_and_factorized_random_is_low_rank():
    fixed = RandomSynthetic(5, learned=False)
    assert not list(fixed.parameters()) and "r" in dict(fixed.named_buffers())
    low = FactorizedRandomSynthetic(6, rank=2, num_heads=3).double()
    r = low.matrix().detach()
    for h in range(3):
        for i in range(6):
            for j in range(6):
                want = sum(low.r1[h, i, c] * low.r2[h, j, c] for c in range(2))
                torch.testing.assert_close(r[h, i, j], want.detach())
        assert torch.linalg.matrix_rank(r[h]) <= 2
    q, k, _ = _inputs(h=3, m=4, n=4)
    torch.testing.assert_close(low(q, k), r[:, :4, :4])


def test_mixture_with_synthetic_weight_zeroed_is_dot_product_attention():
    q, k, v = _inputs(m=5, n=5, d=4)
    causal = ak.masks.causal(5, 5)
    mix = Synthesizer(
        [DenseSynthetic(4, 8, num_heads=2), RandomSynthetic(8, num_heads=2), DotProductLogits()],
        mixture=[0.0, 0.0, 1.0],
    ).double()
    got = mix(q, k, v, mask=causal).context
    for b in range(2):
        for h in range(2):

            def logit(i, j, b=b, h=h):
                return sum(q[b, h, i, c] * k[b, h, j, c] for c in range(4)) / 2.0

            torch.testing.assert_close(got[b, h], _attend_loop(logit, v[b, h], causal))
    # and the weights are a true mixture otherwise: logits = Σ α_c logits_c
    half = Synthesizer([RandomSynthetic(8, num_heads=2), DotProductLogits()], [0.25, 0.75]).double()
    w = half(q, k, v, need_weights=True).weights
    logits = 0.25 * half.components[0](q, k) + 0.75 * half.components[1](q, k)
    torch.testing.assert_close(w, torch.softmax(logits, -1))


def test_causal_mask_on_synthetic_logits():
    q, k, v = _inputs(m=6, n=6)
    v.requires_grad_()
    part = Synthesizer(
        [DenseSynthetic(3, 6, num_heads=2), RandomSynthetic(6, num_heads=2)]
    ).double()
    out = part(q, k, v, mask=ak.masks.causal(6, 6), need_weights=True)
    assert (out.weights.triu(1) == 0).all()
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(2, 2, 6, dtype=D))
    out.context[:, :, 2].sum().backward()
    assert (v.grad[:, :, 3:] == 0).all() and (v.grad[:, :, :3] != 0).any()


def test_in_the_attention_slot_of_multihead_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=D)
    mha = ak.MultiHeadAttention(8, 2, dtype=D)
    parts = [DenseSynthetic(4, 5, num_heads=2), DotProductLogits()]
    synth = ak.MultiHeadAttention(8, 2, attention=Synthesizer(parts, [0.0, 1.0]), dtype=D)
    synth.attention.double()
    synth.load_state_dict(mha.state_dict(), strict=False)
    mask = ak.masks.from_lengths(torch.tensor([5, 2]), 5)
    torch.testing.assert_close(synth(x, mask=mask).context, mha(x, mask=mask).context)
    learned = ak.MultiHeadAttention(8, 2, attention=Synthesizer(parts), dtype=D)
    learned.attention.double()
    with ak.evaluation.capture(learned) as records:
        y = learned(x).context
    assert y.shape == (2, 5, 8) and records["attention"][0].shape == (2, 2, 5, 5)


def test_clear_errors():
    q, k, v = _inputs(m=5, n=5)
    with pytest.raises(ValueError, match="max_len"):
        Synthesizer([DenseSynthetic(3, 4, num_heads=2)]).double()(q, k, v)
    with pytest.raises(ValueError, match="max_len"):
        Synthesizer([RandomSynthetic(4, num_heads=2)]).double()(q, k, v)
    with pytest.raises(ValueError, match="num_heads=3"):
        Synthesizer([RandomSynthetic(8, num_heads=3)]).double()(q, k, v)
    with pytest.raises(ValueError, match="mixture"):
        Synthesizer([DotProductLogits(), DotProductLogits()], [0.5, 0.6])
    with pytest.raises(TypeError, match="components"):
        Synthesizer(DotProductLogits())
    with pytest.raises(ValueError, match="at least one"):
        Synthesizer([])


def test_kv_cached_decoding_equals_one_causal_pass():
    """Dense synthetic logits come from the query's content and index absolute key positions,
    so decoding token by token with a cache (keys 0 … t) equals the causal pass. (The random
    forms index query rows too, which the attention slot does not place: see the module.)"""
    torch.manual_seed(2)
    parts = [DenseSynthetic(4, 6, num_heads=2), DotProductLogits()]
    mha = ak.MultiHeadAttention(8, 2, attention=Synthesizer(parts), dtype=D)
    mha.attention.double()
    x = torch.randn(2, 6, 8, dtype=D)
    full = mha(x, mask=ak.masks.causal(6, 6)).context
    cache = ak.kv_cache.LayerCache()
    steps = [mha(x[:, t : t + 1], cache=cache).context for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), full)


def test_random_form_reads_the_rows_of_the_queries_positions():
    r = RandomSynthetic(6, num_heads=2)
    q, k, _ = _inputs(m=2, n=5)
    torch.testing.assert_close(r(q.float(), k.float(), q_offset=3), r.r[:, 3:5, :5])
    with pytest.raises(ValueError, match="q_offset"):
        r(q.float(), k.float(), q_offset=5)  # rows 5 and 6 of a 6 × 6 matrix
    with pytest.raises(ValueError, match="q_offset"):
        r(q.float(), k.float(), q_offset=-1)


def test_step_by_step_decoding_with_a_kv_cache_equals_the_causal_sequence():
    torch.manual_seed(0)
    parts = [RandomSynthetic(8, num_heads=2), FactorizedRandomSynthetic(8, 2, num_heads=2)]
    part = Synthesizer([*parts, DenseSynthetic(4, 8, num_heads=2), DotProductLogits()])
    mha = ak.MultiHeadAttention(8, 2, attention=part).double().eval()
    x = torch.randn(2, 6, 8, dtype=D)
    whole = mha(x, x, x, mask=ak.masks.causal(6)).context
    cache = ak.kv_cache.LayerCache()
    steps = [
        mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache).context
        for t in range(6)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), whole)
