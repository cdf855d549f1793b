"""DeepSeek Sparse Attention against a float64 loop from the V3.2 equations (eq. 1: the lightning
indexer; eq. 2: attention over the top-k keys), full causal attention when k ≥ N, and the
indexer's KL training signal."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.kv_cache import LayerCache
from attnkit.sparse_trainable import DeepSeekSparseAttention


def _inputs(b=2, h=2, m=9, n=9, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, length, d, generator=g, dtype=torch.float64) for length in (m, n, n)]


def _index_loop(module, q, k):
    """I_{t,s} = Σ_j w_{t,j} ReLU(q^I_{t,j} · k^I_s) (eq. 1), one term at a time."""
    ix = module.indexer
    wq, wk, ww = ix.query.weight, ix.key.weight, ix.weight.weight
    dh = ix.head_dim
    out = torch.zeros(q.shape[-2], k.shape[-2], dtype=q.dtype)
    for t in range(q.shape[-2]):
        for s in range(k.shape[-2]):
            ks = wk @ k[s]
            total = 0.0
            for j in range(ix.num_heads):
                qj = wq[j * dh : (j + 1) * dh] @ q[t]
                total = total + (ww[j] @ q[t]) * torch.relu(qj @ ks)
            out[t, s] = total
    return out


def _reference(module, q, k, v, keep, q_offset=0, bias=None, tau=1.0, uniform=False):
    """Eq. 2 per query: attention of temperature tau (or uniform) over the top-k keys by the
    group-summed eq. 1, with the bias added to the scaled dot products."""
    b_, h_, m, d = q.shape
    out = torch.zeros(b_, h_, m, v.shape[-1], dtype=q.dtype)
    g = module.group_size
    for b in range(b_):
        index = [_index_loop(module, q[b, h], k[b, h]).detach() for h in range(h_)]
        for h in range(h_):
            shared = sum(index[hh] for hh in range(h - h % g, h - h % g + g))
            for t in range(m):
                allowed = [s for s in range(k.shape[-2]) if s <= q_offset + t and keep[b, h, t, s]]
                ranked = sorted(allowed, key=lambda s: -float(shared[t, s]))  # ties: by index
                keys = sorted(ranked[: module.top_k])
                if keys:
                    e = k[b, h, keys] @ q[b, h, t] / math.sqrt(d)
                    if bias is not None:
                        e = e + bias[b, h, t, keys]
                    a = torch.softmax(e / tau, 0)
                    if uniform:
                        a = torch.full((len(keys),), 1 / len(keys), dtype=q.dtype)
                    out[b, h, t] = a @ v[b, h, keys]
    return out


@pytest.mark.parametrize("group_size, q_offset, m", [(1, 0, 9), (2, 0, 9), (1, 4, 5)])
def test_matches_the_loop_from_the_equations(group_size, q_offset, m):
    torch.manual_seed(3)
    module = DeepSeekSparseAttention(
        4, top_k=3, indexer_heads=2, indexer_dim=3, group_size=group_size
    ).double()
    n = q_offset + m
    q, k, v = (x.requires_grad_() for x in _inputs(m=m, n=n))
    pad = (torch.arange(n)[None, :] < torch.tensor([n, n - 3])[:, None])[:, None, None, :]
    out = module(q, k, v, mask=pad, q_offset=q_offset).context
    ref = _reference(module, q, k, v, pad.expand(2, 2, m, n), q_offset)
    print(f"DSA vs loop: max abs diff {float((out - ref).detach().abs().max()):.2e}")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    r = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad((out * r).sum(), (q, k, v))
    want = torch.autograd.grad((ref * r).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("form", ["temperature", "uniform"])
def test_other_alignments_and_a_bias_match_the_loop(form):
    """A softmax of fixed temperature (folded into the blocked evaluation's scale and bias) and
    any other alignment (here the uniform ablation, evaluated by gathering) against the loop."""
    torch.manual_seed(5)
    module = DeepSeekSparseAttention(4, top_k=4, indexer_heads=2, indexer_dim=3).double()
    q, k, v = (x.requires_grad_() for x in _inputs(m=9, n=9))
    bias = torch.randn(2, 2, 9, 9, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, 2, 9, 9, dtype=torch.bool)
    if form == "temperature":
        module.align = ak.alignments.Softmax(temperature=0.5)
        out = module(q, k, v, bias=bias).context
        ref = _reference(module, q, k, v, keep, bias=bias, tau=0.5)
    else:
        with ak.evaluation.uniform_weights(module):
            out = module(q, k, v, bias=bias).context
        ref = _reference(module, q, k, v, keep, uniform=True)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    r = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(6))
    leaves = (q, k, v, bias) if form == "temperature" else (v,)  # uniform: v alone counts
    got = torch.autograd.grad((out * r).sum(), leaves)
    want = torch.autograd.grad((ref * r).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_index_scores_are_eq_1():
    torch.manual_seed(0)
    module = DeepSeekSparseAttention(4, indexer_heads=3, indexer_dim=2).double()
    q, k, _ = _inputs(b=1, h=1, m=5, n=6)
    torch.testing.assert_close(
        module.index_scores(q, k)[0, 0], _index_loop(module, q[0, 0], k[0, 0]).detach()
    )


@pytest.mark.parametrize("top_k", [9, 50])
def test_top_k_at_least_n_is_full_causal_attention(top_k):
    torch.manual_seed(0)
    module = DeepSeekSparseAttention(4, top_k=top_k).double()
    q, k, v = _inputs()
    pad = ak.masks.from_lengths(torch.tensor([9, 6]), 9)[:, None]  # (B, 1, 1, N)
    full = ak.attention(q, k, v, mask=pad & ak.masks.causal(9), kernel="dense").context
    out = module(q, k, v, mask=pad).context
    print(f"DSA (k >= N) vs full causal attention: {float((out - full).detach().abs().max()):.2e}")
    torch.testing.assert_close(out, full, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("group_size", [1, 3])
def test_the_indexer_learns_the_kl_to_the_main_attention_and_nothing_else_changes(
    monkeypatch, group_size, fused
):
    """The indexer's gradient is λ·∂L^I/∂θ with L^I = mean_t KL(p_t ‖ softmax(I_t)) over the
    selected keys, written out here; q, k, v receive exactly the sparse attention's gradient.
    With a group, I is the group's sum and the three heads (masked differently) select apart.
    Through the per-query gathers (weights requested) and through the fused kernel (chunks of
    a few rows; the weights then read from a second call)."""
    from attnkit.sparse_trainable import _selected

    monkeypatch.setattr(_selected, "MASK", 20)
    torch.manual_seed(0)
    sizes = {"top_k": 4, "indexer_heads": 2, "indexer_dim": 3, "group_size": group_size}
    module = DeepSeekSparseAttention(4, **sizes, indexer_loss_weight=0.5).double()
    q, k, v = (x.requires_grad_() for x in _inputs(b=1, h=3, m=8, n=8))
    mask = (torch.arange(8) < torch.tensor([8, 6, 5])[:, None])[None, :, None, :]  # (1, 3, 1, 8)
    mask = mask.expand(1, 3, 8, 8).clone()
    mask[0, 1, 2] = False  # a row without a key: not in the mean
    out = module(q, k, v, mask=mask, need_weights=not fused)
    (out.context * 0).sum().backward()  # no gradient from the output: only the indexer's loss
    got = [p.grad.clone() for p in module.indexer.parameters()]
    assert all(g.abs().sum() > 0 for g in got)
    assert not q.grad.any() and not k.grad.any() and not v.grad.any()
    if fused:
        with torch.no_grad():
            out = module(q, k, v, mask=mask, need_weights=True)

    w = out.weights.detach()  # (1, 3, 8, 8) dense main weights, 0 off the selection
    assert (w[0, 0] > 0).ne(w[0, 1] > 0).any() and (w[0, 1] > 0).ne(w[0, 2] > 0).any()
    # a key masked for every row of a head enters that head's indexer as zeros
    index = module.index_scores(q, k.where(mask.any(-2)[..., None], 0.0))
    loss, rows = 0.0, 0
    for h in range(3):
        for t in range(8):
            sel = w[0, h, t] > 0
            log_q = torch.log_softmax(index[0, h, t][sel], 0)
            p = w[0, h, t][sel]
            loss = loss + (p * (p.log() - log_q)).sum()
            rows += int(sel.any())
    want = torch.autograd.grad(0.5 * loss / rows, list(module.indexer.parameters()))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)

    quiet = DeepSeekSparseAttention(4, **sizes, indexer_loss_weight=0.0).double()
    quiet.load_state_dict(module.state_dict())
    r = torch.randn(1, 3, 8, 4, dtype=torch.float64)
    for part in (module, quiet):
        for x in (q, k, v):
            x.grad = None
        (part(q, k, v, mask=mask).context * r).sum().backward()
        grads = [x.grad.clone() for x in (q, k, v)]
        if part is module:
            first = grads
    for a, b in zip(first, grads, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_indexer_loss_function_matches_the_formula():
    scores = torch.tensor([[1.0, 2.0, 0.5]], dtype=torch.float64)
    p = torch.tensor([[0.2, 0.8, 0.0]], dtype=torch.float64)
    ok = torch.tensor([[True, True, False]])
    q = torch.softmax(scores[0, :2], 0)
    want = (p[0, :2] * (p[0, :2] / q).log()).sum()
    torch.testing.assert_close(ak.sparse_trainable.dsa.indexer_loss(scores, p, ok), want)


def test_decoding_with_a_cache_equals_the_causal_pass():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, attention=DeepSeekSparseAttention(4, top_k=3))
    mha = mha.double().eval()
    x = torch.randn(2, 8, 8, dtype=torch.float64)
    cache = LayerCache()
    steps = torch.cat([mha(x[:, i : i + 1], cache=cache).context for i in range(8)], 1)
    torch.testing.assert_close(steps, mha(x).context, atol=1e-12, rtol=1e-10)


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="indexer_loss_weight must be >= 0"):
        DeepSeekSparseAttention(4, indexer_loss_weight=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        DeepSeekSparseAttention(4, top_k=0)
    q = torch.randn(1, 3, 5, 4)
    with pytest.raises(ValueError, match="group_size=2"):
        DeepSeekSparseAttention(4, group_size=2)(q, q, q)


@pytest.mark.parametrize("name", ["indexer_heads", "indexer_dim"])
def test_indexer_sizes_are_refused_under_their_own_names(name):
    with pytest.raises(ValueError, match=f"^{name} must be a positive int, got 0"):
        DeepSeekSparseAttention(4, **{name: 0})


def test_later_non_finite_tokens_reach_no_earlier_query_on_the_tiled_path():
    torch.manual_seed(0)
    part = DeepSeekSparseAttention(4, top_k=3, indexer_heads=2, indexer_dim=3).double()
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    causal = ak.masks.causal(9)
    with torch.no_grad():
        clean = part(q, k, v, mask=causal).context
        k2, v2 = k.clone(), v.clone()
        k2[..., 5:, :], v2[..., 5:, :] = float("nan"), float("inf")
        planted = part(q, k2, v2, mask=causal).context
    assert torch.isfinite(planted[..., :5, :]).all()
    torch.testing.assert_close(planted[..., :5, :], clean[..., :5, :], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(
    "top_k, group, q_offset, m, mask",
    [
        (3, 1, 0, 11, None),
        (4, 2, 3, 9, "pad"),
        (20, 1, 0, 9, None),
        (2, 1, 5, 7, "rows"),
        (3, 2, 0, 9, "rows"),
    ],
)
def test_inference_selects_and_attends_a_block_at_a_time(
    monkeypatch, top_k, group, q_offset, m, mask, fused
):
    """Without autograd each block of queries is attended as soon as it is selected (small
    blocks here: several; on the CPU the fused kernel under a mask made from the scores, else
    the selected keys' tiles); the output equals the path that selects every query first (with
    autograd, checked against the loop above) and the float64 loop itself."""
    from attnkit.sparse_trainable import _selected, dsa

    monkeypatch.setattr(dsa, "INDEX_ELEMENTS", 40 * 4)
    monkeypatch.setattr(_selected, "MASK", 30)  # chunks of a few rows
    monkeypatch.setattr(dsa, "ATTEND_ELEMENTS", 3 * 4 * top_k)  # runs of a few blocks
    if not fused:
        monkeypatch.setattr(dsa, "fused_applies", lambda q, v: False)
    torch.manual_seed(1)
    part = DeepSeekSparseAttention(4, top_k=top_k, indexer_heads=2, indexer_dim=3)
    part = part.double()
    part.group_size = group
    n = q_offset + m
    q, k, v = _inputs(m=m, n=n, seed=5)
    g = torch.Generator().manual_seed(2)
    keep = None
    if mask == "pad":
        keep = (torch.arange(n) < torch.tensor([n, n - 2])[:, None])[:, None, None, :]
    elif mask == "rows":
        keep = torch.rand(2, 2, m, n, generator=g) < 0.8
    with torch.no_grad():
        fast = part(q, k, v, mask=keep, q_offset=q_offset).context
    full = part(q, k, v, mask=keep, q_offset=q_offset).context.detach()
    torch.testing.assert_close(fast, full, atol=1e-12, rtol=1e-10)
    every = torch.ones(2, 2, m, n, dtype=torch.bool) if keep is None else keep
    ref = _reference(part, q, k, v, every.expand(2, 2, m, n), q_offset)
    torch.testing.assert_close(fast, ref, atol=1e-12, rtol=1e-10)


def test_training_with_fewer_keys_than_top_k_past_position_k_equals_the_gathered_path(
    monkeypatch,
):
    """A padded sequence leaves queries beyond position k with fewer than k keys: their
    unavailable entries may name keys past a fused chunk's end (the selection runs over wider
    blocks than the fused chunks). Through the fused kernel (several chunks) the output and
    every gradient, the indexer's included, equal the per-query gathers' (weights requested)."""
    from attnkit.sparse_trainable import _selected, dsa

    monkeypatch.setattr(_selected, "MASK", 40)  # fused chunks of a few rows
    monkeypatch.setattr(dsa, "INDEX_ELEMENTS", 12 * 40)  # selection blocks of 12 rows
    torch.manual_seed(0)
    sizes = {"top_k": 6, "indexer_heads": 2, "indexer_dim": 3}
    module = DeepSeekSparseAttention(4, **sizes, indexer_loss_weight=0.5).double()
    q, k, v = _inputs(b=2, h=1, m=40, n=40)
    mask = (torch.arange(40) < torch.tensor([40, 3])[:, None])[:, None, None, :]  # (2, 1, 1, 40)
    r = torch.randn(2, 1, 40, 4, dtype=torch.float64)
    results = []
    for gathered in (False, True):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        module.zero_grad()
        out = module(*leaves, mask=mask, need_weights=gathered).context
        (out * r).sum().backward()
        grads = [x.grad for x in leaves] + [p.grad.clone() for p in module.indexer.parameters()]
        results.append((out.detach(), grads))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-12, rtol=1e-10)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_a_query_that_is_not_finite_reads_no_key_in_training_as_in_inference():
    """Its index scores are NaN (ranked as −inf): no key is available, the output is 0 on
    both paths, and its NaN does not reach the gradient of the indexer's key projection (the
    row has no selected key, so no index score of it is trained)."""
    torch.manual_seed(0)
    module = DeepSeekSparseAttention(4, top_k=3, indexer_heads=2, indexer_dim=3).double()
    q, k, v = _inputs(b=1, h=1, m=9, n=9)
    q[0, 0, 5] = float("nan")
    with torch.no_grad():
        inferred = module(q, k, v).context
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = module(*leaves).context
    torch.testing.assert_close(out, inferred, atol=1e-12, rtol=1e-10)
    assert not out[0, 0, 5].any() and out.isfinite().all()
    out.sum().backward()
    assert module.indexer.key.weight.grad.isfinite().all()
