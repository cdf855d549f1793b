"""The 8-bit KV cache: codes and scales equal a loop over channels (keys, per group of tokens)
and tokens (values); dequantised reads within half a step; a drop-in cache for
MultiHeadAttention and DecoderLM whose error is bounded; its bytes; rollback; refusals."""

import pytest
import torch

import attnkit as ak
from attnkit import masks
from attnkit.kv_cache import KVCache, LayerCache
from attnkit.kv_quant import QuantizedKVCache, QuantizedLayerCache, dequantize, quantize
from attnkit.models.decoder_lm import DecoderLM

F64 = torch.float64


def _reference(x):
    """min-max 8-bit round trip of a 1-D tensor, element by element."""
    low, high = float(x.min()), float(x.max())
    step = (high - low) / 255 or 1.0
    return torch.tensor([low + round((float(t) - low) / step) * step for t in x], dtype=x.dtype)


def test_quantize_round_trips_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, dtype=F64, generator=g)
    x[1, 2] = 0.25  # a constant slice: exact
    codes, scale, zero = quantize(x, -1)
    assert codes.dtype == torch.uint8 and scale.shape == zero.shape == (3, 5, 1)
    back = dequantize(codes, scale, zero)
    for i in range(3):
        for j in range(5):
            torch.testing.assert_close(back[i, j], _reference(x[i, j]), atol=1e-12, rtol=0)
    assert torch.equal(back[1, 2], x[1, 2])
    assert ((back - x).abs() <= scale / 2 + 1e-12).all()


def test_keys_per_channel_per_group_and_values_per_token():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 3, 11, 4, dtype=F64, generator=g) * torch.tensor([1, 10, 0.1, 3.0])
    v = torch.randn(2, 3, 11, 5, dtype=F64, generator=g)
    cache = QuantizedLayerCache(group=4)
    keys, values = cache.append(k[:, :, :6], v[:, :, :6])
    for t in range(6, 11):
        keys, values = cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert len(cache) == 11 and cache.k_codes.shape == (2, 3, 8, 4)
    assert cache.k_scale.shape == (2, 3, 2, 4) and cache.k_residual.shape == (2, 3, 3, 4)
    for b in range(2):
        for h in range(3):
            for start in (0, 4):  # each full group, channel by channel
                for c in range(4):
                    want = _reference(k[b, h, start : start + 4, c])
                    got = keys[b, h, start : start + 4, c]
                    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
            for t in range(11):
                torch.testing.assert_close(
                    values[b, h, t], _reference(v[b, h, t]), atol=1e-12, rtol=0
                )
    assert torch.equal(keys[..., 8:, :], k[..., 8:, :])  # the residual, in full precision


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_a_drop_in_cache_for_multihead_attention(kv_heads):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(32, 4, num_kv_heads=kv_heads, position="rope", dtype=F64).eval()
    x = torch.randn(2, 40, 32, dtype=F64, generator=torch.Generator().manual_seed(2))
    exact, quant = LayerCache(), QuantizedLayerCache(group=8)
    with torch.no_grad():
        outs = {}
        for name, cache in (("exact", exact), ("quant", quant)):
            first = mha(x[:, :16], cache=cache, mask=masks.causal(16)).context
            rest = [mha(x[:, t : t + 1], cache=cache).context for t in range(16, 40)]
            outs[name] = torch.cat([first, *rest], 1)
        full = mha(x, mask=masks.causal(40)).context
    torch.testing.assert_close(outs["exact"], full, atol=1e-12, rtol=1e-12)
    error = (outs["quant"] - full).abs().max()
    assert 0 < error < 2e-2  # 8-bit error: not zero, and small against outputs of size ~1
    assert quant.nbytes < exact.nbytes / 2  # d = 8: 3 bytes a number (codes, float64 scales)


def test_decoder_lm_decodes_through_the_quantized_cache():
    torch.manual_seed(0)
    lm = DecoderLM(31, 32, 4, 2, max_len=64, position="rope", dtype=F64).eval()
    prompt = torch.randint(0, 31, (2, 8), generator=torch.Generator().manual_seed(3))
    tokens = {}
    for name, cache in (("exact", KVCache(2)), ("quant", QuantizedKVCache(2, group=16))):
        out, new, logits = prompt, prompt, []
        with torch.no_grad():
            for _ in range(24):
                step = lm(new, cache=cache)[:, -1]
                logits.append(step)
                new = step.argmax(-1, keepdim=True)
                out = torch.cat([out, new], 1)
        tokens[name] = (out, torch.stack(logits, 1))
    assert torch.equal(tokens["exact"][0], lm.generate(prompt, 24))
    error = (tokens["quant"][1] - tokens["exact"][1]).abs().max()
    assert 0 < error < 1e-2
    assert torch.equal(tokens["quant"][0], tokens["exact"][0])  # the same greedy tokens


def test_bytes_held():
    cache = QuantizedLayerCache(group=4)
    k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 6)
    cache.append(k, v)
    # keys: 8 codes a token, 2 groups of (scale, zero) per channel, 2 residual tokens in float
    keys = 2 * (8 * 8 + 2 * 2 * 8 * 4 + 2 * 8 * 4)
    values = 2 * (10 * 6 + 10 * 2 * 4)  # values: 6 codes and a (scale, zero) a token
    assert cache.nbytes == keys + values


def test_rollback_within_the_residual_and_refused_beyond():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 1, 7, 3, generator=g), torch.randn(1, 1, 7, 3, generator=g)
    cache, never = QuantizedLayerCache(group=4), QuantizedLayerCache(group=4)
    cache.append(k[..., :6, :], v[..., :6, :])
    cache.rollback(2)  # the residual holds 2
    keys, values = cache.append(k[..., 4:7, :], v[..., 4:7, :])
    want_k, want_v = never.append(k, v)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v) and len(cache) == 7
    with pytest.raises(ValueError, match=r"k = 4 reaches into a quantised key group .* last 3"):
        cache.rollback(4)
    with pytest.raises(ValueError, match="holds only 7 positions"):
        cache.rollback(8)
    assert len(cache) == 7


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="group must be a positive int"):
        QuantizedLayerCache(group=0)
    cache = QuantizedLayerCache()
    with pytest.raises(ValueError, match="new k must be a float tensor"):
        cache.append(torch.zeros(1, 2, 3, dtype=torch.long), torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="same dims except the last"):
        cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 2, 4))
    cache.append(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="does not extend"):
        cache.append(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    with pytest.raises(ValueError, match=r"the cache holds torch\.float32"):
        cache.append(torch.zeros(1, 2, 1, 4, dtype=F64), torch.zeros(1, 2, 1, 4, dtype=F64))
    with pytest.raises(ValueError, match="is empty"):
        QuantizedLayerCache().keys()
