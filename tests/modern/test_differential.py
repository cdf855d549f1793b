"""Differential attention (Ye et al. 2024): equal to transformers' DiffLlama attention with the
same weights (whole layer, and per head with its rotary embedding), λ and λ_init as eq. 2, a
loop over heads from eqs. 1-3, and learning the flag-retrieval task."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.modern import DifferentialAttention, lambda_init

D = torch.float64
dl = pytest.importorskip("transformers.models.diffllama.modeling_diffllama")
masking_utils = pytest.importorskip("transformers.masking_utils")

E, H, HD = 32, 4, 8  # DiffLlama: H heads of HD; ours: H/2 differential heads of 2·HD


def _reference(layer_idx=2):
    cfg = dl.DiffLlamaConfig(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=H, head_dim=HD,
        intermediate_size=16, num_hidden_layers=3, vocab_size=10, max_position_embeddings=32,
        lambda_std_dev=0.3,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = dl.DiffLlamaAttention(cfg, layer_idx).to(D).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    return cfg, ref


def _pair_rows():
    """Our head i is DiffLlama's heads i (Q_1, K_1, first half of V) and i + H/2 (Q_2, K_2,
    second half of V): the row order of our projections in DiffLlama's."""
    return torch.cat(
        [torch.arange(i * HD, (i + 1) * HD) for j in range(H // 2) for i in (j, j + H // 2)]
    )


def _ours(ref, layer_idx=2):
    part = DifferentialAttention(2 * HD, depth=layer_idx + 1, eps=ref.groupnorm.eps, dtype=D)
    mha = ak.MultiHeadAttention(E, H // 2, head_dim=2 * HD, bias=False, attention=part, dtype=D)
    rows = _pair_rows()
    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([ref.q_proj.weight[rows], ref.k_proj.weight[rows], ref.v_proj.weight[rows]])
        )
        mha.out_proj.weight.copy_(ref.o_proj.weight)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            getattr(part, name).copy_(getattr(ref, name))
    return mha.eval()


def test_lambda_init_is_eq_2():
    assert lambda_init(1) == pytest.approx(0.2)
    assert lambda_init(3) == pytest.approx(0.8 - 0.6 * math.exp(-0.6))
    assert lambda_init(3) == pytest.approx(dl.lambda_init_fn(2))  # transformers counts from 0


def test_matches_transformers_diffllama_without_positions():
    """The whole layer, DiffLlama given an identity rotary embedding (cos 1, sin 0)."""
    cfg, ref = _reference()
    mha = _ours(ref)
    x = torch.randn(2, 7, E, generator=torch.Generator().manual_seed(1), dtype=D)
    hf_mask = masking_utils.create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=None, cache=None,
        position_ids=torch.arange(7)[None],
    )  # fmt: skip
    identity = (torch.ones(2, 7, HD, dtype=D), torch.zeros(2, 7, HD, dtype=D))
    expected = ref(x, identity, hf_mask)[0]
    got = mha(x, mask=ak.masks.causal(7)).context
    # transformers sums λ's dot products and runs softmax in float32
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_matches_transformers_diffllama_per_head_with_its_rotary_embedding():
    """DiffLlama's projections and rotary embedding, our part per differential head, its W^O."""
    cfg, ref = _reference(layer_idx=1)
    mha = _ours(ref, layer_idx=1)
    x = torch.randn(2, 7, E, generator=torch.Generator().manual_seed(2), dtype=D)
    pos = torch.arange(7)[None].expand(2, 7)
    hf_mask = masking_utils.create_causal_mask(
        config=cfg, inputs_embeds=x, attention_mask=None, cache=None, position_ids=pos
    )
    cos, sin = dl.DiffLlamaRotaryEmbedding(cfg)(x, pos)
    expected = ref(x, (cos, sin), hf_mask)[0]

    def heads(w):
        return (x @ w.T).unflatten(-1, (H, HD)).transpose(1, 2)  # (B, H, N, HD)

    q, k = dl.apply_rotary_pos_emb(heads(ref.q_proj.weight), heads(ref.k_proj.weight), cos, sin)
    v = heads(ref.v_proj.weight)
    half = H // 2
    pair = [torch.cat([t[:, :half], t[:, half:]], -1) for t in (q, k, v)]  # (B, H/2, N, 2·HD)
    context = mha.attention(*pair, mask=ak.masks.causal(7)).context
    got = ref.o_proj(context.transpose(1, 2).flatten(-2))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_equals_a_loop_over_heads_from_eqs_1_to_3():
    torch.manual_seed(3)
    part = DifferentialAttention(6, depth=4, lambda_std=0.4).to(D)
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 3, 5, 6, generator=g, dtype=D) for _ in range(2))
    v = torch.randn(2, 3, 5, 4, generator=g, dtype=D)
    keep = ak.masks.from_lengths(torch.tensor([5, 2]), 5)  # (2, 1, 5)
    out = part(q, k, v, mask=keep[:, None], need_weights=True)
    lam = (
        math.exp(float(part.lambda_q1.detach() @ part.lambda_k1.detach()))
        - math.exp(float(part.lambda_q2.detach() @ part.lambda_k2.detach()))
        + 0.8
        - 0.6 * math.exp(-0.3 * 3)
    )
    for b in range(2):
        n = int(keep[b].sum())
        for h in range(3):
            a1 = torch.softmax(q[b, h, :, :3] @ k[b, h, :n, :3].T / math.sqrt(3), -1)
            a2 = torch.softmax(q[b, h, :, 3:] @ k[b, h, :n, 3:].T / math.sqrt(3), -1)
            diff = (a1 - lam * a2) @ v[b, h, :n]
            rms = diff.pow(2).mean(-1, keepdim=True).add(part.eps).sqrt()
            torch.testing.assert_close(out.context[b, h], (1 - part.lambda_init) * diff / rms)
            torch.testing.assert_close(out.weights[b, h, :, :n], a1 - lam * a2)
            torch.testing.assert_close(out.extra["maps"][b, h, 0, :, :n], a1)
    assert (out.weights[1, :, :, 2:] == 0).all()


def test_learns_flag_retrieval():
    from flag_task import flag_retrieval_accuracy

    torch.manual_seed(0)
    assert flag_retrieval_accuracy(DifferentialAttention(16), steps=150) > 0.9


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="head_dim must be even"):
        DifferentialAttention(5)
    with pytest.raises(ValueError, match="depth"):
        DifferentialAttention(4, depth=0)
    with pytest.raises(ValueError, match="head_dim=4"):
        DifferentialAttention(4)(*(torch.randn(1, 3, 6) for _ in range(3)))
