"""Transformer stacks built from a per-layer plan: an all-``full`` plan is today's stack, each
kind of layer equals the layer built by hand (a per-head part in the slot, a window as a dense
mask written out, a token mixer in the self-attention's place), and a decoder's cache holds
each layer's own kind of state, decoding chunk by chunk as the whole sequence computes."""

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.kv_cache import LayerCache
from attnkit.linear_family import GatedDeltaNet, RecurrentCache
from attnkit.mixers import MixerCache, TokenMixer
from attnkit.modern import StreamingCache
from attnkit.positions.rope import Rotary
from attnkit.transformer import TransformerDecoderLayer, TransformerEncoderLayer

E, H = 8, 2


class _Mean(TokenMixer):
    """The running mean of a projection over the real positions so far; the cache holds the
    running sum and count."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.v = nn.Linear(embed_dim, embed_dim, dtype=torch.float64)

    def forward(self, x, *, mask=None, cache: MixerCache | None = None):
        keep = torch.ones(*x.shape[:2], 1, dtype=x.dtype)
        if mask is not None:
            keep = mask.reshape(x.shape[0], x.shape[1], 1).to(x.dtype)
        total, count = (self.v(x) * keep).cumsum(1), keep.cumsum(1)
        if cache is not None:
            cache.claim(self)
            if cache.states:
                total = total + cache.states["total"][:, None]
                count = count + cache.states["count"][:, None]
            cache.advance(x.shape[1], total=total[:, -1], count=count[:, -1])
        return total / count.clamp(min=1)


def _mean_loop(mixer: _Mean, x, lengths):
    """The mixer's output at real positions, one position at a time."""
    out = torch.zeros_like(x)
    v = mixer.v(x)
    for b, n in enumerate(lengths):
        for t in range(n):
            out[b, t] = v[b, : t + 1].mean(0)
    return out


def _x(b=2, n=7, seed=0):
    return torch.randn(b, n, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("cls", [ak.TransformerEncoder, ak.TransformerDecoder])
def test_a_plan_of_full_layers_is_the_stack_of_that_many_layers(cls):
    kw = {"dtype": torch.float64, "position": "rope", "norm_first": True}
    if cls is ak.TransformerDecoder:
        kw["cross_attention"] = False
    torch.manual_seed(3)
    old = cls(4, E, H, **kw)
    torch.manual_seed(3)
    pattern = cls("full", E, H, num_layers=4, **kw)
    torch.manual_seed(3)
    listed = cls(["full", "full"], E, H, num_layers=4, **kw)
    x = _x()
    for new in (pattern, listed):
        assert [k for k, _ in new.named_parameters()] == [k for k, _ in old.named_parameters()]
        for p, q in zip(old.parameters(), new.parameters(), strict=True):
            assert torch.equal(p, q)
        assert torch.equal(new(x), old(x))


def test_a_part_in_the_plan_is_the_layer_with_that_part_in_its_slot():
    torch.manual_seed(0)
    hybrid = ak.TransformerDecoder(
        "1 gated_deltanet : 1 full", E, H, cross_attention=False, dtype=torch.float64
    )
    torch.manual_seed(0)
    part = GatedDeltaNet.for_heads(embed_dim=E, num_heads=H, head_dim=E // H, max_len=None)
    by_hand = [
        TransformerDecoderLayer(
            E, H, cross_attention=False, attention=part.double(), dtype=torch.float64
        ),
        TransformerDecoderLayer(E, H, cross_attention=False, dtype=torch.float64),
    ]
    for layer, mine in zip(hybrid.layers, by_hand, strict=True):
        mine.load_state_dict(layer.state_dict())
    x = want = _x()
    for layer in by_hand:
        want = layer(want)
    torch.testing.assert_close(hybrid(x), want, rtol=0, atol=1e-12)
    assert isinstance(hybrid.layers[0].self_attention.module.attention, GatedDeltaNet)


def _window_loop(n, w, causal):
    """Query i may attend key j: causally j in [i - w + 1, i]; else |i - j| < w."""
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            out[i, j] = (i - w < j <= i) if causal else abs(i - j) < w
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_a_sliding_layer_is_the_full_layer_under_the_window_mask(causal):
    n, w = 9, 3
    cls = ak.TransformerDecoder if causal else ak.TransformerEncoder
    kw = {"cross_attention": False} if causal else {}
    torch.manual_seed(1)
    stack = cls(f"sliding:{w}", E, H, dtype=torch.float64, position="rope", **kw)
    assert stack.layers[0].window == w
    plain_cls = TransformerDecoderLayer if causal else TransformerEncoderLayer
    plain = plain_cls(E, H, dtype=torch.float64, position="rope", **kw)
    plain.load_state_dict(stack.layers[0].state_dict())
    x = _x(n=n)
    mask = _window_loop(n, w, causal)
    want = plain(x, mask=mask) if causal else plain(x, mask)
    torch.testing.assert_close(stack(x), want, rtol=0, atol=1e-12)


def test_a_token_mixer_layer_equals_its_formula_and_padding_equals_truncation():
    torch.manual_seed(2)
    stack = ak.TransformerEncoder(
        [lambda embed_dim, **_: _Mean(embed_dim)], E, H, norm_first=True, dtype=torch.float64
    )
    layer = stack.layers[0]
    assert layer.self_attention is None and isinstance(layer.mixer, _Mean)
    x = _x()
    lengths = [7, 4]
    mask = ak.masks.from_lengths(torch.tensor(lengths), 7)
    got = stack(x, mask)
    h = x + _mean_loop(layer.mixer, layer.norm1(x), lengths)
    want = stack.norm(h + layer.ff(layer.norm2(h)))  # pre-norm: a final norm
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b, :n], want[b, :n], rtol=0, atol=1e-12)
        alone = stack(x[b : b + 1, :n])
        torch.testing.assert_close(got[b : b + 1, :n], alone, rtol=0, atol=1e-12)


def test_a_token_mixer_layer_refuses_what_it_cannot_honour():
    mixer = _Mean(E)
    with pytest.raises(ValueError, match=r"mixer= replaces the self-attention, so its position"):
        TransformerEncoderLayer(E, H, mixer=mixer, position="rope")
    with pytest.raises(TypeError, match=r"mixer must be an attnkit.mixers.TokenMixer .* Linear"):
        TransformerEncoderLayer(E, H, mixer=nn.Linear(E, E))
    with pytest.raises(ValueError, match=r"window= and pattern= both restrict"):
        TransformerEncoderLayer(E, H, window=3, pattern=ak.patterns.sliding_window(2))
    layer = TransformerDecoderLayer(E, H, cross_attention=False, mixer=mixer).double()
    x = _x()
    with pytest.raises(
        ValueError, match=r"mask must be key padding \(B, 1, N\).* got shape \(7, 7"
    ):
        layer(x, mask=ak.masks.causal(7))
    with pytest.raises(ValueError, match=r"block_mask and score_mod act on attention scores"):
        layer(x, score_mod=lambda e, b, h, i, j: e)
    with pytest.raises(ValueError, match=r"causal=False: this layer's token mixer _Mean"):
        layer(x, causal=False)


class _Absolute(Rotary):
    """RoPE declared as reading absolute positions: a window then keeps every key."""

    translation_invariant = False


def test_each_layer_gets_a_cache_of_its_own_kind():
    plan = ["full", "gated_deltanet", "sliding:4", lambda embed_dim, **_: _Mean(embed_dim)]
    stack = ak.TransformerDecoder(plan, E, H, cross_attention=False)
    kinds = [type(slot) for slot in stack.new_cache().layers]
    assert kinds == [LayerCache, RecurrentCache, StreamingCache, MixerCache]
    window = stack.new_cache()[2]
    assert (window.sinks, window.window) == (0, 3)
    assert [layer.keeps_state for layer in stack.layers] == [False, True, False, True]
    absolute = ak.TransformerDecoder("sliding:4", E, H, cross_attention=False, position=_Absolute())
    assert type(absolute.new_cache()[0]) is LayerCache


PLANS = {
    "gdn-full": "1 gated_deltanet : 1 full",
    "sliding-full-rope": "2 sliding:3 : 1 full",
    "mixer-sliding-retention": [lambda embed_dim, **_: _Mean(embed_dim), "sliding:2", "retention"],
    "mamba2-gla": "1 mamba2 : 1 gla",
}


@pytest.mark.parametrize("name", list(PLANS))
def test_decoding_chunk_by_chunk_equals_the_whole_sequence(name):
    torch.manual_seed(4)
    stack = ak.TransformerDecoder(
        PLANS[name], E, H, cross_attention=False, position="rope", dtype=torch.float64
    ).eval()
    x = _x(n=11, seed=5)
    whole = stack(x)
    cache = stack.new_cache()
    pieces = [stack(x[:, a:b], cache=cache) for a, b in ((0, 4), (4, 5), (5, 8), (8, 9), (9, 11))]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=0, atol=1e-10)
    assert cache.length == 11
    window = [s for s in cache.layers if isinstance(s, StreamingCache)]
    assert all(len(s) <= s.window for s in window)  # a window slot keeps the last keys only


def test_a_hybrid_decoder_with_cross_attention_decodes_as_it_computes():
    torch.manual_seed(6)
    stack = ak.TransformerDecoder(
        "1 gated_deltanet : 1 sliding:3 : 1 mixer.mamba2", E, H, score="additive",
        dtype=torch.float64,
    ).eval()  # fmt: skip
    # every layer's cross-attention takes the score, the parts' self-attention does not
    scores = [type(layer.cross_attention.module.attention.score) for layer in stack.layers]
    assert scores == [ak.scores.Additive] * 3
    assert isinstance(stack.layers[0].self_attention.module.attention, GatedDeltaNet)
    x, memory = _x(n=9, seed=7), _x(n=5, seed=8)
    whole = stack(x, memory)
    cache = stack.new_cache()
    pieces = [stack(x[:, a:b], memory, cache=cache) for a, b in ((0, 4), (4, 5), (5, 9))]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=0, atol=1e-10)
