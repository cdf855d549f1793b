"""The decoder-only LM: KV-cached decoding equals full recomputation token by token (float64),
for learned absolute positions and every registered position scheme; it learns a sequence."""

import pytest
import torch

import attnkit as ak
from attnkit.models.decoder_lm import DecoderLM

V = 11


class _ScaleByPosition(ak.positions.PositionScheme):
    """A test scheme that reads the offsets: the vector at position p is scaled by 1 + p/4, so a
    cached step placed at the wrong position gives different logits."""

    def forward(self, q, k, *, q_offset=0, k_offset=0):
        fq = 1 + (torch.arange(q.shape[-2], dtype=q.dtype)[:, None] + q_offset) / 4
        fk = 1 + (torch.arange(k.shape[-2], dtype=k.dtype)[:, None] + k_offset) / 4
        return ak.positions.Positioned(q * fq, k * fk)


POSITIONS = {
    "learned-absolute": {},
    "offset-reading-test-scheme": {"position": _ScaleByPosition(), "learned_positions": False},
    **{f"registered-{name}": {"position": name} for name in ak.positions.available()},
}


def _lm(seed=0, **kw):
    torch.manual_seed(seed)
    kw = {"layers": 2, "max_len": 16, "dtype": torch.float64, **kw}
    return DecoderLM(V, 12, 3, **kw).eval()


@pytest.mark.parametrize("case", list(POSITIONS))
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_cached_decoding_equals_full_recomputation(case, kv_heads):
    lm = _lm(num_kv_heads=kv_heads, **POSITIONS[case])
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    full = lm(tokens)
    cache = lm.new_cache()
    steps = [lm(tokens[:, :3], cache=cache)]  # the prompt in one call, then one token a step
    steps += [lm(tokens[:, i : i + 1], cache=cache) for i in range(3, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-12)
    assert cache.length == 9
    # Generation: the same tokens with and without the cache, greedy and sampled.
    prompt = tokens[:, :2]
    cached = lm.generate(prompt, 8)
    torch.testing.assert_close(cached, lm.generate(prompt, 8, use_cache=False), rtol=0, atol=0)
    seeded = [torch.Generator().manual_seed(3) for _ in range(2)]
    samples = [
        lm.generate(prompt, 8, greedy=False, use_cache=c, generator=g)
        for c, g in zip((True, False), seeded, strict=True)
    ]
    torch.testing.assert_close(samples[0], samples[1], rtol=0, atol=0)
    assert cached.shape == (2, 10) and (cached[:, :2] == prompt).all()


def test_the_offset_matters():
    # Feeding a token without its cached history's offset gives other logits: the test above
    # would catch a decoder that forgot to pass q_offset.
    lm = _lm(**POSITIONS["offset-reading-test-scheme"])
    tokens = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(0))
    cache = lm.new_cache()
    lm(tokens[:, :3], cache=cache)
    stepped = lm(tokens[:, 3:], cache=cache)[:, 0]
    scheme = lm.decoder.layers[0].self_attention.module.position
    q = torch.randn(1, 1, 4, dtype=torch.float64)
    assert not torch.equal(scheme(q, q, q_offset=3).q, scheme(q, q).q)
    torch.testing.assert_close(stepped, lm(tokens)[:, 3], atol=1e-12, rtol=1e-12)


def test_grouped_query_cache_is_smaller():
    tokens = torch.randint(0, V, (2, 10))
    sizes = {}
    for kv in (3, 1):
        cache = _lm(num_kv_heads=kv).new_cache()
        _lm(num_kv_heads=kv)(tokens, cache=cache)
        sizes[kv] = cache.nbytes
    assert sizes[3] == 3 * sizes[1] == 2 * 2 * 2 * 10 * 12 * 8  # layers·(k,v)·B·N·E·8 bytes


def test_inputs_are_checked():
    lm = _lm()
    with pytest.raises(ValueError, match="exceed max_len = 16"):
        lm(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(TypeError, match=r"torch\.long"):
        lm(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\(B, length\)"):
        lm(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="cache must be a KVCache with 2 layers"):
        lm(torch.zeros(1, 3, dtype=torch.long), cache=ak.KVCache(1))


def test_learns_to_continue_a_counting_sequence():
    # Sequences t, t+1, t+2, ... (mod V): the next token is known, so greedy generation from any
    # start continues the count once trained.
    torch.manual_seed(0)
    lm = DecoderLM(V, 16, 2, 1, max_len=12)
    data = (torch.arange(V)[:, None] + torch.arange(12)[None]) % V
    opt = torch.optim.Adam(lm.parameters(), lr=2e-2)
    for _ in range(40):
        logits = lm(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    lm.eval()
    out = lm.generate(data[:, :2], 10)
    assert torch.equal(out, data)


def test_a_local_attention_lm_generates_as_it_computes_the_whole_sequence():
    from attnkit import patterns as pt

    torch.manual_seed(0)
    pattern = pt.sliding_window(3, causal=True)

    def cap(e, b, h, q_idx, kv_idx):
        return 5.0 * torch.tanh(e / 5.0)

    lm = DecoderLM(20, 16, 2, 2, max_len=40, pattern=pattern, score_mod=cap).double().eval()
    prompt = torch.randint(0, 20, (2, 4))
    cached = lm.generate(prompt, 10)
    assert torch.equal(cached, lm.generate(prompt, 10, use_cache=False))
    # the whole sequence through the pattern's block mask == a dense mask of the same pattern
    plain = DecoderLM(20, 16, 2, 2, max_len=40).double().eval()
    plain.load_state_dict(lm.state_dict())
    n = cached.shape[1]
    x = plain.positions(plain.tokens(cached), offset=0)
    ref = plain.head(plain.decoder(x, mask=pt.dense(pattern, n, n), score_mod=cap))
    torch.testing.assert_close(lm(cached), ref)
    bm = pt.block_mask(pattern, n, block_q=4, block_k=4)
    torch.testing.assert_close(plain(cached, block_mask=bm, score_mod=cap), ref)


def test_a_decoding_step_scans_no_tensor_and_builds_no_mask():
    """Per token: no isfinite scan of the cache, no causal mask (one new query attends every
    cached key), no parameter walk (the first step, a new kind of call, is validated once per
    layer; the later ones by their layer's plan); the result is unchanged."""
    from unittest import mock

    from attnkit import checks

    torch.manual_seed(0)
    lm = DecoderLM(20, 16, 2, 2, max_len=30).double().eval()
    tokens = torch.randint(0, 20, (2, 12))
    cache = lm.new_cache()
    with torch.no_grad():
        lm(tokens[:, :8], cache=cache)
        with mock.patch.object(checks, "part_matches", wraps=checks.part_matches) as walks:
            steps = [lm(tokens[:, 8:9], cache=cache)[:, -1]]
        assert walks.call_count == 2  # the first step's kind: each layer checks it once
        with (
            mock.patch.object(torch, "isfinite", wraps=torch.isfinite) as scans,
            mock.patch.object(ak.masks, "causal", wraps=ak.masks.causal) as built,
            mock.patch.object(checks, "part_matches", wraps=checks.part_matches) as walks,
        ):
            steps += [lm(tokens[:, t : t + 1], cache=cache)[:, -1] for t in range(9, 12)]
        assert scans.call_count == built.call_count == walks.call_count == 0
        whole = lm(tokens)[:, 8:]
    torch.testing.assert_close(torch.stack(steps, 1), whole)


class _WholeSequenceOnly(ak.HeadAttention):
    """Causal softmax attention that does not declare decodes_with_cache."""

    causal_form = True
    mask_forms = frozenset({"key", "causal", "full"})

    def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
        e = q @ k.transpose(-1, -2)
        if mask is not None:
            e = e.masked_fill(~mask, float("-inf"))
        return ak.AttentionOutput(torch.softmax(e, -1).nan_to_num(0.0) @ v)


def test_generate_refuses_the_cache_for_a_part_that_cannot_decode_and_says_how_to_go_on():
    torch.manual_seed(0)
    lm = DecoderLM(11, 8, 2, 1, max_len=12, attention=_WholeSequenceOnly()).eval()
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(
        ValueError,
        match=r"^DecoderLM\.generate: attention part _WholeSequenceOnly does not declare "
        r"decodes_with_cache = True.*; generate with use_cache=False",
    ):
        lm.generate(prompt, 2)
    out = lm.generate(prompt, 2, use_cache=False)  # the remedy it names works
    assert out.shape == (1, 5) and torch.equal(out[:, :3], prompt)


def test_a_part_that_cannot_attend_causally_is_refused_when_the_model_is_built():
    with pytest.raises(ValueError, match="Linformer has no causal form"):
        DecoderLM(50, 16, 2, 1, max_len=16, attention=ak.efficient.Linformer(8, 16))
    with pytest.raises(ValueError, match="LinearAttention honours no causal mask"):
        DecoderLM(50, 16, 2, 1, max_len=16, attention=ak.efficient.LinearAttention(causal=True))
    retention = ak.linear_family.Retention(8, num_heads=2)
    lm = DecoderLM(50, 16, 2, 1, max_len=16, attention=retention)
    assert lm(torch.randint(0, 50, (1, 5))).shape == (1, 5, 50)


@pytest.mark.parametrize("part", ["attention", "moba", "forgetting"])
def test_the_model_states_its_activations_finite_once_and_no_call_scans_them(part):
    """DecoderLM tells every attention layer it builds that its inputs are finite
    (MultiHeadAttention.inputs_finite); the calls below then run no scan for non-finite keys.
    Withdrawn, the same calls scan (the counters see them) and give the same logits."""
    from unittest import mock

    from attnkit import head
    from attnkit.kernels import prepare, sdpa
    from attnkit.sparse_trainable import moba

    torch.manual_seed(0)
    kw = {}
    if part == "moba":
        kw["attention"] = ak.sparse_trainable.MixtureOfBlockAttention(block_size=2, top_k=2)
    elif part == "forgetting":
        kw["attention"] = ak.modern.ForgettingAttention(8, 2)
    lm = DecoderLM(20, 16, 2, 2, max_len=30, **kw).double().eval()
    layers = [m for m in lm.modules() if isinstance(m, ak.MultiHeadAttention)]
    assert len(layers) == 2 and all(m.inputs_finite for m in layers)
    assert not ak.MultiHeadAttention(16, 2).inputs_finite  # a layer on its own states nothing
    tokens = torch.randint(0, 20, (2, 9))

    def run() -> tuple[torch.Tensor, int]:
        with (
            mock.patch.object(head, "_sums_finite", wraps=head._sums_finite) as sums,
            mock.patch.object(prepare, "clear_masked", wraps=prepare.clear_masked) as cleared,
            mock.patch.object(sdpa, "clear_masked", wraps=sdpa.clear_masked) as cleared_direct,
            mock.patch.object(moba, "all_finite", wraps=moba.all_finite) as moba_scans,
            mock.patch.object(prepare, "_all_finite", wraps=prepare._all_finite) as scans,
        ):
            logits = lm(tokens)
        counters = (sums, cleared, cleared_direct, moba_scans, scans)
        return logits, sum(c.call_count for c in counters)

    stated, looked = run()
    assert looked == 0
    for m in layers:
        m.inputs_finite = False
    unstated, looked = run()
    assert looked > 0
    torch.testing.assert_close(stated, unstated)
