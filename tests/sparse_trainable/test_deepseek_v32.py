"""DeepSeek-V3.2's attention (MLA over the top-k keys of the released lightning indexer): with
transformers' DeepseekV32Attention weights copied, the indexer's scores and chosen keys and the
layer's output and gradients equal transformers' in float64 (its float32 casts widened, and as
shipped at float32 tolerance); with k ≥ N the layer is plain MLA; cached decoding equals the
causal pass and transformers' own cached decoding."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.modern import MultiHeadLatentAttention
from attnkit.sparse_trainable.deepseek_v32 import SparseLatentAttention, SparseLatentCache
from tests.mixers.hf_float64 import widened

D = torch.float64
v32 = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")
masking_utils = pytest.importorskip("transformers.masking_utils")
cache_utils = pytest.importorskip("transformers.cache_utils")

L = 10


def _ref(topk=4, seed=0):
    cfg = v32.DeepseekV32Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12,
        kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
        index_n_heads=16, index_head_dim=8, index_topk=topk, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=64, num_hidden_layers=1, vocab_size=10,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = v32.DeepseekV32Attention(cfg, 0).to(D).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    return cfg, ref


def _inputs(cfg, pad_to=7):
    x = torch.randn(2, L, 32, generator=torch.Generator().manual_seed(1), dtype=D)
    pad = torch.ones(2, L, dtype=torch.long)
    pad[1, pad_to:] = 0  # item 1: 7 tokens and 3 of padding
    pos = torch.arange(L)[None].expand(2, L)
    keep = ak.masks.causal(L) & ak.masks.from_lengths(pad.sum(1), L)
    return x, pad, pos, keep


def _run_ref(cfg, ref, x, pad, pos, cache=None):
    """transformers' layer; returns its output and the index scores its indexer ranked."""
    hf_mask = masking_utils.create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=pad, cache=cache, position_ids=pos
    )
    rotary = v32.DeepseekV32RotaryEmbedding(cfg)  # made here: widened, its angles are float64
    seen = []
    topk = torch.Tensor.topk

    def recording(self, *args, **kwargs):
        seen.append(self)
        return topk(self, *args, **kwargs)

    torch.Tensor.topk = recording
    try:
        out = ref(x, rotary(x, pos), hf_mask, cache=cache, position_ids=pos)[0]
    finally:
        torch.Tensor.topk = topk
    return out, seen[0]


def _chosen_by_ref(scores, k, allowed):
    """The keys transformers keeps: its top-k of the masked scores, within the mask."""
    idx = scores.topk(min(k, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(allowed).scatter(-1, idx, True) & allowed


def test_indexer_scores_and_selection_match_transformers():
    cfg, ref = _ref()
    ours = SparseLatentAttention.from_transformers(ref)
    x, pad, pos, keep = _inputs(cfg)
    real = pad.bool()
    with widened(v32):
        _, hf_scores = _run_ref(cfg, ref, x, pad, pos)
    with torch.no_grad():
        q_latent = ours.q_norm(ours.w_dq(x))
        scores = ours.indexer.scores(x, q_latent, ours.indexer.keys(x))
    allowed = keep & real[:, :, None]
    err = (scores - hf_scores)[allowed].abs().max()
    assert err < 1e-12, err
    _, shipped = _run_ref(cfg, ref, x, pad, pos)  # as shipped: float32 scores
    torch.testing.assert_close(scores[allowed], shipped[allowed].to(D), atol=1e-4, rtol=1e-4)
    # the selection: no ties at the k-th score, so the set is well defined
    masked = scores.masked_fill(~keep, float("-inf"))
    top = masked.topk(5, dim=-1).values
    full = keep.sum(-1) > 4
    assert ((top[..., 3] - top[..., 4])[full & real].abs() > 1e-9).all()
    expected = _chosen_by_ref(hf_scores, 4, keep)
    got = ours.selection(x, keep)
    assert torch.equal(got[real], expected[real])
    assert (got.sum(-1) == keep.sum(-1).clamp(max=4)).all()


def test_layer_matches_transformers():
    cfg, ref = _ref()
    ours = SparseLatentAttention.from_transformers(ref)
    x, pad, pos, keep = _inputs(cfg)
    real = pad.bool()
    got = ours(x, keep).output
    with widened(v32):
        exact, _ = _run_ref(cfg, ref, x, pad, pos)
    err = (got - exact)[real].abs().max()
    assert err < 1e-12, err
    # as shipped (float32 RMSNorm, rotary angles, indexer scores and softmax)
    shipped, _ = _run_ref(cfg, ref, x, pad, pos)
    torch.testing.assert_close(got[real], shipped[real], atol=1e-5, rtol=1e-5)
    # the selection matters: dense MLA with the same weights differs
    dense = MultiHeadLatentAttention.forward(ours, x, keep).output
    assert (dense - got)[real].abs().max() > 1e-3
    # padding equals truncation
    alone = ours(x[1:, :7], ak.masks.causal(7)).output
    torch.testing.assert_close(alone[0], got[1, :7], atol=1e-13, rtol=1e-12)


def test_with_topk_at_least_n_it_is_plain_mla_and_transformers():
    cfg, ref = _ref(topk=L)
    ours = SparseLatentAttention.from_transformers(ref)
    x, pad, pos, keep = _inputs(cfg)
    real = pad.bool()
    mla = MultiHeadLatentAttention(
        32, 4, 8, head_dim=6, rope_dim=4, v_head_dim=5, q_rank=12, eps=1e-6, dtype=D
    )
    mla.load_state_dict({k: v for k, v in ours.state_dict().items() if "indexer" not in k})
    got = ours(x, keep).output
    torch.testing.assert_close(got, mla(x, keep).output, atol=1e-14, rtol=1e-13)
    with widened(v32):
        exact, _ = _run_ref(cfg, ref, x, pad, pos)
    assert (got - exact)[real].abs().max() < 1e-12


def test_gradients_match_transformers():
    cfg, ref = _ref()
    ours = SparseLatentAttention.from_transformers(ref)
    x, pad, pos, keep = _inputs(cfg)
    real = pad.bool()
    w = torch.randn(2, L, 32, generator=torch.Generator().manual_seed(5), dtype=D) * real[..., None]
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ours(xa, keep).output * w).sum().backward()
    with widened(v32):
        out, _ = _run_ref(cfg, ref, xb, pad, pos)
        (out * w).sum().backward()
    worst = (xa.grad - xb.grad).abs().max()
    mine = dict(ours.named_parameters())
    names = {
        "q_a_proj": "w_dq", "q_a_layernorm": "q_norm", "q_b_proj": "w_uq",
        "kv_a_proj_with_mqa": "w_dkv", "kv_a_layernorm": "kv_norm", "kv_b_proj": "w_ukv",
        "o_proj": "w_o",
    }  # fmt: skip
    for name, p in ref.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if prefix.startswith("indexer"):  # no gradient reaches the indexer in either
            assert p.grad is None
            continue
        worst = max(worst, (mine[f"{names[prefix]}.{leaf}"].grad - p.grad).abs().max())
    assert worst < 1e-11, worst
    assert xa.grad.abs().max() > 1e-3
    assert all(p.grad is None for p in ours.indexer.parameters())


@pytest.mark.parametrize("absorbed", [False, True])
def test_cached_decoding_equals_the_causal_pass_and_transformers_cache(absorbed):
    cfg, ref = _ref()
    ours = SparseLatentAttention.from_transformers(ref)
    x = torch.randn(2, L, 32, generator=torch.Generator().manual_seed(3), dtype=D)
    whole = ours(x, ak.masks.causal(L)).output
    cache = SparseLatentCache()
    parts = [ours(x[:, :5], ak.masks.causal(5), cache=cache, absorbed=absorbed).output]
    for t in range(5, L):  # one token at a time: each picks its top-k among all cached keys
        parts.append(ours(x[:, t : t + 1], cache=cache, absorbed=absorbed).output)
    stepped = torch.cat(parts, 1)
    assert (stepped - whole).abs().max() < 1e-12
    assert len(cache) == L and cache.index_key.shape == (2, L, 8)
    # transformers' own cache, the same steps
    ones = torch.ones(2, L, dtype=torch.long)
    pos = torch.arange(L)[None].expand(2, L)
    with widened(v32):
        hf_cache = cache_utils.DynamicCache(config=cfg)
        theirs = [_run_ref(cfg, ref, x[:, :5], ones[:, :5], pos[:, :5], hf_cache)[0]]
        for t in range(5, L):
            step = _run_ref(
                cfg, ref, x[:, t : t + 1], ones[:, : t + 1], pos[:, t : t + 1], hf_cache
            )
            theirs.append(step[0])
    assert (stepped - torch.cat(theirs, 1)).abs().max() < 1e-12


def test_decoding_steps_with_fewer_allowed_keys_than_k_equal_the_causal_pass():
    """Item 1's first 4 keys are masked for every query: its steps at N > k have fewer than k
    allowed keys, which a decoding step reads alone (the rest of its top-k unavailable)."""
    _, ref = _ref()
    ours = SparseLatentAttention.from_transformers(ref)
    x = torch.randn(2, L, 32, generator=torch.Generator().manual_seed(4), dtype=D)
    keep = ak.masks.causal(L).repeat(2, 1, 1)
    keep[1, :, :4] = False
    whole, weights = ours(x, keep, need_weights=True)
    chosen = weights[1, 0, 5:7] > 0  # item 1, queries 5-6: keys 4 … t, under k = 4
    assert torch.equal(chosen, keep[1, 5:7] & (torch.arange(L) < 7))
    cache = SparseLatentCache()
    parts = [ours(x[:, :5], keep[:, :5, :5], cache=cache).output]
    for t in range(5, L):
        step = ours(x[:, t : t + 1], keep[:, t : t + 1, : t + 1], cache=cache)
        parts.append(step.output)
    stepped = torch.cat(parts, 1)
    rows = keep.any(-1)  # (item 1's first 4 queries may attend nothing)
    assert (stepped - whole)[rows].abs().max() < 1e-12


def test_a_decoding_step_reads_the_same_keys_with_and_without_weights():
    _, ref = _ref()
    ours = SparseLatentAttention.from_transformers(ref)
    x = torch.randn(2, L, 32, generator=torch.Generator().manual_seed(6), dtype=D)
    caches = SparseLatentCache(), SparseLatentCache()
    for cache in caches:
        ours(x[:, :-1], ak.masks.causal(L - 1), cache=cache)
    plain = ours(x[:, -1:], cache=caches[0]).output
    out, weights = ours(x[:, -1:], cache=caches[1], need_weights=True)
    assert ((weights > 0).sum(-1) == 4).all()  # k of the N = 10 keys
    assert (plain - out).abs().max() < 1e-13


@pytest.mark.parametrize("absorbed", [False, True])
def test_cached_decoding_with_topk_at_least_n_is_plain_mla(absorbed):
    _, ref = _ref(topk=L)
    ours = SparseLatentAttention.from_transformers(ref)
    mla = MultiHeadLatentAttention(
        32, 4, 8, head_dim=6, rope_dim=4, v_head_dim=5, q_rank=12, eps=1e-6, dtype=D
    )
    mla.load_state_dict({k: v for k, v in ours.state_dict().items() if "indexer" not in k})
    x = torch.randn(2, L, 32, generator=torch.Generator().manual_seed(7), dtype=D)
    cache = SparseLatentCache()
    parts = [ours(x[:, :3], ak.masks.causal(3), cache=cache, absorbed=absorbed).output]
    for t in range(3, L):
        parts.append(ours(x[:, t : t + 1], cache=cache, absorbed=absorbed).output)
    assert cache.index_key.shape == (2, L, 8)  # the indexer's keys cached all the same
    expected = mla(x, ak.masks.causal(L)).output
    assert (torch.cat(parts, 1) - expected).abs().max() < 1e-12


def test_bad_arguments_name_themselves():
    cfg, ref = _ref()
    ours = SparseLatentAttention.from_transformers(ref)
    with pytest.raises(TypeError, match="cache"):
        ours(torch.zeros(1, 2, 32, dtype=D), cache=ak.modern.LatentCache())
    with pytest.raises(ValueError, match="x must be"):
        ours(torch.zeros(1, 2, 31, dtype=D))
    with pytest.raises(TypeError, match="DeepseekV32Attention"):
        SparseLatentAttention.from_transformers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="q_rank"):
        SparseLatentAttention(32, 4, 8, q_rank=None, index_heads=2, index_head_dim=4, index_topk=2)
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type"):
        SparseLatentAttention.from_transformers(ref)
