"""Gated attention (Qiu et al. 2025; Qwen3-Next): ``GatedAttention.from_transformers`` — a
MultiHeadAttention with ``qk=[HeadNorm, "position"]``, partial rotary positions and the
elementwise output gate — equals transformers' ``Qwen3NextAttention`` with the same weights in
float64: prefill, a padded batch, cached decoding step by step (ours and transformers' own
cache) and the gradients of every weight; the layer learns flag retrieval."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kv_cache import LayerCache
from attnkit.modern import GatedAttention

qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
cache_utils = pytest.importorskip("transformers.cache_utils")

F64 = torch.float64
E, H, H_KV, D, THETA, PARTIAL = 32, 4, 2, 8, 1000.0, 0.5


def _config(bias=False):
    config = qn.Qwen3NextConfig(
        hidden_size=E, num_attention_heads=H, num_key_value_heads=H_KV, head_dim=D,
        rope_parameters={"rope_type": "default", "rope_theta": THETA,
                         "partial_rotary_factor": PARTIAL},
        attention_bias=bias, rms_norm_eps=1e-6, num_hidden_layers=1,
        layer_types=["full_attention"], vocab_size=10, intermediate_size=16,
        max_position_embeddings=64,
    )  # fmt: skip
    config._attn_implementation = "sdpa"  # eager takes its softmax in float32
    return config


def _in_float64(norm):
    """Qwen3-Next's RMSNorm computes in float32 whatever its input; the same formula
    (x / RMS(x) · (1 + w)) in the input's dtype, so that float64 compares at float64
    precision (the only change)."""

    def forward(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)

    norm.forward = forward


def _reference(bias=False, seed=0):
    torch.manual_seed(seed)
    config = _config(bias)
    module = qn.Qwen3NextAttention(config, layer_idx=0).to(F64).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)  # norm gains 1 + w far from 1, biases and gates far from 0
    _in_float64(module.q_norm)
    _in_float64(module.k_norm)
    return module


def _rotary(positions):
    """cos, sin (B, L, r) of Qwen3-Next's partial rotary embedding (rotate-half layout, the
    first r = PARTIAL · D features) in float64 (its own module computes them in float32)."""
    r = int(D * PARTIAL)
    inv_freq = 1.0 / THETA ** (torch.arange(0, r, 2, dtype=F64) / r)
    freqs = positions[..., None].to(F64) * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def _additive(allowed):
    """A boolean (B, M, N) mask as transformers' additive (B, 1, M, N)."""
    zero = torch.zeros(allowed.shape, dtype=F64)
    return zero.masked_fill(~allowed, torch.finfo(F64).min)[:, None]


def test_its_own_rotary_embedding_is_the_one_in_the_tests():
    config = _config()
    x = torch.zeros(1, 6, E)
    cos, sin = qn.Qwen3NextRotaryEmbedding(config)(x, torch.arange(6)[None])
    ref_cos, ref_sin = _rotary(torch.arange(6)[None])
    torch.testing.assert_close(cos.double(), ref_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.double(), ref_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("lengths", [[7, 7], [7, 4]], ids=["full", "padded"])
def test_equals_qwen3_next_attention_forward_and_gradients(bias, lengths):
    module = _reference(bias)
    mha = GatedAttention.from_transformers(module)
    assert mha.gate is not None and mha.gate.kind == "elementwise"
    x = torch.randn(2, 7, E, dtype=F64, generator=torch.Generator().manual_seed(1))
    allowed = ak.masks.causal(7) & ak.masks.from_lengths(torch.tensor(lengths), 7)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, _ = module(xr, _rotary(torch.arange(7)[None]), _additive(allowed))
    got = mha(xo, mask=allowed).context
    real = ak.masks.from_lengths(torch.tensor(lengths), 7)[:, 0]  # (B, L) real tokens
    torch.testing.assert_close(got[real], expected[real], rtol=1e-12, atol=1e-13)
    probe = torch.randn(got.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    probe = probe * real[..., None]  # padded rows: transformers attends their own key
    (expected * probe).sum().backward()
    (got * probe).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-11, atol=1e-12)
    q_grad = module.q_proj.weight.grad.unflatten(0, (H, 2, D))
    ours = mha.in_proj_weight.grad
    torch.testing.assert_close(ours[: H * D], q_grad[:, 0].flatten(0, 1), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(
        mha.gate.proj.weight.grad, q_grad[:, 1].flatten(0, 1), rtol=1e-11, atol=1e-12
    )
    torch.testing.assert_close(
        ours[H * D :], torch.cat([module.k_proj.weight.grad, module.v_proj.weight.grad])
    )
    torch.testing.assert_close(mha.out_proj.weight.grad, module.o_proj.weight.grad)
    norm = mha.qk[0]
    torch.testing.assert_close(norm.q_weight.grad, module.q_norm.weight.grad)
    torch.testing.assert_close(norm.k_weight.grad, module.k_norm.weight.grad)
    if bias:
        q_bias = module.q_proj.bias.grad.unflatten(0, (H, 2, D))
        torch.testing.assert_close(mha.gate.proj.bias.grad, q_bias[:, 1].flatten())
        torch.testing.assert_close(mha.in_proj_bias.grad[: H * D], q_bias[:, 0].flatten())


def test_the_gate_changes_the_output():
    """Without the gate the layer is not Qwen3-Next's: the comparison above can fail."""
    module = _reference()
    mha = GatedAttention.from_transformers(module)
    mha.gate = None
    x = torch.randn(1, 5, E, dtype=F64, generator=torch.Generator().manual_seed(3))
    allowed = ak.masks.causal(5)[None]
    with torch.no_grad():
        expected, _ = module(x, _rotary(torch.arange(5)[None]), _additive(allowed))
        got = mha(x, mask=allowed).context
    assert (got - expected).abs().max() > 1e-2


def test_cached_decoding_equals_the_causal_pass_and_transformers_cache():
    module = _reference(bias=True, seed=4)
    mha = GatedAttention.from_transformers(module)
    x = torch.randn(2, 6, E, dtype=F64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = mha(x, mask=ak.masks.causal(6)).context
        cache = LayerCache()
        steps = [mha(x[:, :3], mask=ak.masks.causal(3), cache=cache).context]
        steps += [mha(x[:, t : t + 1], cache=cache).context for t in range(3, 6)]
        hf_cache = cache_utils.DynamicCache()
        first = _additive(ak.masks.causal(3)[None].expand(2, 3, 3))
        hf = [module(x[:, :3], _rotary(torch.arange(3)[None]), first, cache=hf_cache)[0]]
        for t in range(3, 6):
            pos = torch.tensor([[t]])
            hf.append(module(x[:, t : t + 1], _rotary(pos), None, cache=hf_cache)[0])
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(torch.cat(steps, 1), torch.cat(hf, 1), rtol=1e-12, atol=1e-13)


def test_as_shipped_it_agrees_to_float32_rounding():
    """transformers' own RMSNorm and rotary embedding (float32 steps), unchanged."""
    torch.manual_seed(6)
    config = _config()
    module = qn.Qwen3NextAttention(config, layer_idx=0).to(F64).eval()
    mha = GatedAttention.from_transformers(module)
    x = torch.randn(2, 6, E, dtype=F64, generator=torch.Generator().manual_seed(7))
    allowed = ak.masks.causal(6)[None].expand(2, 6, 6)
    rope = qn.Qwen3NextRotaryEmbedding(config)(x, torch.arange(6)[None])
    with torch.no_grad():
        expected, _ = module(x, rope, _additive(allowed))
        got = mha(x, mask=allowed).context
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_gated_attention_learns_flag_retrieval():
    """One gated layer over token + flag embeddings (the flag-retrieval task of the other
    parts: chance is 1/8) reaches the flagged token."""
    from flag_task import EMBED, VOCAB, batch

    torch.manual_seed(0)
    tok, flag_emb = torch.nn.Embedding(VOCAB, EMBED), torch.nn.Embedding(3, EMBED)
    mha = GatedAttention(EMBED, 2)
    out = torch.nn.Linear(EMBED, VOCAB)
    params = [*tok.parameters(), *flag_emb.parameters(), *mha.parameters(), *out.parameters()]
    opt = torch.optim.Adam(params, 1e-2)

    def predict(x, flag):
        h = tok(x) + flag_emb(flag)
        return out(mha(h).context[:, -1])

    g = torch.Generator().manual_seed(1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend
    try:
        for _ in range(60):
            x, flag, y = batch(32, g)
            loss = torch.nn.functional.cross_entropy(predict(x, flag), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    x, flag, y = batch(1000, torch.Generator().manual_seed(99))
    with torch.no_grad():
        assert float((predict(x, flag).argmax(-1) == y).float().mean()) > 0.9


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="Qwen3NextAttention, got Linear"):
        GatedAttention.from_transformers(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="GatedAttention needs a gate"):
        GatedAttention(8, 2, gate=None)
    with pytest.raises(TypeError, match="unexpected argument 'heads_dim'"):
        ak.mechanisms.build("gated_attention", embed_dim=8, num_heads=2, heads_dim=4)
