"""The output gate (attnkit.output_gate) and MultiHeadAttention's ``gate=``: the gate is its
formula per head and channel; without it the layer is unchanged; with it the layer equals
(concat(heads) ⊙ σ(query W_g + b_g)) W^O written out by hand (elementwise and headwise, grouped
keys, cross-attention), decodes with a KV cache, reads a fixed memory, and leaves the
``context`` hook point before the gate."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.kv_cache import LayerCache, MemoryCache
from attnkit.output_gate import OutputGate

F64 = torch.float64
E, H, D = 12, 3, 4


def test_the_gate_is_its_formula_per_head_and_channel():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 12, generator=g, dtype=F64)
    context = torch.randn(2, 5, 3 * 4, generator=g, dtype=F64)
    for kind in ("elementwise", "headwise"):
        gate = OutputGate(12, 3, 4, kind, dtype=F64)
        with torch.no_grad():
            gate.proj.bias.normal_(generator=g)
        w, b = gate.proj.weight, gate.proj.bias
        got = gate(x, context)
        for h in range(3):
            for c in range(4):
                row = h * 4 + c if kind == "elementwise" else h
                logit = (x * w[row]).sum(-1) + b[row]
                expected = context[..., h * 4 + c] / (1 + torch.exp(-logit))
                torch.testing.assert_close(got[..., h * 4 + c], expected, rtol=1e-13, atol=0)


def _gated(kind, seed=0, **kw):
    torch.manual_seed(seed)
    mha = ak.MultiHeadAttention(E, H, gate=kind, dtype=F64, **kw).eval()
    with torch.no_grad():  # biases away from 0, so that each one is checked
        for p in mha.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.5)
    return mha


def _by_hand(mha, query, key, mask=None):
    """Eqs. 38-40 with the gate, from the layer's parameters, head by head."""
    kv_heads = mha.num_kv_heads
    sizes = (H * D, kv_heads * D, kv_heads * D)
    if mha.packed:
        wq, wk, wv = mha.in_proj_weight.split(sizes)
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    bq, bk, bv = mha.in_proj_bias.split(sizes)
    q, k, v = query @ wq.T + bq, key @ wk.T + bk, key @ wv.T + bv
    gates = torch.sigmoid(query @ mha.gate.proj.weight.T + mha.gate.proj.bias)
    heads = []
    for h in range(H):
        g = h // (H // kv_heads)
        qh, kh, vh = (
            q[..., h * D : (h + 1) * D],
            k[..., g * D : (g + 1) * D],
            v[..., g * D : (g + 1) * D],
        )
        scores = qh @ kh.transpose(-1, -2) / math.sqrt(D)
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        context = torch.softmax(scores, -1) @ vh
        gate = (
            gates[..., h * D : (h + 1) * D]
            if mha.gate.kind == "elementwise"
            else gates[..., h : h + 1]
        )
        heads.append(context * gate)
    return torch.cat(heads, -1) @ mha.out_proj.weight.T + mha.out_proj.bias


def test_without_a_gate_the_layer_is_unchanged():
    x = torch.randn(2, 5, E, dtype=F64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    plain = ak.MultiHeadAttention(E, H, dtype=F64)
    torch.manual_seed(0)
    none = ak.MultiHeadAttention(E, H, gate=None, dtype=F64)
    assert none.gate is None
    assert list(none.state_dict()) == list(plain.state_dict())
    for (name, a), b in zip(plain.state_dict().items(), none.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(none(x).context, plain(x).context)
    torch_mha = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=F64)
    expected, _ = torch_mha(x, x, x, need_weights=False)
    ours = ak.MultiHeadAttention.from_torch(torch_mha)
    torch.testing.assert_close(ours(x).context, expected, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("kind", ["elementwise", "headwise"])
def test_the_gated_layer_is_its_formula(kind):
    mha = _gated(kind)
    x = torch.randn(2, 6, E, dtype=F64, generator=torch.Generator().manual_seed(2))
    keep = ak.masks.causal(6) & ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    got = mha(x, mask=keep).context
    real = ak.masks.from_lengths(torch.tensor([6, 4]), 6)[:, 0]
    torch.testing.assert_close(got[real], _by_hand(mha, x, x, keep)[real], rtol=1e-12, atol=1e-13)


def test_grouped_keys_and_cross_attention_gate_by_the_query():
    mha = _gated("elementwise", num_kv_heads=1, kdim=5, vdim=5)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(2, 4, E, dtype=F64, generator=g)
    memory = torch.randn(2, 7, 5, dtype=F64, generator=g)
    got = mha(query, memory, memory).context
    torch.testing.assert_close(got, _by_hand(mha, query, memory), rtol=1e-12, atol=1e-13)
    cache = MemoryCache()
    first = mha(query, memory, memory, memory_cache=cache).context
    again = mha(query[:, :2], memory, memory, memory_cache=cache).context
    torch.testing.assert_close(first, got)
    torch.testing.assert_close(again, got[:, :2])


@pytest.mark.parametrize("kind", ["elementwise", "headwise"])
def test_cached_decoding_equals_the_causal_pass(kind):
    mha = _gated(kind, seed=4, position="rope")
    x = torch.randn(2, 6, E, dtype=F64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        whole = mha(x, mask=ak.masks.causal(6)).context
        cache = LayerCache()
        steps = [mha(x[:, :2], mask=ak.masks.causal(2), cache=cache).context]
        steps += [mha(x[:, t : t + 1], cache=cache).context for t in range(2, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-12, atol=1e-13)


def test_unbatched_input_and_gradients():
    mha = _gated("headwise", seed=6)
    x = torch.randn(4, E, dtype=F64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(mha(x).context, mha(x[None]).context[0])
    torch.autograd.gradcheck(lambda t: mha(t, mask=ak.masks.causal(4)).context, x.requires_grad_())


def test_the_context_hook_point_is_before_the_gate():
    mha = _gated("elementwise", seed=8)
    x = torch.randn(1, 5, E, dtype=F64, generator=torch.Generator().manual_seed(9))
    with ak.hooks.record(mha) as rec:
        out = mha(x).context
    context = rec["context"].transpose(-2, -3).flatten(-2)  # (B, M, H·d): the heads' Σ a v
    torch.testing.assert_close(mha.out_proj(mha.gate(x, context)), out)
    assert not torch.allclose(mha.out_proj(context), out)


def test_a_gate_module_is_used_as_given_and_bad_gates_are_refused():
    gate = OutputGate(E, H, D, "headwise")
    assert ak.MultiHeadAttention(E, H, gate=gate).gate is gate
    with pytest.raises(ValueError, match="gate must be one of 'elementwise', 'headwise'"):
        ak.MultiHeadAttention(E, H, gate="sigmoid")
    with pytest.raises(ValueError, match="gate must be one of"):
        ak.MultiHeadAttention(E, H, gate=True)
    with pytest.raises(ValueError, match="gate reads 8 features and gates 2 heads of 4"):
        ak.MultiHeadAttention(E, H, gate=OutputGate(8, 2, 4))
    no_bias = ak.MultiHeadAttention(E, H, bias=False, gate="elementwise")
    assert no_bias.gate.proj.bias is None


def test_bad_gate_arguments_name_themselves():
    with pytest.raises(ValueError, match="kind must be one of"):
        OutputGate(8, 2, 4, "channelwise")
    with pytest.raises(ValueError, match="OutputGate gates 2 heads of 4"):
        OutputGate(8, 2, 4)(torch.randn(1, 3, 8), torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match="reads tokens of 8 features"):
        OutputGate(8, 2, 4)(torch.randn(1, 3, 7), torch.randn(1, 3, 8))
