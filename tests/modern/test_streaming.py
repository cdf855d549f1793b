"""StreamingLLM decoding (Xiao et al. 2023): the cache keeps the first ``sinks`` tokens and the
last ``window``, at constant size for any length; each step equals attention over the sinks and
the window (a mask built here by a loop), and with RoPE the kept tokens sit at their places in
the cache (a step equals the model run on the kept tokens alone)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.modern import StreamingCache, streaming_mask

D = torch.float64
SINKS, WINDOW = 2, 4


def _mha(position=None):
    torch.manual_seed(0)
    return ak.MultiHeadAttention(16, 2, position=position).to(D).eval()


def _tokens(n, seed=1):
    return torch.randn(2, n, 16, generator=torch.Generator().manual_seed(seed), dtype=D)


def _kept(i):
    """The tokens token i attends over: the first SINKS, the WINDOW before it, itself."""
    return sorted(set(range(min(SINKS, i + 1))) | set(range(max(0, i - WINDOW), i + 1)))


def test_the_cache_stays_at_sinks_plus_window_after_ten_windows():
    mha, x = _mha("rope"), _tokens(10 * WINDOW)
    cache = StreamingCache(SINKS, WINDOW)
    sizes = []
    for t in range(x.shape[1]):
        mha(x[:, t : t + 1], cache=cache)
        sizes.append((len(cache), cache.nbytes))
    assert cache.seen == 10 * WINDOW and len(cache) == SINKS + WINDOW == cache.capacity
    steady = sizes[SINKS + WINDOW - 1 :]
    assert len(set(steady)) == 1  # constant memory from the first full step on
    assert steady[0][1] == 2 * 2 * (SINKS + WINDOW) * 16 * 8  # k and v, B = 2, E = 16, float64


def test_every_step_is_full_attention_restricted_to_sinks_and_window():
    """No positions, so the places do not matter: every step (also long after evictions), one
    token at a time or several at once, equals the whole sequence under the sinks + window
    mask."""
    mha, x = _mha(), _tokens(20, seed=2)
    n = x.shape[1]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, _kept(i)] = True
    expected = mha(x, mask=mask).context
    cache = StreamingCache(SINKS, WINDOW)
    outs = []
    for start, stop in ((0, 3), *((t, t + 1) for t in range(3, 12)), (12, 17), (17, 20)):
        step = stop - start
        outs.append(mha(x[:, start:stop], cache=cache, mask=cache.step_mask(step)).context)
    torch.testing.assert_close(torch.cat(outs, 1), expected)
    torch.testing.assert_close(streaming_mask(n, 0, sinks=SINKS, window=WINDOW), mask)


def test_with_rope_positions_are_places_in_the_cache():
    """Step i equals the layer run on the kept tokens alone (sinks, window, token i), where
    they sit at positions 0, 1, …: the paper's positions within the cache, not in the text. The
    first sinks + window steps are plain causal attention."""
    mha, x = _mha("rope"), _tokens(3 * (SINKS + WINDOW), seed=3)
    causal = mha(x, mask=ak.masks.causal(x.shape[1])).context
    cache = StreamingCache(SINKS, WINDOW)
    for i in range(x.shape[1]):
        got = mha(x[:, i : i + 1], cache=cache).context[:, 0]
        kept = _kept(i)
        alone = mha(x[:, kept], mask=ak.masks.causal(len(kept))).context[:, -1]
        torch.testing.assert_close(got, alone)
        if i < SINKS + WINDOW:
            torch.testing.assert_close(got, causal[:, i])
    assert not torch.allclose(got, causal[:, -1])  # later, text positions would differ


def test_grouped_query_heads_are_evicted_alike():
    torch.manual_seed(4)
    mha = ak.MultiHeadAttention(16, 4, num_kv_heads=2, position="rope").to(D)
    cache = StreamingCache(SINKS, WINDOW)
    x = _tokens(12, seed=5)
    for t in range(12):
        mha(x[:, t : t + 1], cache=cache)
    assert cache.k.shape == (2, 2, SINKS + WINDOW, 4) and cache.v.shape == cache.k.shape


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="window"):
        StreamingCache(4, 0)
    with pytest.raises(ValueError, match="sinks"):
        StreamingCache(-1, 4)


def test_a_part_that_does_not_declare_decoding_is_refused():
    class NoDecoding(ak.HeadAttention):
        mask_forms = frozenset({"key"})

    mha = ak.MultiHeadAttention(16, 2, attention=NoDecoding())
    cache = StreamingCache(SINKS, WINDOW)
    with pytest.raises(
        ValueError,
        match=r"^StreamingCache of MultiHeadAttention: attention part NoDecoding does not "
        r"declare decodes_with_cache = True",
    ):
        cache.claim(mha)
    with pytest.raises(ValueError, match="NoDecoding does not declare decodes_with_cache"):
        mha(_tokens(1).float(), cache=cache)
    _mha()(_tokens(3), cache=cache)  # the refused layer did not claim it
    assert len(cache) == 3
