"""The q/k chain of MultiHeadAttention (attnkit.qk_chain): QK-norm, then RoPE, equals Qwen3's
attention (per-head norm) and OLMo 2's (whole-projection norm) with their weights copied, in
float64, with and without padding, and under cached decoding; the order matters and is kept."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kv_cache import LayerCache
from attnkit.positions.rope_scaling import ScaledRotary
from attnkit.qk_chain import HeadNorm, ProjectionNorm, QKTransform

transformers = pytest.importorskip("transformers")
from transformers.models.olmo2 import modeling_olmo2 as olmo2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402

F64 = torch.float64
E, H, H_KV, D, THETA = 32, 4, 2, 8, 1000.0


def _config(cls):
    config = cls(
        hidden_size=E,
        num_attention_heads=H,
        num_key_value_heads=H_KV,
        head_dim=D,
        rope_theta=THETA,
        rms_norm_eps=1e-6,
        attention_bias=False,
        max_position_embeddings=64,
        num_hidden_layers=1,
        intermediate_size=16,
        vocab_size=10,
    )
    config._attn_implementation = "sdpa"  # eager takes its softmax in float32
    return config


def _in_input_dtype(norm):
    """The models' RMSNorm computes in float32 whatever its input; the same formula in the
    input's dtype, so that float64 compares at float64 precision (the only change)."""

    def forward(hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return norm.weight * (hidden * torch.rsqrt(variance + norm.variance_epsilon))

    norm.forward = forward


def _reference(kind, exact=True):
    """The transformers module with random weights and norm gains, its rotary embedding; with
    ``exact`` its norms compute in float64 (:func:`_in_input_dtype`)."""
    torch.manual_seed(0)
    if kind == "qwen3":
        config = _config(qwen3.Qwen3Config)
        module = qwen3.Qwen3Attention(config, layer_idx=0)
        rope = qwen3.Qwen3RotaryEmbedding(config)
    else:
        config = _config(olmo2.Olmo2Config)
        module = olmo2.Olmo2Attention(config, layer_idx=0)
        rope = olmo2.Olmo2RotaryEmbedding(config)
    module = module.to(F64).eval()
    with torch.no_grad():
        module.q_norm.weight.uniform_(0.5, 1.5)  # gains other than 1, so that the order shows
        module.k_norm.weight.uniform_(0.5, 1.5)
    if exact:
        _in_input_dtype(module.q_norm)
        _in_input_dtype(module.k_norm)
    return module, rope


def _attnkit(module, kind, order=("norm", "position")):
    """MultiHeadAttention with the module's weights and the chain in ``order``."""
    if kind == "qwen3":
        norm = HeadNorm(D, eps=1e-6, dtype=F64)
    else:
        norm = ProjectionNorm(H, D, num_kv_heads=H_KV, eps=1e-6, dtype=F64)
    chain = [norm if step == "norm" else step for step in order]
    mha = ak.MultiHeadAttention(
        E,
        H,
        num_kv_heads=H_KV,
        head_dim=D,
        bias=False,
        position=ScaledRotary(THETA, layout="halves"),
        qk=chain,
        dtype=F64,
    )
    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight])
        )
        mha.out_proj.weight.copy_(module.o_proj.weight)
        norm.q_weight.copy_(module.q_norm.weight)
        norm.k_weight.copy_(module.k_norm.weight)
    return mha.eval()


def _rotary(n):
    """cos, sin (1, n, d) of the models' RoPE (rotate-half layout), in float64: the models'
    rotary embeddings compute them in float32, which would hide the comparison at 1e-8."""
    inv_freq = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=F64) / D)
    freqs = torch.arange(n, dtype=F64)[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)[None]
    return emb.cos(), emb.sin()


def _run_reference(module, rope, x, allowed):
    """The transformers module on x (B, L, E) with a boolean (B, L, L) mask, as an additive one."""
    float32 = rope(x.float(), torch.arange(x.shape[1])[None])
    cos, sin = _rotary(x.shape[1])
    torch.testing.assert_close(float32[0].double(), cos, rtol=0, atol=1e-6)  # the models' RoPE
    additive = torch.zeros(allowed.shape, dtype=F64).masked_fill(~allowed, torch.finfo(F64).min)
    out, _ = module(x, (cos, sin), additive[:, None])
    return out


def _padded_causal(lengths, n):
    keys = ak.masks.from_lengths(torch.tensor(lengths), n)  # (B, 1, N)
    return ak.masks.causal(n) & keys  # (B, N, N)


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
@pytest.mark.parametrize("lengths", [[7, 7], [7, 4]], ids=["full", "padded"])
def test_norm_then_rope_equals_the_transformers_attention(kind, lengths):
    module, rope = _reference(kind)
    mha = _attnkit(module, kind)
    x = torch.randn(2, 7, E, dtype=F64, generator=torch.Generator().manual_seed(1))
    allowed = _padded_causal(lengths, 7)
    with torch.no_grad():
        want = _run_reference(module, rope, x, allowed)
        got = mha(x, mask=allowed).context
    for b, n in enumerate(lengths):  # rows of padding queries attend nothing real in either
        torch.testing.assert_close(got[b, :n], want[b, :n], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_the_modules_as_shipped_agree_to_their_float32_norm(kind):
    module, rope = _reference(kind, exact=False)
    mha = _attnkit(module, kind)
    x = torch.randn(2, 7, E, dtype=F64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = _run_reference(module, rope, x, ak.masks.causal(7)[None])
        got = mha(x, mask=ak.masks.causal(7)).context
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_cached_decoding_with_the_chain_equals_the_causal_pass(kind):
    module, rope = _reference(kind)
    mha = _attnkit(module, kind)
    x = torch.randn(1, 6, E, dtype=F64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = _run_reference(module, rope, x, ak.masks.causal(6)[None])
        cache = LayerCache()
        steps = [mha(x[:, :3], mask=ak.masks.causal(3), cache=cache).context]
        steps += [mha(x[:, t : t + 1], cache=cache).context for t in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["qwen3", "olmo2"])
def test_rope_then_norm_is_another_layer(kind):
    """The order is kept: normalising after the rotation (what QKNormAttention inside a layer
    with RoPE does) gives other outputs once the gains are not 1."""
    module, rope = _reference(kind)
    x = torch.randn(1, 5, E, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _run_reference(module, rope, x, ak.masks.causal(5)[None])
        after = _attnkit(module, kind, order=("position", "norm"))(x, mask=ak.masks.causal(5))
    assert (after.context - want).abs().max() > 1e-3


def test_gradients_reach_the_chain_and_the_layer_keeps_its_parameters():
    norm = HeadNorm(4)
    mha = ak.MultiHeadAttention(8, 2, position="rope", qk=[norm, "position"])
    assert {"qk.0.q_weight", "qk.0.k_weight"} <= set(dict(mha.named_parameters()))
    mha(torch.randn(2, 3, 8)).context.sum().backward()
    assert norm.q_weight.grad is not None and norm.k_weight.grad.abs().sum() > 0


def test_layer_norm_kind_equals_torch_layer_norm_per_head():
    norm = HeadNorm(4, kind="layer", eps=1e-5, dtype=F64)
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(-1, 1)
    q, k = torch.randn(2, 3, 5, 4, dtype=F64), torch.randn(2, 3, 5, 4, dtype=F64)
    gq, gk = norm(q, k)
    ln = torch.nn.functional.layer_norm
    torch.testing.assert_close(gq, ln(q, (4,), norm.q_weight, norm.q_bias, 1e-5))
    torch.testing.assert_close(gk, ln(k, (4,), norm.k_weight, norm.k_bias, 1e-5))


def test_a_chain_is_checked_when_the_layer_is_built():
    with pytest.raises(ValueError, match="put 'position' in the chain"):
        ak.MultiHeadAttention(8, 2, position="rope", qk=[HeadNorm(4)])
    with pytest.raises(ValueError, match="names 'position' 2 times"):
        ak.MultiHeadAttention(8, 2, qk=["position", "position"])
    with pytest.raises(TypeError, match=r"a qk step must be an attnkit\.qk_chain\.QKTransform"):
        ak.MultiHeadAttention(8, 2, qk=[torch.nn.LayerNorm(4), "position"])
    with pytest.raises(TypeError, match="qk must be a sequence of steps"):
        ak.MultiHeadAttention(8, 2, qk=HeadNorm(4))
    ak.MultiHeadAttention(8, 2, qk=[HeadNorm(4)])  # no scheme: nothing to place
    with pytest.raises(ValueError, match="HeadNorm has gains for heads of 3 features"):
        ak.MultiHeadAttention(8, 2, qk=[HeadNorm(3)])(torch.randn(1, 2, 8))


def test_a_step_of_ones_own_runs_where_it_is_placed():
    class Scale(QKTransform):
        def forward(self, q, k):
            return 2 * q, k

    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, qk=[Scale()])
    plain = ak.MultiHeadAttention(8, 2)  # with W^Q and its bias doubled by hand
    plain.load_state_dict(mha.state_dict())
    with torch.no_grad():
        plain.in_proj_weight[:8] *= 2
        plain.in_proj_bias[:8] *= 2
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(mha(x).context, plain(x).context)
