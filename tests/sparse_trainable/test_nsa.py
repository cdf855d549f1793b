"""Native Sparse Attention against a float64 loop written from the paper's equations (Yuan et
al. 2025, eqs. 5, 7-12), forward and gradients."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.kv_cache import LayerCache
from attnkit.sparse_trainable import BlockCompression, MeanCompression, NativeSparseAttention

SIZES = dict(compress_block=4, compress_stride=2, select_block=4, num_selected=2, window=3)


def _reference(module, q, k, v, keep, q_offset=0, tau=1.0):
    """Loop over items, heads and queries: NSA eqs. 7-12 and 5 as written (softmax of
    temperature tau)."""
    b_, h_, m, d = q.shape
    n = k.shape[-2]
    l, s, lb = module.compress_block, module.compress_stride, module.select_block
    g = module.group_size
    out = torch.zeros(b_, h_, m, v.shape[-1], dtype=q.dtype)
    for b in range(b_):
        for t in range(m):
            p = q_offset + t
            pcmp, blocks = {}, {}
            for h in range(h_):  # eqs. 7-8 for every head first (eq. 10 sums over a group)
                seen = [
                    i
                    for i in range((n - l) // s + 1 if n >= l else 0)
                    if i * s + l - 1 <= p and all(keep[b, h, t, i * s + x] for x in range(l))
                ]
                blocks[h] = seen
                if seen:
                    kc = torch.stack(
                        [module.compress_key(k[b, h, i * s : i * s + l]) for i in seen]
                    )
                    pcmp[h] = torch.softmax(kc @ q[b, h, t] / math.sqrt(d) / tau, 0)
            for h in range(h_):
                # eq. 9 (+ eq. 10): importance of selection block j
                importance = []
                for j in range(-(-n // lb)):
                    total = 0.0
                    for hh in range(h - h % g, h - h % g + g):
                        for c, i in enumerate(blocks[hh]):
                            if i * s <= (j + 1) * lb - 1 and i * s + l - 1 >= j * lb:
                                total = total + float(pcmp[hh][c].detach())
                    importance.append(total)
                allowed = [x <= p and bool(keep[b, h, t, x]) for x in range(n)]
                cur = p // lb
                rank = []
                for j, imp in enumerate(importance):
                    members = range(j * lb, min((j + 1) * lb, n))
                    if not any(allowed[x] for x in members):
                        rank.append(-math.inf)
                    elif j < module.num_initial or cur - module.num_local < j <= cur:
                        rank.append(math.inf)
                    else:
                        rank.append(imp)
                order = sorted(range(len(rank)), key=lambda j: -rank[j])  # stable: ties by index
                chosen = [j for j in order[: module.num_selected] if rank[j] > -math.inf]
                outs = []
                # compressed branch
                if blocks[h]:
                    vc = torch.stack(
                        [module.compress_value(v[b, h, i * s : i * s + l]) for i in blocks[h]]
                    )
                    outs.append(pcmp[h] @ vc)
                else:
                    outs.append(torch.zeros(v.shape[-1], dtype=q.dtype))
                # selected and window branches
                for keys in (
                    [x for j in chosen for x in range(j * lb, min((j + 1) * lb, n)) if allowed[x]],
                    [
                        x
                        for x in range(max(0, p - module.window + 1), p + 1)
                        if x < n and allowed[x]
                    ],
                ):
                    if keys:
                        a = torch.softmax(k[b, h, keys] @ q[b, h, t] / math.sqrt(d) / tau, 0)
                        outs.append(a @ v[b, h, keys])
                    else:
                        outs.append(torch.zeros(v.shape[-1], dtype=q.dtype))
                gate = torch.sigmoid(module.gate.weight @ q[b, h, t] + module.gate.bias)
                out[b, h, t] = sum(gate[c] * outs[c] for c in range(3))
    return out


def _inputs(b=2, h=2, m=11, n=11, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, length, d, generator=g, dtype=torch.float64) for length in (m, n, n)]


@pytest.mark.parametrize(
    "group_size, q_offset, m, compress",
    [(1, 0, 11, None), (2, 0, 11, None), (1, 5, 4, None), (2, 3, 6, "mean")],
)
def test_matches_the_loop_from_the_equations(group_size, q_offset, m, compress):
    torch.manual_seed(1)
    kw = {"compress_key": MeanCompression(), "compress_value": MeanCompression()}
    module = NativeSparseAttention(
        4, group_size=group_size, **SIZES, **(kw if compress else {})
    ).double()
    n = q_offset + m
    q, k, v = _inputs(m=m, n=n)
    lengths = torch.tensor([n, n - 2])
    pad = torch.arange(n)[None, :] < lengths[:, None]
    mask = pad[:, None, None, :].expand(2, 2, 1, n)
    for x in (q, k, v):
        x.requires_grad_()
    out = module(q, k, v, mask=mask, q_offset=q_offset).context
    ref = _reference(module, q, k, v, mask.expand(2, 2, m, n), q_offset)
    print(f"NSA vs loop: max abs diff {float((out - ref).detach().abs().max()):.2e}")
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    r = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(2))
    params = [x for x in (q, k, v)] + list(module.parameters())
    got = torch.autograd.grad((out * r).sum(), params, allow_unused=True)
    want = torch.autograd.grad((ref * r).sum(), params, allow_unused=True)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None or not a.any()
        else:
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize(
    "window, q_offset, m, tau", [(6, 5, 4, 1.0), (30, 0, 11, 1.0), (30, 5, 4, 1.0), (3, 0, 11, 0.5)]
)
def test_long_windows_and_a_temperature_match_the_loop(window, q_offset, m, tau):
    """Windows longer than the keys (only the columns some query can use are read) and a
    softmax of fixed temperature (folded into the scale), forward and gradients."""
    torch.manual_seed(2)
    module = NativeSparseAttention(4, **{**SIZES, "window": window}).double()
    module.align = ak.alignments.Softmax(temperature=tau)
    n = q_offset + m
    q, k, v = (x.requires_grad_() for x in _inputs(m=m, n=n))
    mask = (torch.arange(n)[None, :] < torch.tensor([n, n - 2])[:, None])[:, None, None, :]
    mask = mask.expand(2, 2, 1, n)
    out = module(q, k, v, mask=mask, q_offset=q_offset).context
    ref = _reference(module, q, k, v, mask.expand(2, 2, m, n), q_offset, tau)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    r = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad((out * r).sum(), (q, k, v))
    want = torch.autograd.grad((ref * r).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_selection_branch_reads_only_the_selected_blocks_and_window():
    """Values outside the selected blocks (NaN) leave the selection branch as it was: its cost
    follows the selection, never the whole key set."""
    torch.manual_seed(0)
    module = NativeSparseAttention(4, **SIZES, num_local=1).double()
    q, k, v = _inputs(b=1, h=1, m=16, n=16)
    out = module.branches(q, k, v)
    t = 15  # the last query: blocks 0 (initial) and 3 (local) forced, n = 2
    chosen = out.selected_blocks[0, 0, t][out.selected_available[0, 0, t]].tolist()
    assert sorted(chosen) == [0, 3]
    read = {x for j in chosen for x in range(4 * j, 4 * j + 4)}
    dirty = v.clone()
    dirty[..., [x for x in range(16) if x not in read], :] = float("nan")
    again = module.branches(q, k, dirty)
    torch.testing.assert_close(again.selected[0, 0, t], out.selected[0, 0, t])
    assert torch.isnan(again.compressed[0, 0, t]).all()  # the compressed branch reads all


def test_selection_follows_the_compressed_scores():
    """Without forced blocks, the chosen block is the one that the compressed attention
    weighs most (eq. 9-11)."""
    module = NativeSparseAttention(
        4, **{**SIZES, "num_selected": 1}, num_initial=0, num_local=0,
        compress_key=MeanCompression(), compress_value=MeanCompression(),
    ).double()  # fmt: skip
    q, k, v = _inputs(b=1, h=1, m=12, n=12)
    k = k.clone()
    k[..., 4:8, :] = 4 * q[..., 11:12, :]  # block 1 aligns with the last query
    out = module.branches(q, k, v)
    assert out.selected_blocks[0, 0, 11, 0] == 1


def test_causal_no_gradient_from_later_tokens():
    torch.manual_seed(0)
    module = NativeSparseAttention(4, **SIZES).double()
    q, k, v = (x.requires_grad_() for x in _inputs(b=1, h=2, m=12, n=12))
    out = module(q, k, v).context
    out[..., 6, :].sum().backward()
    for x in (q, k, v):
        assert not x.grad[..., 7:, :].any()


def test_decoding_with_a_cache_equals_the_causal_pass():
    torch.manual_seed(0)
    part = NativeSparseAttention(4, **SIZES)
    mha = ak.MultiHeadAttention(8, 2, attention=part).double().eval()
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    cache = LayerCache()
    steps = torch.cat([mha(x[:, i : i + 1], cache=cache).context for i in range(10)], 1)
    torch.testing.assert_close(steps, mha(x).context, atol=1e-12, rtol=1e-10)


def test_weights_and_hooks():
    module, args, kwargs = ak.mechanisms.example("native_sparse")
    with ak.evaluation.capture(module) as records:
        out = module(*args, **kwargs, need_weights=True)
    names = [f"NativeSparseAttention.{b}" for b in ("compressed", "selected", "window")]
    assert set(names) <= set(records)
    assert torch.equal(records[names[1]][0], out.weights.detach())


def test_refusals_name_the_argument():
    module = NativeSparseAttention(4, **SIZES)
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="does not declare accepts_bias"):
        module(q, q, q, bias=torch.zeros(5, 5))
    with pytest.raises(ValueError, match=r"takes no bias .*accepts_bias"):
        module.branches(q, q, q, bias=torch.zeros(5, 5))
    with pytest.raises(ValueError, match="head_dim=4"):
        module(torch.randn(1, 2, 5, 3), torch.randn(1, 2, 5, 3), q[..., :3])
    with pytest.raises(ValueError, match="compress_stride must be at most"):
        NativeSparseAttention(4, compress_block=2, compress_stride=3)
    with pytest.raises(ValueError, match="group_size=3"):
        NativeSparseAttention(4, group_size=3, **SIZES)(q, q, q)
    with pytest.raises(TypeError, match=r"compress_key must be an nn\.Module"):
        NativeSparseAttention(4, compress_key="mean")


@pytest.mark.parametrize("block, stride, n", [(4, 2, 13), (6, 3, 6), (5, 2, 14), (4, 4, 9)])
def test_block_compression_of_a_sequence_is_phi_of_each_block(block, stride, n):
    """BlockCompression.sequence (sub-block products on a view) equals φ applied to every block
    of l rows starting at a multiple of s (eq. 7), forward and gradients."""
    torch.manual_seed(0)
    phi = BlockCompression(block, 3, 5).double()
    x = torch.randn(2, n, 3, dtype=torch.float64, requires_grad=True)
    got = phi.sequence(x, stride)
    want = torch.stack([phi(x[:, i : i + block]) for i in range(0, n - block + 1, stride)], -2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    r = torch.randn(want.shape, dtype=torch.float64)
    leaves = [x, *phi.parameters()]
    for a, b in zip(
        torch.autograd.grad((got * r).sum(), leaves),
        torch.autograd.grad((want * r).sum(), leaves),
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_later_non_finite_tokens_reach_no_earlier_query_on_the_chunked_path():
    """The chunked path reads keys a query may not attend with weight 0, where NaN or inf
    would give 0 · NaN: such keys send the call to the per-query gathers (same result)."""
    torch.manual_seed(0)
    part = (
        ak.mechanisms.REGISTRY.get("native_sparse")
        .for_heads(embed_dim=8, num_heads=2, head_dim=4, max_len=16)
        .double()
    )
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    causal = ak.masks.causal(9)
    with torch.no_grad():
        clean = part(q, k, v, mask=causal).context
        k2, v2 = k.clone(), v.clone()
        k2[..., 5:, :], v2[..., 5:, :] = float("nan"), float("inf")
        planted = part(q, k2, v2, mask=causal).context
    assert torch.isfinite(planted[..., :5, :]).all()
    torch.testing.assert_close(planted[..., :5, :], clean[..., :5, :], rtol=1e-12, atol=1e-12)
