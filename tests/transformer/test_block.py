"""The sliding window of a Transformer layer (``window=``, a plan's ``sliding:W``): over a whole
sequence it reaches the self-attention as a block mask (the chunked kernel visits only the tiles
near the diagonal), and the result and its gradients equal the self-attention under the dense
window mask written out; a decoding step, a call's own block mask and a part without block masks
keep the dense window mask."""

import pytest
import torch

import attnkit as ak
from attnkit import masks
from attnkit.kernels import BlockMask
from attnkit.modern import SinkAttention, StreamingCache
from attnkit.transformer import TransformerDecoderLayer, TransformerEncoderLayer

E, H = 8, 2


def _window_loop(n: int, w: int, causal: bool) -> torch.Tensor:
    """(N, N) True where query i may attend key j: causally the w places up to i, else the
    places less than w away."""
    rows = [[(i - w < j <= i) if causal else abs(i - j) < w for j in range(n)] for i in range(n)]
    return torch.tensor(rows)


def _x(b: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, E, generator=g, dtype=torch.float64)


def _pair(causal: bool, **kw):
    """A layer with a window of w and the same layer without one (equal weights)."""
    cls = TransformerDecoderLayer if causal else TransformerEncoderLayer
    extra = {"cross_attention": False} if causal else {}
    torch.manual_seed(3)
    windowed = cls(E, H, dtype=torch.float64, norm_first=True, **extra, **kw)
    kw.pop("window")
    plain = cls(E, H, dtype=torch.float64, norm_first=True, **extra, **kw)
    plain.load_state_dict(windowed.state_dict())
    return windowed, plain


def _call(layer, x, mask, causal):
    return layer(x, mask=mask) if causal else layer(x, mask)


def _record(layer) -> list[dict]:
    """The keyword arguments of each call of the layer's self-attention."""
    seen: list[dict] = []

    def hook(module, args, kwargs):
        seen.append(dict(kwargs))

    layer.self_attention.module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
def test_a_window_over_a_whole_sequence_is_block_sparse_and_equals_the_dense_window(causal):
    # 300 keys: two whole tiles of 128 and a part one; padding in the second sequence
    n, w = 300, 50
    windowed, plain = _pair(causal, window=w, position="rope")
    seen = _record(windowed)
    x = _x(2, n, seed=1).requires_grad_()
    padding = masks.from_lengths(torch.tensor([n, 217]), n)  # (B, 1, N)
    out = _call(windowed, x, padding, causal)

    (call,) = seen
    assert isinstance(call["block_mask"], BlockMask)
    # the tiles far from the diagonal are skipped
    assert not call["block_mask"].any_allowed[0, -1] and not call["block_mask"].any_allowed[-1, 0]
    assert call["mask"] is padding  # no (N, N) mask is built

    dense = _window_loop(n, w, causal) & padding
    want = _call(plain, x, dense, causal)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-10)

    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    params = list(windowed.parameters())
    got = torch.autograd.grad((out * g).sum(), [x, *params])
    ref = torch.autograd.grad((want * g).sum(), [x, *plain.parameters()])
    assert len(got) == len(ref) == len(params) + 1
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    # the window is a restriction: the layer without it computes something else
    assert not torch.allclose(out, _call(plain, x, padding, causal))


def test_a_window_prefill_into_a_window_cache_then_steps_equal_the_whole_sequence():
    n, w = 300, 50
    torch.manual_seed(5)
    stack = ak.TransformerDecoder(
        f"sliding:{w}", E, H, cross_attention=False, position="rope", dtype=torch.float64
    ).eval()
    seen = _record(stack.layers[0])
    x = _x(2, n, seed=6)
    whole = stack(x)
    cache = stack.new_cache()
    assert isinstance(cache[0], StreamingCache)
    cuts = ((0, 200), (200, 201), (201, 260), (260, 300))
    pieces = [stack(x[:, a:b], cache=cache) for a, b in cuts]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=0, atol=1e-10)
    assert len(cache[0]) == w - 1
    # the whole sequence and the prefill into the empty cache: block-sparse; the steps after it
    # attend the window cache's keys under a small dense mask
    assert [c["block_mask"] is not None for c in seen] == [True, True, False, False, False]


def test_a_call_with_its_own_block_mask_meets_the_window_as_a_mask():
    n, w = 40, 6
    windowed, plain = _pair(True, window=w)
    pattern = ak.patterns.strided(4)
    bm = ak.patterns.block_mask(pattern, n, block_q=16, block_k=16)
    x = _x(2, n, seed=7)
    got = windowed(x, block_mask=bm)
    want = plain(x, mask=_window_loop(n, w, True) & ak.patterns.dense(pattern, n, n))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_a_part_without_block_masks_gets_the_dense_window():
    n, w = 20, 5
    part = SinkAttention(H, init=0.3, dtype=torch.float64)
    assert not part.accepts_block_mask
    windowed, plain = _pair(True, window=w, attention=part)
    plain.self_attention.module.attention.load_state_dict(part.state_dict())
    seen = _record(windowed)
    x = _x(2, n, seed=8)
    torch.testing.assert_close(
        windowed(x), plain(x, mask=_window_loop(n, w, True)), rtol=0, atol=1e-12
    )
    assert seen[0]["block_mask"] is None
    assert seen[0]["mask"].shape[-2:] == (n, n)
