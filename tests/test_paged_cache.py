"""The paged KV cache: pages taken on demand and given back; the gathered view; equal-length
batches equal the contiguous LayerCache, and every sequence of a ragged batch (sequences joining
and leaving) equals the layer run on that sequence alone, in float64."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attnkit as ak
from attnkit import masks
from attnkit.kv_cache import KVCache, LayerCache
from attnkit.models.decoder_lm import DecoderLM
from attnkit.paged_cache import PagedKVCache, PagedLayerCache
from attnkit.positions import REGISTRY as POSITIONS
from attnkit.positions import rope_scaling

E, H = 12, 3
F64 = torch.float64
PER_HEAD = [None] + [n for n in ak.positions.available() if not POSITIONS.get(n).absolute]


class _ScaleByPosition(ak.positions.PositionScheme):
    """Reads absolute positions: the vector at position p is scaled by 1 + p/4."""

    def forward(self, q, k, *, q_offset=0, k_offset=0):
        fq = 1 + (torch.arange(q.shape[-2], dtype=q.dtype)[:, None] + q_offset) / 4
        fk = 1 + (torch.arange(k.shape[-2], dtype=k.dtype)[:, None] + k_offset) / 4
        return ak.positions.Positioned(q * fq, k * fk)


def _mha(position=None, kv_heads=H, seed=0):
    torch.manual_seed(seed)
    return ak.MultiHeadAttention(E, H, num_kv_heads=kv_heads, position=position, dtype=F64).eval()


def _left_pad(rows, m):
    out = torch.zeros(len(rows), m, *rows[0].shape[1:], dtype=rows[0].dtype)
    for b, r in enumerate(rows):
        out[b, m - len(r) :] = r
    return out


@pytest.mark.parametrize("position", [None, "rope", "alibi", "t5"])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_equal_lengths_equal_the_contiguous_cache(position, kv_heads):
    mha = _mha(position, kv_heads)
    x = torch.randn(2, 9, E, dtype=F64, generator=torch.Generator().manual_seed(1))
    contiguous, paged = KVCache(1), PagedKVCache(1, page_size=2)
    ids = [paged.add(), paged.add()]
    chunks = [slice(0, 3)] + [slice(t, t + 1) for t in range(3, 9)]
    with torch.no_grad():
        for s in chunks:
            m = s.stop - s.start
            mask = masks.causal(m, len(contiguous[0]) + m)
            want = mha(x[:, s], cache=contiguous[0], mask=mask).context
            with paged.step(ids, [m, m]) as step:
                assert not step.ragged
                got = mha(x[:, s], cache=paged[0], mask=step.mask).context
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
        full = mha(x, mask=masks.causal(9)).context
    torch.testing.assert_close(want, full[:, -1:], atol=1e-12, rtol=1e-12)
    assert [paged.length_of(i) for i in ids] == [9, 9] and paged.length == 9


def _decode_ragged(layer, xs, prompts, page_size=3, join_at=2):
    """Feed sequence b's first prompts[b] vectors in one call, then one a step; the last
    sequence joins after ``join_at`` steps; a sequence is freed when it is done. Returns each
    sequence's outputs (L_b, E) and the cache."""
    cache = PagedKVCache(1, page_size=page_size)
    ids, fed = [None] * len(xs), [0] * len(xs)
    outs = [[] for _ in xs]
    calls = 0
    with torch.no_grad():
        while True:
            for b in range(len(xs)):
                if ids[b] is None and fed[b] == 0 and (b < len(xs) - 1 or calls >= join_at):
                    ids[b] = cache.add()
            live = [b for b in range(len(xs)) if ids[b] is not None]
            if not live:
                break
            new = [
                xs[b][fed[b] : (fed[b] + prompts[b] if fed[b] == 0 else fed[b] + 1)] for b in live
            ]
            counts = [len(t) for t in new]
            with cache.step([ids[b] for b in live], counts) as step:
                out = layer(_left_pad(new, step.width), cache=cache[0], mask=step.mask).context
            calls += 1
            for row, b in enumerate(live):
                outs[b].append(out[row, step.width - counts[row] :])
                fed[b] += counts[row]
                if fed[b] == len(xs[b]):
                    cache.free(ids[b])
                    ids[b] = -1  # done
            ids = [None if i == -1 else i for i in ids]
            if all(f == len(x) for f, x in zip(fed, xs, strict=True)):
                break
    return [torch.cat(o) for o in outs], cache


@pytest.mark.parametrize("position", PER_HEAD)
def test_each_sequence_of_a_ragged_batch_equals_it_alone(position):
    mha = _mha(position, kv_heads=1)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, E, dtype=F64, generator=g) for n in (7, 4, 9, 5)]
    outs, cache = _decode_ragged(mha, xs, prompts=[2, 4, 1, 3])
    with torch.no_grad():
        for x, got in zip(xs, outs, strict=True):
            alone = mha(x[None], mask=masks.causal(len(x))).context[0]
            torch.testing.assert_close(got, alone, atol=1e-12, rtol=1e-12)
    assert cache.sequences == [] and cache.pages_in_use == 0
    assert cache.free_pages == cache.capacity > 0


def test_the_view_is_each_sequence_right_aligned_and_zero_padded():
    cache = PagedKVCache(1, page_size=2)
    a, b = cache.add(), cache.add()
    g = torch.Generator().manual_seed(3)
    history = {a: [], b: []}  # every key appended so far, (H_kv=2, d=3) per token
    for counts in ([3, 1], [1, 1], [2, 4], [1, 1]):
        m = max(counts)
        k = torch.randn(2, 2, m, 3, dtype=F64, generator=g)
        v = torch.randn(2, 2, m, 5, dtype=F64, generator=g)
        with cache.step([a, b], counts) as step:
            keys, values = cache[0].append(k, v)
        for row, (s, c) in enumerate(zip((a, b), counts, strict=True)):
            history[s] += [(k[row, :, t], v[row, :, t]) for t in range(m - c, m)]
        n = step.cached + m
        assert keys.shape == (2, 2, n, 3) and values.shape == (2, 2, n, 5)
        for row, s in enumerate((a, b)):
            own = len(history[s])
            assert torch.equal(keys[row, :, : n - own], torch.zeros(2, n - own, 3, dtype=F64))
            for t, (kt, vt) in enumerate(history[s]):
                assert torch.equal(keys[row, :, n - own + t], kt)
                assert torch.equal(values[row, :, n - own + t], vt)
            # new query rows sit in the last columns; padded rows may attend every column
            for i in range(m):
                allowed = step.mask[row, i]
                column = step.cached + i
                if i >= m - counts[row]:
                    want = [n - own <= j <= column for j in range(n)]
                    assert step.positions[row, i] == own - (m - i)
                else:
                    want = [j <= column for j in range(n)]
                    assert step.positions[row, i] == -1
                assert allowed.tolist() == want
    assert cache.length_of(a) == 7 and cache.length_of(b) == 7


def test_pages_are_taken_on_demand_and_given_back():
    cache = PagedKVCache(1, page_size=4)
    kv = lambda m: (torch.zeros(2, 1, m, 2), torch.zeros(2, 1, m, 2))  # noqa: E731
    a, b = cache.add(), cache.add()
    with cache.step([a, b], [5, 2]):
        cache[0].append(*kv(5))
    tables = [cache.page_table(a), cache.page_table(b)]
    assert [len(t) for t in tables] == [2, 1] and not set(tables[0]) & set(tables[1])
    assert cache.pages_in_use == 3
    for _ in range(3):  # a grows to 8 tokens: still 2 pages; then 9: a third
        with cache.step([a, b], [1, 1]):
            cache[0].append(*kv(1))
    assert len(cache.page_table(a)) == 2
    with cache.step([a, b], [1, 1]):
        cache[0].append(*kv(1))
    assert len(cache.page_table(a)) == 3 == cache.pages_for(9)
    capacity, held = cache.capacity, set(cache.page_table(a))
    cache.free(a)
    assert cache.pages_in_use == 2 and cache.free_pages == capacity - 2
    c = cache.add()  # a new sequence takes the freed pages; the pool does not grow
    with cache.step([b, c], [1, 9]):
        cache[0].append(*kv(9))
    assert set(cache.page_table(c)) <= held | set(range(capacity)) and cache.capacity == capacity
    assert cache.length_of(c) == 9 and cache.length_of(b) == 7
    assert cache[0].k_pool.shape == (capacity * 4, 1, 2)
    assert cache.nbytes == 2 * capacity * 4 * 1 * 2 * 4  # k and v pools, float32


def test_a_capped_pool_refuses_and_a_failed_step_changes_nothing():
    cache = PagedKVCache(1, page_size=2, num_pages=2)
    s = cache.add()
    with pytest.raises(ValueError, match="num_pages = 2"):
        cache.step([s], [5])
    assert cache.pages_in_use == 0 and cache.length_of(s) == 0
    with pytest.raises(RuntimeError, match="boom"), cache.step([s], [3]):
        raise RuntimeError("boom")
    assert cache.pages_in_use == 0 and cache.length_of(s) == 0
    with pytest.raises(ValueError, match=r"layers \[0\] did not append"), cache.step([s], [3]):
        pass
    assert cache.pages_in_use == 0 and cache.length_of(s) == 0


def test_steps_refuse_misuse():
    cache = PagedKVCache(1)
    k = torch.zeros(1, 1, 1, 2)
    with pytest.raises(ValueError, match=r"inside `with cache\.step"):
        cache[0].append(k, k)
    s = cache.add()
    for seqs, counts, what in (
        ([s + 5], [1], "live sequence"),
        ([s, s], [1, 1], "distinct"),
        ([s], [1, 1], "one count per sequence"),
        ([s], [0], "at least one new token"),
        ([], [], "at least one sequence"),
    ):
        with pytest.raises(ValueError, match=what):
            cache.step(seqs, counts)
    with cache.step([s], [1]):
        with pytest.raises(ValueError, match="do not nest"):
            cache.step([s], [1])
        with pytest.raises(ValueError, match="M = 1 new places"):
            cache[0].append(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
        with pytest.raises(ValueError, match="open step"):
            cache.free(s)
        cache[0].append(k, k)
        with pytest.raises(ValueError, match="appended twice"):
            cache[0].append(k, k)
    with pytest.raises(ValueError, match="dtype"), cache.step([s], [1]):
        cache[0].append(k.double(), k.double())
    with pytest.raises(ValueError, match="live sequence"):
        cache.length_of(s + 1)


def test_a_ragged_batch_refuses_a_scheme_that_reads_absolute_positions():
    mha = _mha(_ScaleByPosition())
    x = torch.randn(2, 4, E, dtype=F64)
    paged, contiguous = PagedKVCache(1), LayerCache()
    a, b = paged.add(), paged.add()
    with torch.no_grad():
        with paged.step([a, b], [4, 4]) as step:  # equal lengths: no shift, accepted
            got = mha(x, cache=paged[0], mask=step.mask).context
        want = mha(x, cache=contiguous, mask=masks.causal(4)).context
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
        c = paged.add()
        with (
            pytest.raises(ValueError, match="does not declare translation_invariant = True"),
            paged.step([a, c], [1, 2]) as step,
        ):
            mha(torch.zeros(2, 2, E, dtype=F64), cache=paged[0], mask=step.mask)
    assert paged.length_of(a) == 4 and paged.length_of(c) == 0
    windowed = ak.MultiHeadAttention(
        E, H, pattern=ak.patterns.sliding_window(2, causal=True), dtype=F64
    )
    cache = PagedKVCache(1)
    a, b = cache.add(), cache.add()
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match="pattern"),
        cache.step([a, b], [1, 2]) as step,
    ):
        windowed(torch.zeros(2, 2, E, dtype=F64), cache=cache[0], mask=step.mask)


def test_a_part_with_its_own_state_is_refused():
    part = ak.mechanisms.REGISTRY.get("retention").for_heads(
        embed_dim=E, num_heads=H, head_dim=E // H, max_len=8
    )
    layer = ak.MultiHeadAttention(E, H, attention=part)
    with pytest.raises(ValueError, match="Retention, a part that declares takes_cache = True"):
        PagedKVCache(1)[0].claim(layer)


def test_a_part_that_does_not_declare_decoding_is_refused():
    class NoDecoding(ak.HeadAttention):
        mask_forms = frozenset({"key"})

    cache = PagedKVCache(1)
    with pytest.raises(
        ValueError,
        match=r"^PagedLayerCache of MultiHeadAttention: attention part NoDecoding does not "
        r"declare decodes_with_cache = True",
    ):
        cache[0].claim(ak.MultiHeadAttention(E, H, attention=NoDecoding()))
    cache[0].claim(_mha())  # the refused layer did not claim it


def test_a_decoder_lm_decodes_equal_lengths_as_with_its_own_cache():
    torch.manual_seed(0)
    lm = DecoderLM(11, E, H, 2, max_len=12, dtype=F64, position="rope").eval()
    tokens = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(4))
    own, paged = lm.new_cache(), PagedKVCache(2, page_size=3)
    ids = [paged.add(), paged.add()]
    with torch.no_grad():
        for s in [slice(0, 4)] + [slice(t, t + 1) for t in range(4, 7)]:
            want = lm(tokens[:, s], cache=own)
            with paged.step(ids, [s.stop - s.start] * 2):
                got = lm(tokens[:, s], cache=paged)
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert paged.nbytes > 0 and paged.pages_in_use == 2 * 3


class _DeclaredRope(ak.positions.Rotary):
    translation_invariant = True  # a custom scheme that declares it reads only i − j


def test_which_schemes_a_ragged_batch_takes():
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, E, dtype=F64, generator=g) for n in (5, 3)]
    mha = _mha(_DeclaredRope())
    outs, _ = _decode_ragged(mha, xs, prompts=[3, 1], join_at=0)
    with torch.no_grad():
        for x, got in zip(xs, outs, strict=True):
            alone = mha(x[None], mask=masks.causal(len(x))).context[0]
            torch.testing.assert_close(got, alone, atol=1e-12, rtol=1e-12)
    scaling = rope_scaling.DynamicNTKScaling(factor=2.0, max_len=4)
    refusals = {
        rope_scaling.ScaledRotary(scaling=scaling): "reads the length of the whole sequence",
        _ScaleByPosition(): "does not declare translation_invariant = True",
    }
    for refused, reason in refusals.items():
        with pytest.raises(ValueError, match=reason):
            _decode_ragged(_mha(refused), xs, prompts=[3, 1], join_at=0)
    static = rope_scaling.ScaledRotary(scaling=rope_scaling.LinearScaling(factor=2.0))
    _decode_ragged(_mha(static), xs, prompts=[3, 1], join_at=0)  # accepted


class _Largest(TorchDispatchMode):
    """Records the most elements of any new tensor an operation makes (an in-place write
    returns its input: not counted)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.data_ptr() not in given:
                self.most = max(self.most, t.numel())
        return out


def _unreachable(*args, **kwargs):
    raise AssertionError("the pages were gathered into a contiguous view")


@pytest.mark.parametrize("position", [None, "rope", "alibi", "t5"])
def test_in_place_reads_equal_the_view_and_never_gather(position, monkeypatch):
    mha = _mha(position, kv_heads=1)
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(n, E, dtype=F64, generator=g) for n in (8, 5, 10)]
    monkeypatch.setattr(PagedLayerCache, "_gather", staticmethod(_unreachable))
    cache = PagedKVCache(1, page_size=3, block=4)  # several blocks, not aligned to pages
    ids = [cache.add() for _ in xs]
    with torch.no_grad():
        outs = [[] for _ in xs]
        with cache.step(ids, [3, 1, 2]) as step:
            out = mha(
                _left_pad([xs[0][:3], xs[1][:1], xs[2][:2]], 3), cache=cache[0], mask=step.mask
            )
        for row, c in enumerate([3, 1, 2]):
            outs[row].append(out.context[row, 3 - c :])
        fed = [3, 1, 2]
        while any(f < len(x) for f, x in zip(fed, xs, strict=True)):
            live = [b for b in range(3) if fed[b] < len(xs[b])]
            with cache.step([ids[b] for b in live], [1] * len(live)) as step:
                x = torch.stack([xs[b][fed[b] : fed[b] + 1] for b in live])
                out = mha(x, cache=cache[0], mask=step.mask).context
            for row, b in enumerate(live):
                outs[b].append(out[row])
                fed[b] += 1
        for x, got in zip(xs, outs, strict=True):
            alone = mha(x[None], mask=masks.causal(len(x))).context[0]
            torch.testing.assert_close(torch.cat(got), alone, atol=1e-12, rtol=1e-12)


def test_a_part_the_in_place_read_does_not_cover_reads_the_view():
    mha = ak.MultiHeadAttention(E, H, score="dot", dtype=F64)  # unscaled: not the plain form
    x = torch.randn(1, 5, E, dtype=F64, generator=torch.Generator().manual_seed(7))
    cache = PagedKVCache(1, page_size=2)
    s = cache.add()
    calls = []
    original = PagedLayerCache._gather
    spy = lambda *a: calls.append(1) or original(*a)  # noqa: E731
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(PagedLayerCache, "_gather", staticmethod(spy))
        with cache.step([s], [5]) as step:
            got = mha(x, cache=cache[0], mask=step.mask).context
    assert len(calls) == 2  # keys and values
    torch.testing.assert_close(got, mha(x, mask=masks.causal(5)).context, atol=1e-12, rtol=0)


def test_the_in_place_read_makes_no_tensor_the_size_of_the_context():
    mha = _mha("rope", kv_heads=1)
    n = 96
    x = torch.randn(1, n, E, dtype=F64, generator=torch.Generator().manual_seed(8))
    largest = {}
    for gather in (False, True):
        cache = PagedKVCache(1, page_size=8, gather=gather, block=16)
        s = cache.add()
        with torch.no_grad():
            with cache.step([s], [n]) as step:
                mha(x, cache=cache[0], mask=step.mask)
            with _Largest() as spy, cache.step([s], [1]) as step:
                mha(x[:, :1], cache=cache[0], mask=step.mask)
        largest[gather] = spy.most
    head = E // H
    # the gathered view of the one key/value head (SDPA takes grouped heads as they are)
    assert largest[True] >= (n + 1) * head
    # the pools (made at the first step) are not made again; a block of 16 columns at most
    assert largest[False] <= 16 * head * H


def test_a_fork_shares_the_prefix_and_copies_a_page_on_write():
    mha = _mha("rope")
    g = torch.Generator().manual_seed(9)
    prompt = torch.randn(5, E, dtype=F64, generator=g)
    tails = [torch.randn(3, E, dtype=F64, generator=g) for _ in range(2)]
    cache = PagedKVCache(1, page_size=4)
    a = cache.add()
    with torch.no_grad(), cache.step([a], [5]) as step:
        mha(prompt[None], cache=cache[0], mask=step.mask)
    b = cache.fork(a)
    assert cache.page_table(b) == cache.page_table(a) and cache.length_of(b) == 5
    assert [cache.references(p) for p in cache.page_table(a)] == [2, 2]
    assert cache.pages_in_use == 2
    before, prefix = cache[0].k_pool.clone(), cache.page_table(a)
    outs = {a: [], b: []}
    with torch.no_grad():
        for t in range(3):
            with cache.step([a, b], [1, 1]) as step:
                x = torch.stack([tails[0][t : t + 1], tails[1][t : t + 1]])
                out = mha(x, cache=cache[0], mask=step.mask).context
            outs[a].append(out[0])
            outs[b].append(out[1])
        # the shared full page is still shared; the partial one was copied by both writers' step
        pa, pb = cache.page_table(a), cache.page_table(b)
        assert pa[0] == pb[0] and cache.references(pa[0]) == 2
        assert pa[1] != pb[1] and cache.references(pa[1]) == cache.references(pb[1]) == 1
        size = cache.page_size
        for page in (pa[1], pb[1]):  # the prefix's token 4 was copied into both pages
            assert torch.equal(cache[0].k_pool[page * size], before[prefix[1] * size])
        for s, tail in ((a, tails[0]), (b, tails[1])):
            x = torch.cat([prompt, tail])
            alone = mha(x[None], mask=masks.causal(8)).context[0, 5:]
            torch.testing.assert_close(torch.cat(outs[s]), alone, atol=1e-12, rtol=1e-12)
    cache.free(a)
    assert cache.references(pb[0]) == 1 and cache.pages_in_use == 2
    cache.free(b)
    assert cache.pages_in_use == 0 and cache.free_pages == cache.capacity


def test_a_fork_of_part_of_a_sequence_and_at_a_page_boundary():
    cache = PagedKVCache(1, page_size=2)
    kv = lambda m: (torch.arange(m, dtype=F64).expand(1, 1, m)[..., None],) * 2  # noqa: E731
    a = cache.add()
    with cache.step([a], [5]):
        cache[0].append(*kv(5))
    b = cache.fork(a, tokens=4)  # two full pages, shared; a's third page is a's alone
    assert cache.page_table(b) == cache.page_table(a)[:2] and cache.length_of(b) == 4
    with cache.step([b], [1]):
        keys, _ = cache[0].append(torch.full((1, 1, 1, 1), 9.0, dtype=F64), kv(1)[1])
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 9]
    assert cache.page_table(b)[:2] == cache.page_table(a)[:2]  # nothing copied
    with cache.step([a], [1]):
        keys, _ = cache[0].append(*kv(1))
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 0]
    c = cache.fork(a, tokens=0)
    assert cache.page_table(c) == [] and cache.length_of(c) == 0
    for bad, match in (
        (lambda: cache.fork(a, tokens=7), "tokens = 7: sequence 0 holds only 6 tokens"),
        (lambda: cache.fork(99), "live sequence"),
        (lambda: cache.fork(a, tokens=-1), "tokens must be an int >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()


def test_a_failed_step_gives_back_a_copied_page():
    cache = PagedKVCache(1, page_size=2, num_pages=3)
    a = cache.add()
    with cache.step([a], [3]):
        cache[0].append(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    b = cache.fork(a)
    table = cache.page_table(b)
    with pytest.raises(RuntimeError, match="boom"), cache.step([b], [1]):
        raise RuntimeError("boom")
    assert cache.page_table(b) == table == cache.page_table(a)
    assert [cache.references(p) for p in table] == [2, 2] and cache.pages_in_use == 2
    with pytest.raises(ValueError, match=r"num_pages = 3: .* \(3 held by 2 sequences\)"):
        cache.step([a, b], [1, 3])  # a copies its last page (the third), b needs two more
    assert cache.page_table(a) == cache.page_table(b) == table and cache.pages_in_use == 2
    cache.free(a)  # eviction: b alone holds the pages now, and may write into them
    with cache.step([b], [1]):
        cache[0].append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert cache.page_table(b) == table and cache.pages_in_use == 2


def test_paged_rollback_then_decoding_equals_never_having_decoded():
    mha = _mha("rope", kv_heads=1)
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 9, E, dtype=F64, generator=g)
    wrong = torch.randn(2, 4, E, dtype=F64, generator=g)
    cache = PagedKVCache(1, page_size=2)
    ids = [cache.add(), cache.add()]
    with torch.no_grad():
        with cache.step(ids, [6, 6]) as step:
            mha(x[:, :6], cache=cache[0], mask=step.mask)
        with cache.step(ids, [4, 4]) as step:
            mha(wrong, cache=cache[0], mask=step.mask)
        assert cache.pages_in_use == 10
        cache.rollback(4)
        assert cache.pages_in_use == 6 and cache.length_of(ids[0]) == 6
        cache.rollback(1, sequences=[ids[1]])
        with cache.step(ids, [3, 4]) as step:  # a ragged batch after the rollback
            width = step.width
            new = _left_pad([x[0, 6:9], x[1, 5:9]], width)
            got = mha(new, cache=cache[0], mask=step.mask).context
        full = mha(x, mask=masks.causal(9)).context
    torch.testing.assert_close(got[0, 1:], full[0, 6:], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got[1], full[1, 5:], atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="k = 10: sequence 0 holds only 9 tokens"):
        cache.rollback(10)
    assert cache.length_of(ids[0]) == 9 == cache.length_of(ids[1])
    with (
        pytest.raises(ValueError, match="did not append"),
        cache.step(ids, [1, 1]),
        pytest.raises(ValueError, match="rollback: a step is open"),
    ):
        cache.rollback(1)
    assert cache.length_of(ids[0]) == 9 and cache.pages_in_use == 10
    with pytest.raises(ValueError, match=r"roll back the whole cache, PagedKVCache\.rollback"):
        cache[0].rollback(1)


def test_bad_cache_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="block must be a positive int"):
        PagedKVCache(1, block=0)
    with pytest.raises(TypeError, match="gather must be a bool"):
        PagedKVCache(1, gather="yes")
