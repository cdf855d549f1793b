"""KV caches: growth and checks; cached decoding through the encoder–decoder Transformer equals
one causal pass over the whole target (float64)."""

import pytest
import torch

import attnkit as ak
from attnkit import masks
from attnkit.kv_cache import KVCache, LayerCache
from attnkit.linear_family.base import recurrent_cache
from attnkit.models.decoder_lm import DecoderLM
from attnkit.modern import LatentCache, StreamingCache


def test_layer_cache_grows_along_the_length():
    cache = LayerCache()
    assert len(cache) == 0 and cache.nbytes == 0
    k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 6)
    assert cache.append(k, v) == (k, v)
    k2, v2 = cache.append(torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 6))
    assert k2.shape == (2, 3, 5, 5) and v2.shape == (2, 3, 5, 6) and torch.equal(k2[:, :, :4], k)
    assert len(cache) == 5 and cache.nbytes == (2 * 3 * 5 * 11) * 4
    with pytest.raises(ValueError, match=r"new k of shape \(2, 2, 1, 5\) does not extend"):
        cache.append(torch.randn(2, 2, 1, 5), torch.randn(2, 2, 1, 6))
    with pytest.raises(ValueError, match="layers must be a positive int"):
        KVCache(0)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_decoder_cached_decoding_equals_one_pass(norm_first):
    torch.manual_seed(0)
    model = ak.Transformer(
        8, 2, encoder_layers=1, decoder_layers=2, d_ff=16, norm_first=norm_first, num_kv_heads=1
    )
    model = model.double().eval()
    src = torch.randn(2, 6, 8, dtype=torch.float64)
    tgt = torch.randn(2, 5, 8, dtype=torch.float64)
    src_ok = masks.from_lengths(torch.tensor([6, 4]), 6)
    memory = model.encode(src, src_ok)
    full = model.decode(tgt, memory, memory_mask=src_ok)
    cache = model.decoder.new_cache()
    steps = [
        model.decode(tgt[:, i : i + 1], memory, memory_mask=src_ok, cache=cache) for i in range(5)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-12)
    assert cache.length == 5 and len(cache) == 2
    assert cache[0].k.shape == (2, 1, 5, 4)  # one shared key/value head of size 8/2
    # the cross-attention projected the memory once: (B, kv heads, N, d) kept per layer
    assert cache[1].memory.k.shape == (2, 1, 6, 4) and len(cache[1].memory) == 6
    own = sum(t.numel() * 8 for layer in cache.layers for t in (layer.k, layer.v))
    assert cache.nbytes == own + sum(layer.memory.nbytes for layer in cache.layers) > own
    with pytest.raises(ValueError, match="same encoder output"):
        model.decode(tgt[:, :1], memory.clone(), memory_mask=src_ok, cache=cache)


def test_memory_cache_projects_the_memory_once():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 4, num_kv_heads=2).double()
    memory = torch.randn(2, 7, 8, dtype=torch.float64)
    fixed = ak.kv_cache.MemoryCache()
    calls = []
    original = mha._project
    mha._project = lambda *a: calls.append(1) or original(*a)
    for _ in range(3):
        y = torch.randn(2, 1, 8, dtype=torch.float64)
        torch.testing.assert_close(
            mha(y, memory, memory, memory_cache=fixed).context, mha(y, memory, memory).context
        )
    assert len(calls) == 1 + 3  # one projection of the memory, then only the uncached calls
    with pytest.raises(ValueError, match=r"cache= \(self-attention\) or memory_cache="):
        mha(y, memory, memory, cache=LayerCache(), memory_cache=fixed)


def test_memory_cache_refuses_a_memory_changed_in_place_during_a_decode():
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2).double()
    memory = torch.randn(1, 5, 8, dtype=torch.float64)
    fixed = ak.kv_cache.MemoryCache()
    y = torch.randn(1, 1, 8, dtype=torch.float64)
    mha(y, memory, memory, memory_cache=fixed)
    memory.mul_(2.0)  # stale projections would now be reused silently
    with pytest.raises(ValueError, match="changed in place"):
        mha(y, memory, memory, memory_cache=fixed)


def _score(name, d, heads):
    return ak.scores.Location(d, 8, num_heads=heads) if name == "location" else name


CAUSAL_SAFE = [s for s in ak.scores.available() if not ak.scores.REGISTRY.get(s).mixes_keys]


@pytest.mark.parametrize("score", CAUSAL_SAFE)
@pytest.mark.parametrize("align", ["softmax", "sparsemax", "entmax15", "sigmoid"])
def test_every_causal_score_and_alignment_decodes_with_the_cache(score, align):
    # A query sees only keys up to itself, so attending over the cached keys step by step gives
    # the causal pass's outputs, whatever the score and alignment.
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, score=_score(score, 4, 2), align=align).double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    full = mha(x, mask=masks.causal(6)).context
    cache = LayerCache()
    steps = [
        mha(x[:, i : i + 1], mask=masks.causal(1, i + 1), cache=cache).context for i in range(6)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-12)


def _decode_or_refuse(part_or_align, causal_part: bool = False) -> str:
    """'same' when step-by-step decoding with the cache equals the causal pass (float64), 'refused'
    when the cached call raises ValueError; raises AssertionError when it silently differs, or
    when the part accepts the cache but has no causal pass to equal."""
    torch.manual_seed(0)
    if isinstance(part_or_align, ak.alignments.Alignment):
        mha = ak.MultiHeadAttention(8, 2, "scaled_dot", part_or_align)
    else:
        mha = ak.MultiHeadAttention(8, 2, attention=part_or_align)
    mha = mha.double().eval()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    cache = LayerCache()
    try:
        steps = [mha(x[:, i : i + 1], cache=cache).context for i in range(6)]
    except ValueError:
        return "refused"
    try:
        full = mha(x, mask=None if causal_part else masks.causal(6)).context
    except ValueError as err:
        raise AssertionError(f"accepts cache= but has no causal pass to equal: {err}") from None
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-10, rtol=1e-10)
    return "same"


def _alignments():
    from attnkit.tasks import parts

    found = {name: parts.build_alignment(name, 4) for name in ak.alignments.available()}
    found["local (monotonic)"] = ak.alignments.Local(2, position="monotonic")
    return found


@pytest.mark.parametrize("name", sorted(_alignments()))
def test_no_alignment_decodes_silently_differently_with_the_cache(name):
    assert _decode_or_refuse(_alignments()[name]) in ("same", "refused")


def _slot_parts():
    from attnkit.efficient import synthesizer as sy
    from attnkit.tasks import parts

    built = {}
    for name in parts.slot_mechanisms():
        try:
            built[name] = (parts.build_slot_attention(name, head_dim=4, num_heads=2, max_len=8), 0)
        except ValueError:  # needs an argument the sizes do not give: built below
            continue
    causal = {
        "linear": {},
        "performer": {"head_dim": 4},
        "rfa": {"head_dim": 4},
        "fmm": {"bandwidth": 2},
        "kernel_rpe_fft": {"max_len": 8, "num_heads": 2},
    }
    for name, kw in causal.items():  # causal by a constructor flag, not by a mask
        built[name + " (causal)"] = (ak.mechanisms.build(name, causal=True, **kw), 1)
    built["fast_weight"] = (ak.mechanisms.build("fast_weight"), 1)  # causal by construction
    built["adaptive_span"] = (ak.mechanisms.build("adaptive_span", num_heads=2, max_span=3), 0)
    random_forms = [
        sy.RandomSynthetic(8, num_heads=2),
        sy.FactorizedRandomSynthetic(8, 2, num_heads=2),
    ]
    built["synthesizer"] = (ak.mechanisms.build("synthesizer", components=random_forms), 0)
    return built


def test_no_attention_slot_mechanism_decodes_silently_differently_with_the_cache():
    # every part either refuses cache= or decodes exactly as its causal pass
    outcomes = {name: _decode_or_refuse(part, bool(c)) for name, (part, c) in _slot_parts().items()}
    decoding = sorted(n for n, o in outcomes.items() if o == "same")
    # the mechanisms that decode step by step include those that read query positions
    expected = {"adaptive_span", "synthesizer", "kernel_rpe_fft (causal)", "routing", "area"}
    # and the causal kernelized forms (the last rows of the whole causal sequence)
    expected |= {f"{n} (causal)" for n in ("linear", "performer", "rfa", "fmm")} | {"fast_weight"}
    assert expected <= set(decoding), outcomes
    # hashing, sorting, landmarks and length projections approximate over the whole sequence,
    # and a kernelized form built without causal=True is not a causal pass: all refuse cache=
    refusing = {"lsh", "sinkhorn", "nystrom", "linformer", "skyformer", "soft", "linear"}
    assert {outcomes[n] for n in refusing} == {"refused"}, outcomes


def test_a_part_that_has_not_declared_it_decodes_is_refused_with_the_reason():
    part = ak.mechanisms.build("lsh", head_dim=4, chunk_size=2)
    mha = ak.MultiHeadAttention(8, 2, attention=part)
    with pytest.raises(ValueError, match=r"LSHAttention does not declare decodes_with_cache"):
        mha(torch.randn(1, 1, 8), cache=LayerCache())


def test_a_cache_belongs_to_the_layer_that_used_it_first():
    torch.manual_seed(0)
    first, second = ak.MultiHeadAttention(8, 2), ak.MultiHeadAttention(8, 2)
    x = torch.randn(2, 1, 8)
    cache = LayerCache()
    first(x, cache=cache)
    first(x, cache=cache)  # the owner may go on
    with pytest.raises(ValueError, match=r"belongs to another layer \(MultiHeadAttention"):
        second(x, cache=cache)
    assert len(cache) == 2  # the refused call added nothing
    memory = torch.randn(2, 3, 8)
    fixed = ak.kv_cache.MemoryCache()
    first(x, memory, memory, memory_cache=fixed)
    with pytest.raises(ValueError, match=r"MemoryCache belongs to another layer"):
        second(x, memory, memory, memory_cache=fixed)


@pytest.mark.parametrize("name", ["cache", "memory_cache"])
def test_a_cache_of_the_wrong_type_is_refused(name):
    mha = ak.MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match=rf"^{name} must be an attnkit.kv_cache.* got dict"):
        mha(torch.randn(1, 1, 8), **{name: {}})


class _NoDecoding(ak.HeadAttention):
    """A part that declares key masks and nothing about decoding (the base's default)."""

    mask_forms = frozenset({"key"})


def test_a_layer_cache_reads_the_part_and_refuses_one_that_does_not_declare_decoding():
    mha = ak.MultiHeadAttention(8, 2, attention=_NoDecoding())
    for cache in (LayerCache(), KVCache(2)[1]):
        with pytest.raises(
            ValueError,
            match=r"^LayerCache of MultiHeadAttention: attention part _NoDecoding does not "
            r"declare decodes_with_cache = True",
        ):
            cache.claim(mha)
        with pytest.raises(ValueError, match="_NoDecoding does not declare decodes_with_cache"):
            mha(torch.randn(1, 1, 8), cache=cache)
        ak.MultiHeadAttention(8, 2)(torch.randn(1, 1, 8), cache=cache)  # still nobody's
        assert len(cache) == 1
    LayerCache().claim(torch.nn.Linear(2, 2))  # a layer without an attention part: nothing to read


def _lm(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("position", "rope")
    return DecoderLM(13, 8, 2, 2, max_len=24, dtype=torch.float64, **kw).eval()


@pytest.mark.parametrize("position", ["rope", None])
def test_rollback_then_decoding_equals_never_having_decoded(position):
    lm = _lm(position=position)
    g = torch.Generator().manual_seed(1)
    prompt, wrong, right = (torch.randint(0, 13, (2, n), generator=g) for n in (5, 3, 4))
    cache = lm.new_cache()
    with torch.no_grad():
        lm(prompt, cache=cache)
        lm(wrong[:, :2], cache=cache)
        lm(wrong[:, 2:], cache=cache)
        cache.rollback(3)
        assert cache.length == 5 and all(len(layer) == 5 for layer in cache.layers)
        got = torch.cat([lm(right[:, i : i + 1], cache=cache) for i in range(4)], 1)
        full = lm(torch.cat([prompt, right], 1))  # one causal pass, no cache
    torch.testing.assert_close(got, full[:, 5:], atol=1e-12, rtol=1e-12)
    assert cache[0].k.shape[-2] == 9
    cache.rollback(0)
    assert cache.length == 9


def test_rollback_refuses_by_name_and_changes_nothing():
    cache = KVCache(2)
    k = torch.randn(1, 2, 4, 3)
    cache[0].append(k, k)
    cache[1].append(k[:, :, :2], k[:, :, :2])
    with pytest.raises(ValueError, match="a layer of the cache holds only 2 positions"):
        cache.rollback(3)
    assert len(cache[0]) == 4 and len(cache[1]) == 2
    with pytest.raises(ValueError, match="the cache holds only 4 positions"):
        cache[0].rollback(5)
    with pytest.raises(ValueError, match="k must be an int >= 0, got -1"):
        cache[0].rollback(-1)
    cache[0].rollback(4)
    assert len(cache[0]) == 0
    recurrent = recurrent_cache(2)
    with pytest.raises(ValueError, match=r"^RecurrentCache\.rollback: .* keeps no snapshots"):
        recurrent.rollback(1)
    streaming = StreamingCache(sinks=1, window=2)
    with pytest.raises(ValueError, match=r"^StreamingCache\.rollback"):
        streaming.rollback(0)
    mixed = KVCache(2)
    mixed.layers[1] = LatentCache()
    with pytest.raises(ValueError, match="layer 1 holds a LatentCache, which cannot forget"):
        mixed.rollback(0)


def test_a_rope_layer_caches_its_keys_placed_and_places_only_the_new_ones():
    """With a per-token scheme (RoPE) after a q/k norm, a LayerCache holds the keys as placed at
    their positions (per key/value head): each step rotates only its new keys, and decoding
    still equals the causal pass. A cache that declares it re-places keys holds them raw."""
    torch.manual_seed(0)
    e, h, h_kv = 16, 4, 2
    mha = ak.MultiHeadAttention(
        e, h, num_kv_heads=h_kv, position="rope", qk=[ak.qk_chain.HeadNorm(e // h), "position"]
    ).double().eval()  # fmt: skip
    x = torch.randn(2, 7, e, dtype=torch.float64)
    lengths = []
    real = mha.position.forward

    def counting(q, k, **kw):
        lengths.append(k.shape[-2])
        return real(q, k, **kw)

    mha.position.forward = counting
    with torch.no_grad():
        whole = mha(x, mask=masks.causal(7)).context
        lengths.clear()
        cache = LayerCache()
        steps = [mha(x[:, :3], mask=masks.causal(3), cache=cache).context]
        steps += [mha(x[:, t : t + 1], cache=cache).context for t in range(3, 7)]
        torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-12, atol=1e-12)
        assert lengths == [3, 1, 1, 1, 1]  # only the new keys are placed
        # the cached keys are the projected, normed keys rotated at their positions
        _, projected, _ = mha._project_heads(x, x, x)
        _, k = mha.qk[0](projected, projected)
        placed = mha.position(k, k, q_offset=0, k_offset=0).k
        assert cache.k.shape == (2, h_kv, 7, e // h)
        torch.testing.assert_close(cache.k, placed, rtol=1e-12, atol=1e-12)
        streaming = StreamingCache(sinks=2, window=8)
        mha(x[:, :3], mask=masks.causal(3), cache=streaming)
        torch.testing.assert_close(streaming.k, projected[:, :, :3])  # as projected
