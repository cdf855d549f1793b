"""MultiHeadAttention: parity with torch.nn.MultiheadAttention, any score × alignment, SPEC 8."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnkit as ak
from attnkit import masks

E, H = 12, 3


def _data(b=2, m=5, n=7, kdim=E, vdim=E, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, E, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, n, kdim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, n, vdim, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


CASES = {
    "self": {},
    "cross-kdim-vdim": {"kdim": 5, "vdim": 7},
    "no-bias": {"bias": False},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_from_torch_parity(case, masked, need_weights):
    kw = CASES[case]
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, batch_first=True, **kw).double()
    if kw.get("bias", True):
        with torch.no_grad():  # torch zero-initialises the biases; make them count
            theirs.in_proj_bias.normal_()
            theirs.out_proj.bias.normal_()
    ours = ak.MultiHeadAttention.from_torch(theirs)
    q, k, v = _data(kdim=kw.get("kdim", E), vdim=kw.get("vdim", E))
    if case == "self":
        k = v = q
    kpm = attn_mask = mask = None
    if masked:
        kpm = torch.zeros(2, k.shape[1], dtype=torch.bool)
        kpm[1, -3:] = True  # torch: True = ignore
        attn_mask = ~masks.causal(5, k.shape[1])
        mask = masks.combine(~kpm[:, None, :], ~attn_mask)
    ref, ref_w = theirs(
        q,
        k,
        v,
        key_padding_mask=kpm,
        attn_mask=attn_mask,
        need_weights=need_weights,
        average_attn_weights=False,
    )
    out = ours(q, k, v, mask=mask, need_weights=need_weights)
    torch.testing.assert_close(out.context, ref)
    if need_weights:
        torch.testing.assert_close(out.weights, ref_w)
    r = torch.randn_like(ref)
    inputs = [x for x in {id(t): t for t in (q, k, v)}.values()]
    g_ref = torch.autograd.grad((ref * r).sum(), [*inputs, *theirs.parameters()])
    g_out = torch.autograd.grad((out.context * r).sum(), [*inputs, *ours.parameters()])
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_from_torch_sequence_first_module():
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H).double()  # (L, B, E) inputs
    ours = ak.MultiHeadAttention.from_torch(theirs)
    q, k, v = _data()
    ref, _ = theirs(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    torch.testing.assert_close(ours(q, k, v).context, ref.transpose(0, 1))


def test_from_torch_rejects_unsupported_options():
    with pytest.raises(ValueError, match="add_bias_kv"):
        ak.MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H, add_bias_kv=True))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        ak.MultiHeadAttention.from_torch(nn.Linear(2, 2))


def test_sdpa_dispatch_and_dense_path_agree():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H).double()
    q, k, v = _data()
    mask = masks.from_lengths(torch.tensor([7, 4]), 7)
    with mock.patch.object(
        F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention
    ) as sdpa:
        fast = mha(q, k, v, mask=mask).context
        assert sdpa.call_count == 1
        dense = mha(q, k, v, mask=mask, need_weights=True)
        assert sdpa.call_count == 1
    torch.testing.assert_close(fast, dense.context)


def _score_for(name: str):
    d = E // H
    if name == "location":
        return ak.scores.Location(d, 16, num_heads=H)
    return name


ALL_SCORES = ak.scores.available()


@pytest.mark.parametrize("score", ALL_SCORES)
@pytest.mark.parametrize("align", ["softmax", "sparsemax", "entmax15", "sigmoid"])
def test_any_score_and_alignment(score, align):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score=_score_for(score), align=align).double()
    q, k, v = _data()
    out = mha(q, k, v, need_weights=True)
    assert out.context.shape == (2, 5, E)
    assert out.weights.shape == (2, H, 5, 7)
    out.context.sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"


@pytest.mark.parametrize("score", ALL_SCORES)
def test_an_empty_batch_gives_an_empty_result_with_every_score(score):
    """B = 0 through every score's per-head parameters (one weight set per head reshapes its
    input), with and without weights, masks and a backward pass."""
    mha = ak.MultiHeadAttention(E, H, score=_score_for(score)).double()
    x = torch.randn(0, 5, E, dtype=torch.float64, requires_grad=True)
    out = mha(x, need_weights=True)
    assert out.context.shape == (0, 5, E)
    assert out.weights.shape == (0, H, 5, 5)
    pad = ak.masks.from_lengths(torch.zeros(0, dtype=torch.long), 5)
    assert mha(x, mask=pad).context.shape == (0, 5, E)
    out.context.sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("score", ["general", "biased_general", "additive", "deep"])
def test_named_scores_get_one_parameter_set_per_head(score):
    mha = ak.MultiHeadAttention(E, H, score=score)
    for p in mha.score.parameters():
        assert p.shape[0] == H


def test_named_scores_are_built_with_explicit_sizes():
    # d_q = d_k = d_w = E/H: each score's for_heads names its sizes (no keyword filtering).
    d = E // H
    additive = ak.MultiHeadAttention(E, H, score="additive").score
    assert (additive.d_q, additive.d_k, additive.d_w, additive.num_heads) == (d, d, d, H)
    deep = ak.MultiHeadAttention(E, H, score="deep").score
    assert (deep.d_w, deep.depth, len(deep.hidden)) == (d, 2, 1)
    assert ak.MultiHeadAttention(E, H, score="learned_query").score.query.shape == (H, 1, d)
    assert ak.MultiHeadAttention(E, H, score="convolutional").score.filter.shape[:2] == (H, d)
    built = ak.MultiHeadAttention(E, H, score="general", dtype=torch.float64).score
    assert built.W.weight.shape == (H, d, d) and built.W.weight.dtype == torch.float64
    with pytest.raises(TypeError, match=r"location score needs max_len.*Location\(4, max_len"):
        ak.MultiHeadAttention(E, H, score="location")


def test_unbatched_query_gives_an_unbatched_output():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score="general").double()
    x = torch.randn(5, E, dtype=torch.float64)
    out = mha(x, mask=masks.causal(5), need_weights=True)
    ref = mha(x.unsqueeze(0), mask=masks.causal(5), need_weights=True)
    assert out.context.shape == (5, E) and out.weights.shape == (H, 5, 5)
    torch.testing.assert_close(out.context, ref.context[0])
    torch.testing.assert_close(out.weights, ref.weights[0])


CAUSAL_SAFE = [s for s in ALL_SCORES if not ak.scores.REGISTRY.get(s).mixes_keys]


@pytest.mark.parametrize("score", CAUSAL_SAFE)
def test_causal_receptive_field(score):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score=_score_for(score)).double()
    x = torch.randn(2, 6, E, dtype=torch.float64, requires_grad=True)
    out = mha(x, mask=masks.causal(6), need_weights=True)
    assert (out.weights.triu(diagonal=1) == 0).all()
    for i in range(6):
        (g,) = torch.autograd.grad(out.context[:, i].sum(), x, retain_graph=True)
        assert (g[:, i + 1 :] == 0).all()


@pytest.mark.parametrize("score", ["scaled_dot", "general", "additive", "cosine", "euclidean"])
def test_self_attention_is_permutation_equivariant(score):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, score=score).double()
    x = torch.randn(2, 6, E, dtype=torch.float64)
    p = torch.randperm(6)
    torch.testing.assert_close(mha(x[:, p]).context, mha(x).context[:, p])


def test_mask_per_head():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H).double()
    x = torch.randn(2, 4, E, dtype=torch.float64)
    mask = torch.ones(2, H, 4, 4, dtype=torch.bool)
    mask[:, 1, :, 0] = False
    w = mha(x, mask=mask, need_weights=True).weights
    assert (w[:, 1, :, 0] == 0).all() and (w[:, 0, :, 0] > 0).all()


# Grouped-query / multi-query attention, head size independent of E/H, KV cache.


def _grouped_loop(mha, x, mask=None):
    """Grouped-query attention written out head by head (Ainslie et al. 2023): head h uses key
    and value head h // (H / H_kv), i.e. k and v heads repeated; scaled dot product, softmax."""
    h, g, d = mha.num_heads, mha.num_kv_heads, mha.head_dim
    w_q, w_k, w_v = mha.in_proj_weight.split([h * d, g * d, g * d])
    b_q, b_k, b_v = mha.in_proj_bias.split([h * d, g * d, g * d])
    heads = []
    for i in range(h):
        j = i // (h // g)
        q = x @ w_q[i * d : (i + 1) * d].T + b_q[i * d : (i + 1) * d]
        k = x @ w_k[j * d : (j + 1) * d].T + b_k[j * d : (j + 1) * d]
        v = x @ w_v[j * d : (j + 1) * d].T + b_v[j * d : (j + 1) * d]
        s = q @ k.transpose(-1, -2) / d**0.5
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(s, -1) @ v)
    return mha.out_proj(torch.cat(heads, -1))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, None), (4, 1, None), (6, 3, 5)])
def test_grouped_query_attention_matches_the_loop(heads, kv_heads, head_dim):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(12, heads, num_kv_heads=kv_heads, head_dim=head_dim)
    mha = mha.double()
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    d = 12 // heads if head_dim is None else head_dim
    assert mha.in_proj_weight.shape == ((heads + 2 * kv_heads) * d, 12)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    causal = masks.causal(5)
    ref = _grouped_loop(mha, x, causal)
    torch.testing.assert_close(mha(x, mask=causal).context, ref)  # SDPA path
    torch.testing.assert_close(mha(x, mask=causal, need_weights=True).context, ref)  # dense


def test_num_kv_heads_equal_to_num_heads_is_standard_multi_head_attention():
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, batch_first=True).double()
    ours = ak.MultiHeadAttention.from_torch(theirs)
    grouped = ak.MultiHeadAttention(E, H, num_kv_heads=H, head_dim=E // H).double()
    grouped.load_state_dict(ours.state_dict())
    q, k, v = _data()
    ref, _ = theirs(q, k, v)
    torch.testing.assert_close(grouped(q, k, v).context, ref)
    assert ours.num_kv_heads == H and ours.head_dim == E // H


def test_head_dim_and_num_kv_heads_are_validated():
    with pytest.raises(ValueError, match="num_kv_heads = 2 does not divide num_heads = 3"):
        ak.MultiHeadAttention(E, 3, num_kv_heads=2)
    with pytest.raises(ValueError, match="give head_dim="):
        ak.MultiHeadAttention(10, 3)
    assert ak.MultiHeadAttention(10, 3, head_dim=7).out_proj.weight.shape == (10, 21)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        ak.MultiHeadAttention(E, H, head_dim=2.5)


@pytest.mark.parametrize("kv_heads", [H, 1])
def test_cache_step_by_step_equals_one_causal_pass(kv_heads):
    from attnkit.kv_cache import LayerCache

    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, num_kv_heads=kv_heads, head_dim=5).double()
    x = torch.randn(2, 6, E, dtype=torch.float64)
    full = mha(x, mask=masks.causal(6)).context
    cache = LayerCache()
    steps = [mha(x[:, :2], mask=masks.causal(2), cache=cache).context]  # a prompt of two
    for i in range(2, 6):
        steps.append(mha(x[:, i : i + 1], mask=masks.causal(1, i + 1), cache=cache).context)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-12)
    assert len(cache) == 6 and cache.k.shape == (2, kv_heads, 6, 5)
    assert cache.nbytes == 2 * 2 * kv_heads * 6 * 5 * 8
    with pytest.raises(ValueError, match=r"mask of shape \(1, 6\)"):
        mha(x[:, :1], mask=masks.causal(1, 6), cache=cache)  # 7 keys with this one


class _Recorder(ak.HeadAttention):
    """An attention part that records the keywords it is called with (plain averaging)."""

    decodes_with_cache = True  # declared, so that MultiHeadAttention passes it a cache

    def __init__(self, takes_q_offset: bool) -> None:
        super().__init__()
        self.takes_q_offset = takes_q_offset
        self.calls: list[dict] = []

    def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False, **rest):
        self.calls.append(rest)
        return ak.AttentionOutput(v.mean(-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1]))


@pytest.mark.parametrize("takes", [True, False])
def test_the_query_offset_reaches_only_parts_that_ask_for_it(takes):
    part = _Recorder(takes)
    mha = ak.MultiHeadAttention(4, 2, attention=part)
    x = torch.randn(1, 3, 4)
    cache = ak.kv_cache.LayerCache()
    mha(x[:, :2], x[:, :2], x[:, :2], cache=cache)
    mha(x[:, 2:], x[:, 2:], x[:, 2:], cache=cache)
    mha(x, x, x)
    assert part.calls == (
        [{"q_offset": 0}, {"q_offset": 2}, {"q_offset": 0}] if takes else [{}] * 3
    )


def test_a_score_that_mixes_neighbouring_keys_refuses_the_kv_cache():
    mha = ak.MultiHeadAttention(8, 2, "convolutional")
    x = torch.randn(1, 3, 8)
    mha(x, x, x)  # without a cache it runs
    with pytest.raises(ValueError, match="mixes neighbouring keys"):
        mha(x, x, x, cache=ak.kv_cache.LayerCache())


@pytest.mark.parametrize(
    "align",
    [
        ak.alignments.GraphLocal(sigma=1.0),
        ak.alignments.Local(2, position="monotonic"),
    ],
)
def test_an_alignment_that_reads_query_positions_refuses_the_kv_cache(align):
    mha = ak.MultiHeadAttention(8, 2, "scaled_dot", align)
    x = torch.randn(1, 3, 8)
    mha(x, x, x)
    with pytest.raises(ValueError, match="query at position m"):
        mha(x, x, x, cache=ak.kv_cache.LayerCache())


def _by_name(part, name):
    """Whether MultiHeadAttention builds the registered ``name`` from the name alone (a few
    parts need sizes that only the caller knows and are refused with a TypeError)."""
    try:
        ak.MultiHeadAttention(4, 2, **{part: name})
    except TypeError:
        return False
    return True


NAMED = [("score", s) for s in ALL_SCORES if _by_name("score", s)] + [
    ("align", a) for a in ak.alignments.available() if _by_name("align", a)
]


@pytest.mark.parametrize(("part", "name"), NAMED, ids=[f"{p}-{n}" for p, n in NAMED])
def test_dtype_and_device_reach_every_part_built_by_name(part, name):
    mha = ak.MultiHeadAttention(4, 2, dtype=torch.float64, **{part: name}).eval()
    tensors = [*mha.parameters(), *(b for b in mha.buffers() if b.is_floating_point())]
    assert all(t.dtype == torch.float64 for t in tensors)
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    assert mha(x).context.dtype == torch.float64
    on_meta = ak.MultiHeadAttention(4, 2, device="meta", **{part: name})
    assert all(t.device.type == "meta" for t in (*on_meta.parameters(), *on_meta.buffers()))


# ---- block masks, patterns and score_mods -----------------------------------------------------


def _alibi_like(e, b, h, q_idx, kv_idx):
    """A per-head distance penalty: head h gets slope (h + 1) / 4."""
    return e - (h + 1).to(e.dtype) / 4 * (q_idx - kv_idx).abs().to(e.dtype)


def _alibi_bias(heads, m, n, q0=0):
    """The same penalty as an explicit (1, H, M, N) bias, written per head."""
    i = torch.arange(q0, q0 + m)[:, None]
    j = torch.arange(n)[None, :]
    return torch.stack([-(h + 1) / 4 * (i - j).abs().to(torch.float64) for h in range(heads)])[None]


def test_block_mask_and_pattern_equal_the_dense_masked_module():
    from attnkit import patterns as pt

    torch.manual_seed(0)
    n = 150
    pattern = pt.longformer(6, [0, 77])
    dense = pt.dense(pattern, n, n)
    mha = ak.MultiHeadAttention(E, H, pattern=pattern).double()
    plain = ak.MultiHeadAttention(E, H).double()
    plain.load_state_dict(mha.state_dict())
    x = torch.randn(2, n, E, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, n, E, dtype=torch.float64)
    ref = plain(x, mask=dense).context
    g_ref = torch.autograd.grad((ref * r).sum(), x)[0]
    for out in (
        mha(x).context,
        plain(x, block_mask=pt.block_mask(pattern, n, block_q=32, block_k=32)).context,
    ):
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(torch.autograd.grad((out * r).sum(), x)[0], g_ref)


def test_a_per_head_block_mask_lines_up_with_batch_and_heads():
    from attnkit import patterns as pt

    torch.manual_seed(1)
    b, n = 2, 40

    def pattern(bi, h, q_idx, kv_idx):  # each (batch, head) its own window
        return (q_idx - kv_idx).abs() <= bi + 2 * h

    bm = pt.block_mask(pattern, n, batch=b, num_heads=H, block_q=16, block_k=16)
    dense = torch.stack(
        [torch.stack([ak.masks.window(n, n, bi + 2 * h) for h in range(H)]) for bi in range(b)]
    )  # (B, H, N, N)
    mha = ak.MultiHeadAttention(E, H).double()
    x = torch.randn(b, n, E, dtype=torch.float64)
    torch.testing.assert_close(mha(x, block_mask=bm).context, mha(x, mask=dense).context)


def test_score_mod_sees_the_head_index_and_the_cached_positions():
    torch.manual_seed(2)
    n = 9
    mha = ak.MultiHeadAttention(E, H).double()
    x = torch.randn(2, n, E, dtype=torch.float64)
    causal = ak.masks.causal(n)
    ref = mha(x, mask=causal, bias=_alibi_bias(H, n, n)).context
    out = mha(x, mask=causal, score_mod=_alibi_like).context
    torch.testing.assert_close(out, ref)
    own = ak.MultiHeadAttention(E, H, score_mod=_alibi_like).double()
    own.load_state_dict(mha.state_dict())
    torch.testing.assert_close(own(x, mask=causal).context, ref)
    # decoding: q_idx of a step counts the cached positions
    cache = ak.kv_cache.LayerCache()
    steps = [own(x[:, t : t + 1], cache=cache).context for t in range(n)]
    torch.testing.assert_close(torch.cat(steps, 1), ref)
    # the layer's score_mod, then the call's
    twice = own(x, mask=causal, score_mod=_alibi_like).context
    torch.testing.assert_close(twice, mha(x, mask=causal, bias=2 * _alibi_bias(H, n, n)).context)


def test_a_pattern_decodes_through_its_rows():
    from attnkit import patterns as pt

    torch.manual_seed(3)
    n = 12
    pattern = pt.sliding_window(3, causal=True)
    mha = ak.MultiHeadAttention(E, H, pattern=pattern).double()
    x = torch.randn(2, n, E, dtype=torch.float64)
    whole = mha(x).context
    cache = ak.kv_cache.LayerCache()
    steps = [mha(x[:, t : t + 1], cache=cache).context for t in range(n)]
    torch.testing.assert_close(torch.cat(steps, 1), whole)
    plain = ak.MultiHeadAttention(E, H).double()
    plain.load_state_dict(mha.state_dict())
    torch.testing.assert_close(whole, plain(x, mask=pt.dense(pattern, n, n)).context)


class _NoMatrix(ak.HeadAttention):
    """A per-head part without a score matrix (it declares nothing)."""

    def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
        return ak.AttentionOutput(v.mean(-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1]))


def test_block_masks_and_score_mods_that_cannot_be_honoured_are_refused():
    from attnkit import patterns as pt

    x = torch.randn(2, 6, E)
    mha = ak.MultiHeadAttention(E, H)
    bm = pt.block_mask(pt.sliding_window(1), 6)
    with pytest.raises(TypeError, match=r"block_mask must be an attnkit\.kernels\.BlockMask"):
        mha(x, block_mask=masks.window(6, 6, 1))
    with pytest.raises(TypeError, match="score_mod must be callable"):
        mha(x, score_mod=3.0)
    with pytest.raises(ValueError, match="block_mask with cache="):
        cache = ak.kv_cache.LayerCache()
        mha(x, cache=cache)
        mha(x[:, :1], block_mask=bm, cache=cache)
    with pytest.raises(ValueError, match="built with pattern="):
        ak.MultiHeadAttention(E, H, pattern=pt.sliding_window(1))(x, block_mask=bm)
    with pytest.raises(ValueError, match="score_mod reads b as the batch index"):
        mha(x.unsqueeze(0), score_mod=_alibi_like)
    with pytest.raises(ValueError, match="_NoMatrix does not declare accepts_block_mask"):
        ak.MultiHeadAttention(E, H, attention=_NoMatrix())(x, block_mask=bm)
    with pytest.raises(ValueError, match=r"_NoMatrix does not declare accepts_score_mod.*mask="):
        ak.MultiHeadAttention(E, H, attention=_NoMatrix(), score_mod=_alibi_like)
    with pytest.raises(TypeError, match="pattern must be callable"):
        ak.MultiHeadAttention(E, H, pattern="window")


def test_an_unbatched_decode_reuses_its_memory_projections():
    """memory_cache with an unbatched query (M, E) and memory (N, E): the projections of the
    memory are made once and reused at the next step, as for a batched call."""
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H).eval()
    memory = torch.randn(5, E)
    steps = torch.randn(2, 1, E)
    cache = ak.kv_cache.MemoryCache()
    with mock.patch.object(mha, "_project", wraps=mha._project) as project:
        outs = [mha(x, memory, memory, memory_cache=cache).context for x in steps]
    assert project.call_count == 1  # the second step projects its query only
    for x, out in zip(steps, outs, strict=True):
        torch.testing.assert_close(out, mha(x[None], memory[None], memory[None]).context[0])


def test_a_mask_on_another_device_is_refused_at_the_door():
    mha = ak.MultiHeadAttention(E, H)
    x = torch.randn(2, 5, E)
    with pytest.raises(ValueError, match="mask is on meta but query is on cpu"):
        mha(x, mask=torch.ones(5, 5, dtype=torch.bool, device="meta"))


def test_the_old_spellings_of_the_sizes_are_refused_naming_the_new_ones():
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: `heads` is now `num_heads`$"):
        ak.MultiHeadAttention(E, heads=H)
    with pytest.raises(TypeError, match=r"^MultiHeadAttention: `d_model` is now `embed_dim`$"):
        ak.MultiHeadAttention(d_model=E, num_heads=H)
    mha = ak.MultiHeadAttention(embed_dim=E, num_heads=H)  # the documented keywords
    assert (mha.embed_dim, mha.num_heads) == (E, H)


def test_a_mask_or_bias_that_is_not_a_tensor_is_a_type_error_naming_it():
    from attnkit import patterns as pt

    mha = ak.MultiHeadAttention(E, H)
    x = torch.randn(2, 5, E)
    with pytest.raises(TypeError, match=r"mask must be a torch\.Tensor, got list$"):
        mha(x, mask=[[True] * 5] * 5)
    with pytest.raises(TypeError, match=r"bias must be a torch\.Tensor, got float$"):
        mha(x, bias=0.5)
    how = r"attnkit\.patterns\.dense\(pattern, M, N\).*pattern="
    with pytest.raises(TypeError, match=rf"mask must be a torch\.Tensor, got function; .*{how}"):
        mha(x, mask=pt.sliding_window(2))
    with pytest.raises(TypeError, match=r"BlockMask, got function \(a pattern: .*block_mask\("):
        mha(x, block_mask=pt.sliding_window(2))


def test_a_refused_cache_says_who_refused_it_and_what_to_do():
    x = torch.randn(1, 3, E)
    with pytest.raises(
        ValueError,
        match=r"^MultiHeadAttention\.forward: attention part "
        r"_NoMatrix does not declare decodes_with_cache.*; call without cache=$",
    ):
        ak.MultiHeadAttention(E, H, attention=_NoMatrix())(x, cache=ak.kv_cache.LayerCache())
    mha = ak.MultiHeadAttention(E, H, "convolutional")
    with pytest.raises(ValueError, match=r"^MultiHeadAttention\.forward: score Convolutional"):
        mha(x, cache=ak.kv_cache.LayerCache())


def test_a_part_returning_a_context_of_the_wrong_shape_is_refused_by_name():
    """A part that pools its queries, (B, H, 1, d_v) for M queries: the heads merge and the
    output projection runs, and a residual connection would broadcast the one row over every
    position; the layer refuses it."""

    class Pooled(ak.HeadAttention):
        mask_forms = frozenset({"key"})

        def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
            w = torch.softmax(q @ k.transpose(-1, -2), -1)
            return ak.AttentionOutput((w @ v).mean(-2, keepdim=True))

    class NotAnOutput(Pooled):
        def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
            return q

    x = torch.randn(2, 5, E)
    with pytest.raises(ValueError, match=r"Pooled returned a context of shape \(2, 3, 1, 4\)"):
        ak.MultiHeadAttention(E, H, attention=Pooled())(x)
    with pytest.raises(TypeError, match="NotAnOutput returned Tensor, not an attnkit"):
        ak.MultiHeadAttention(E, H, attention=NotAnOutput())(x)


@pytest.mark.parametrize("kernel", ["dense", "sdpa", "chunked"])
def test_the_layer_evaluates_with_the_kernel_it_is_given(kernel, monkeypatch):
    torch.manual_seed(0)
    chosen = ak.MultiHeadAttention(E, H, kernel=kernel).double()
    auto = ak.MultiHeadAttention(E, H).double()
    auto.load_state_dict(chosen.state_dict())
    used = []
    instance = ak.kernels.get(kernel)
    attend, direct = type(instance).attend, type(instance).direct
    monkeypatch.setattr(
        type(instance), "attend", lambda self, call: used.append(1) or attend(self, call)
    )
    # a planned call may take the kernel's direct entry (attnkit.call_plan)
    monkeypatch.setattr(
        type(instance), "direct", lambda self, *a, **kw: used.append(1) or direct(self, *a, **kw)
    )
    q, k, v = _data()
    got = chosen(q, k, v, mask=ak.masks.from_lengths(torch.tensor([7, 4]), 7)).context
    assert used, f"the {kernel} kernel was not used"
    want = auto(q, k, v, mask=ak.masks.from_lengths(torch.tensor([7, 4]), 7)).context
    torch.testing.assert_close(got, want)


def test_a_kernel_is_checked_by_name_and_not_taken_beside_a_part():
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        ak.MultiHeadAttention(E, H, kernel="fast")
    with pytest.raises(ValueError, match="with attention= give the part its own kernel"):
        ak.MultiHeadAttention(E, H, attention=ak.Attention(), kernel="dense")
    with pytest.raises(ValueError, match="kernel 'flex' cannot evaluate this call"):
        ak.MultiHeadAttention(E, H, kernel="flex")(torch.randn(2, 5, E))
