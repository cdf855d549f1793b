"""ShortConv: equal to torch's depthwise conv1d, padding equal to truncation, and decoding from
the kept inputs equal to the causal pass."""

import pytest
import torch
import torch.nn.functional as F

from attnkit import masks
from attnkit.mixers import MixerCache
from attnkit.mixers.base import padding_mask
from attnkit.mixers.conv import ShortConv, last_real


def reference(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    """nn.Conv1d with the same weights, left padding K − 1 then cut to N (the causal conv)."""
    c, k = conv.channels, conv.kernel_size
    ref = torch.nn.Conv1d(c, c, k, groups=c, padding=k - 1, bias=conv.bias is not None)
    ref = ref.to(x.dtype)
    with torch.no_grad():
        ref.weight.copy_(conv.weight)
        if conv.bias is not None:
            ref.bias.copy_(conv.bias)
    y = ref(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
    return F.silu(y) if conv.activation == "silu" else y


def loop(conv: ShortConv, x: torch.Tensor) -> torch.Tensor:
    """The formula position by position: y_t = b + Σ_i w_i x_{t−K+1+i}."""
    k = conv.kernel_size
    w = conv.weight[:, 0, :]  # (C, K)
    out = []
    for t in range(x.shape[1]):
        acc = torch.zeros_like(x[:, 0]) if conv.bias is None else conv.bias.expand_as(x[:, 0])
        for i in range(k):
            s = t - k + 1 + i
            if s >= 0:
                acc = acc + w[:, i] * x[:, s]
        out.append(acc)
    y = torch.stack(out, 1)
    return F.silu(y) if conv.activation == "silu" else y


@pytest.mark.parametrize(
    ("k", "bias", "act"), [(4, True, "silu"), (3, False, None), (1, True, None)]
)
def test_equals_conv1d_and_the_formula(k, bias, act):
    torch.manual_seed(0)
    conv = ShortConv(6, k, bias=bias, activation=act, dtype=torch.float64)
    x = torch.randn(2, 9, 6, dtype=torch.float64)
    y = conv(x)
    torch.testing.assert_close(y, reference(conv, x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, loop(conv, x), rtol=1e-12, atol=1e-12)


def test_padding_equals_truncation_and_padded_outputs_are_zero():
    torch.manual_seed(1)
    conv = ShortConv(5, 4, activation="silu", dtype=torch.float64)
    lengths = torch.tensor([7, 3])
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    x[1, 3:] = 1e3  # padding content must not leak
    keep = masks.from_lengths(lengths, 7)[:, 0]
    y = conv(x, mask=keep)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(y[b, :n], reference(conv, x[b : b + 1, :n])[0])
        assert (y[b, n:] == 0).all()
    torch.testing.assert_close(conv(x, mask=keep[:, None]), y)  # (B, 1, N) too


def test_cached_decoding_equals_the_causal_pass():
    torch.manual_seed(2)
    conv = ShortConv(4, 4, activation="silu", dtype=torch.float64)
    x = torch.randn(3, 10, 4, dtype=torch.float64)
    full = reference(conv, x)
    cache = MixerCache()
    steps = [conv(x[:, :2], cache=cache)]  # a prefill shorter than K − 1
    steps += [conv(x[:, t : t + 1], cache=cache) for t in range(2, 6)]
    steps.append(conv(x[:, 6:], cache=cache))  # then a chunk
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache.states["conv"], x[:, -3:])


def test_padded_prefill_keeps_the_last_real_inputs_for_decoding():
    torch.manual_seed(3)
    conv = ShortConv(3, 4, dtype=torch.float64)
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    nxt = torch.randn(2, 1, 3, dtype=torch.float64)
    lengths = [6, 2]
    cache = MixerCache()
    conv(x, mask=masks.from_lengths(torch.tensor(lengths), 6), cache=cache)
    y = conv(nxt, cache=cache)
    for b, n in enumerate(lengths):
        alone = torch.cat([x[b : b + 1, :n], nxt[b : b + 1]], 1)
        torch.testing.assert_close(y[b], reference(conv, alone)[0, -1:])


def test_last_real_picks_in_order_and_fills_with_zeros():
    x = torch.arange(1.0, 7.0).reshape(1, 6, 1).expand(2, 6, 1).clone()
    keep = torch.tensor([[True, False, True, True, False, False], [False] * 5 + [True]])
    got = last_real(x, keep, 3)[..., 0]
    assert got.tolist() == [[1.0, 3.0, 4.0], [0.0, 0.0, 6.0]]


def test_bad_input_is_refused_by_name():
    conv = ShortConv(4, 3)
    with pytest.raises(ValueError, match=r"x must be \(B, N, 4\)"):
        conv(torch.randn(1, 5, 3))
    with pytest.raises(ValueError, match="mask must be key padding"):
        conv(torch.randn(2, 5, 4), mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be boolean"):
        conv(torch.randn(2, 5, 4), mask=torch.ones(2, 5))
    with pytest.raises(TypeError, match="cache must be a MixerCache"):
        conv(torch.randn(2, 5, 4), cache={})
    cache = MixerCache()
    ShortConv(5, 3)(torch.randn(2, 5, 5), cache=cache)
    with pytest.raises(ValueError, match="'conv' state"):
        conv(torch.randn(2, 1, 4), cache=cache)
    with pytest.raises(ValueError, match="activation"):
        ShortConv(4, 3, activation="gelu")
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConv(4, 0)
    assert padding_mask(None, 2, 3, "x") is None
