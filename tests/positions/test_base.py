"""The position slot's contract over every registered per-head scheme: built by name for the
heads, and queries placed by q_offset exactly as in one pass (cached decoding = full pass)."""

import pytest
import torch

import attnkit as ak

PER_HEAD = [n for n in ak.positions.available() if not ak.positions.REGISTRY.get(n).absolute]


def test_every_scheme_is_listed():
    assert set(ak.positions.available()) >= {
        "none", "sinusoidal", "learned", "rope", "alibi", "t5", "shaw", "music", "transformer_xl"
    }  # fmt: skip


@pytest.mark.parametrize("name", PER_HEAD)
def test_cached_decoding_equals_one_causal_pass(name):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2, position=name, dtype=torch.float64)
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    full = mha(x, mask=ak.masks.causal(5)).context
    cache = ak.kv_cache.LayerCache()
    first = mha(x[:, :2], mask=ak.masks.causal(2), cache=cache).context
    rest = [mha(x[:, t : t + 1], cache=cache).context for t in range(2, 5)]
    torch.testing.assert_close(torch.cat([first, *rest], dim=1), full)


def test_relative_distances():
    d = ak.positions.relative_distances(2, 3, 5, 1)
    assert d.tolist() == [[4, 3, 2], [5, 4, 3]]


@pytest.mark.parametrize("name", PER_HEAD)
@pytest.mark.parametrize(
    ("offsets", "error", "message"),
    [
        ({"q_offset": -1}, ValueError, r"q_offset must be an int >= 0, got -1"),
        ({"k_offset": -3}, ValueError, r"k_offset must be an int >= 0, got -3"),
        ({"q_offset": 1.5}, ValueError, r"q_offset must be an int >= 0, got 1.5"),
        ({"q_offset": True}, ValueError, r"q_offset must be an int >= 0, got True"),
    ],
    ids=["negative q_offset", "negative k_offset", "float q_offset", "bool q_offset"],
)
def test_bad_offsets_are_refused_by_every_scheme(name, offsets, error, message):
    scheme = ak.positions.REGISTRY.get(name).for_heads(4, 2)
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(error, match=message):
        scheme(q, q, **offsets)


@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_absolute_embeddings_refuse_a_negative_offset(name):
    embed = ak.positions.build(name, embed_dim=4, **({"max_len": 8} if name == "learned" else {}))
    with pytest.raises(ValueError, match=r"offset"):
        embed(torch.randn(1, 3, 4), offset=-1)


@pytest.mark.parametrize("name", ak.positions.available())
def test_every_scheme_has_an_example_that_acts_on_its_inputs(name):
    cls = ak.positions.REGISTRY.get(name)
    scheme = cls.example()
    if cls.absolute:  # width 8
        x = torch.randn(1, 3, 8)
        assert scheme(x).shape == x.shape
        return
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4)  # 2 heads of 4
    out = scheme(q, k)
    assert out.q.shape == q.shape and out.k.shape == k.shape
    by_keyword = cls.for_heads(head_dim=4, num_heads=2, embed_dim=8, max_len=16)
    assert repr(by_keyword) == repr(cls.for_heads(4, 2))


def test_sizes_a_scheme_needs_are_named():
    with pytest.raises(TypeError, match=r"position scheme 't5' needs num_heads"):
        ak.positions.REGISTRY.get("t5").for_heads(4)
    with pytest.raises(TypeError, match="not a per-head scheme"):
        ak.positions.REGISTRY.get("learned").for_heads(head_dim=4, num_heads=2, max_len=8)
    learned = ak.positions.REGISTRY.get("learned").for_model(6, max_len=9)
    assert learned.weight.shape == (9, 6)


def _declared_schemes():
    """Every per-head scheme's example, and RoPE with each scaling (whose declarations follow
    the scaling)."""
    from attnkit.positions import rope_scaling as rs

    out = {name: ak.positions.REGISTRY.get(name).example() for name in PER_HEAD}
    scalings = {
        "linear": rs.LinearScaling(2.0),
        "ntk": rs.NTKScaling(2.0),
        "dynamic_ntk": rs.DynamicNTKScaling(2.0, 4),
        "yarn": rs.YaRNScaling(2.0, 4),
        "llama3": rs.Llama3Scaling(2.0, 4),
        "longrope": rs.LongRoPEScaling((1.0, 1.5), (2.0, 6.0), 8, 3.0),
    }
    for label, scaling in scalings.items():
        out[f"rope_scaled[{label}]"] = rs.ScaledRotary(scaling=scaling)
    return out


DECLARED = _declared_schemes()


def _scores(scheme, q, k, offset):
    """The scores (…, M, N) the scheme makes of q, k placed at ``offset`` (its q/k transform,
    then its bias)."""
    out = scheme(q, k, q_offset=offset, k_offset=offset)
    e = out.q @ out.k.transpose(-1, -2)
    return e if out.bias is None else e + out.bias


@pytest.mark.parametrize("name", list(DECLARED))
def test_translation_invariance_is_declared_exactly_when_a_shift_changes_nothing(name):
    """A scheme that declares ``translation_invariant`` gives the same scores when every
    position moves by the same amount; one that does not, gives other scores for some shift
    (a declaration of False that could be True would refuse a paged cache for nothing)."""
    scheme = DECLARED[name].double()
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    base = _scores(scheme, q, k, 0)
    shifted = [_scores(scheme, q, k, s) for s in (1, 7, 40)]
    same = all(torch.allclose(s, base, rtol=1e-9, atol=1e-9) for s in shifted)
    assert scheme.translation_invariant == same, name


@pytest.mark.parametrize("name", list(DECLARED))
def test_reading_the_total_length_is_declared_exactly_when_a_prefix_changes_with_it(name):
    """``reads_total_length``: the scores among the first positions change when the sequence
    is longer (dynamic NTK past its trained length) iff the scheme declares it."""
    scheme = DECLARED[name].double()
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 12, 4, generator=g, dtype=torch.float64) for _ in range(2))
    prefix = _scores(scheme, q[..., :3, :], k[..., :3, :], 0)
    whole = _scores(scheme, q, k, 0)[..., :3, :3]
    changes = not torch.allclose(prefix, whole, rtol=1e-9, atol=1e-9)
    assert scheme.reads_total_length == changes, name


def test_a_scheme_that_reads_the_total_length_is_refused_by_every_cache():
    """Dynamic NTK: a cached step equals a pass over the prefix, which differs from the causal
    pass over the whole sequence, so every cache refuses it by name; without a cache the
    decoder generates."""
    from attnkit.models.decoder_lm import DecoderLM
    from attnkit.positions import rope_scaling as rs

    dynamic = rs.ScaledRotary(scaling=rs.DynamicNTKScaling(2.0, 4))
    mha = ak.MultiHeadAttention(8, 2, position=dynamic, dtype=torch.float64)
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"ScaledRotary .* reads the length of the whole sequence"):
        mha(x, mask=ak.masks.causal(3), cache=ak.kv_cache.LayerCache())
    with pytest.raises(ValueError, match="reads the length"):
        ak.kv_cache.LayerCache().claim(mha)
    lm = DecoderLM(20, 8, 2, 1, max_len=16, position=dynamic)
    prompt = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="generate with use_cache=False"):
        lm.generate(prompt, 3)
    assert lm.generate(prompt, 3, use_cache=False).shape == (1, 5)


PART_BY_PART = [n for n, s in DECLARED.items() if s.per_token and s.bias_of_positions]


def test_the_schemes_that_read_contents_do_not_declare_evaluation_part_by_part():
    # and xPos, whose queries and keys take different (inverse) scales: one transform_at per
    # position cannot place both
    assert set(DECLARED) - set(PART_BY_PART) == {"shaw", "music", "transformer_xl", "xpos"}


@pytest.mark.parametrize("name", PART_BY_PART)
def test_per_token_and_bias_of_positions_agree_with_the_scheme_itself(name):
    """What a scheme declares for evaluation part by part: ``transform_at`` places q and k as
    its forward does at any offsets, and ``bias_at`` (as a score_mod on zeros) is its bias."""
    scheme = DECLARED[name].double()
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    total = 12
    out = scheme(q, k, q_offset=7, k_offset=3)
    qpos, kpos = torch.arange(7, 12), torch.arange(3, 8)
    if scheme.reads_total_length:  # the forward reads max(q_offset + M, k_offset + N) = 12
        assert max(7 + 5, 3 + 5) == total
    torch.testing.assert_close(scheme.transform_at(q, qpos, total), out.q, rtol=0, atol=1e-12)
    torch.testing.assert_close(scheme.transform_at(k, kpos, total), out.k, rtol=0, atol=1e-12)
    zeros = torch.zeros(2, 2, 5, 5, dtype=torch.float64)
    b, h, i, j = torch.meshgrid(torch.arange(2), torch.arange(2), qpos, kpos, indexing="ij")
    bias = scheme.bias_at(zeros, b, h, i, j)
    want = zeros if out.bias is None else zeros + out.bias
    assert scheme.adds_bias == (out.bias is not None), name
    torch.testing.assert_close(bias, want, rtol=0, atol=1e-12)
