"""Properties of every registered attention-slot part and every position scheme inside
:class:`attnkit.MultiHeadAttention` (hypothesis): batch items are independent, key padding in
each mask form equals truncation (or is refused with a ValueError), NaN and inf in padded keys,
values and queries never reach a real row, causal parts ignore later tokens, an empty batch gives
an empty result, float32 agrees with float64 and bfloat16 stays finite.

The parts are found through the mechanism registry (``attnkit.tasks.parts.slot_mechanisms``) and
the schemes through the position registry, so a new registration is covered (or, if it needs
arguments the sizes cannot give, makes :func:`test_every_registered_part_is_covered` fail).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import attnkit as ak
from attnkit.efficient import synthesizer as sy
from attnkit.positions import REGISTRY as POSITIONS
from attnkit.tasks import parts

E, H, D, MAX_LEN = 8, 2, 4, 8

# Parts whose constructor needs arguments the sizes cannot give, and the landmark and low-rank
# parts with fewer landmarks / projected rows than tokens (so that they approximate).
SPECIAL = {
    "adaptive_span": lambda: ak.mechanisms.build("adaptive_span", num_heads=H, max_span=3),
    "synthesizer": lambda: ak.mechanisms.build(
        "synthesizer", components=[sy.RandomSynthetic(MAX_LEN, num_heads=H)]
    ),
    "nystrom": lambda: ak.mechanisms.build("nystrom", num_landmarks=3),
    "soft": lambda: ak.mechanisms.build("soft", num_landmarks=3),
    "skyformer": lambda: ak.mechanisms.build("skyformer", num_landmarks=3),
    "linformer": lambda: ak.mechanisms.build("linformer", max_len=MAX_LEN, k=3, num_heads=H),
}
# Parts that are causal by a constructor flag (or by construction), not by a mask.
CAUSAL = {
    "linear (causal)": lambda: ak.mechanisms.build("linear", causal=True),
    "performer (causal)": lambda: ak.mechanisms.build("performer", head_dim=D, causal=True),
    "rfa (causal)": lambda: ak.mechanisms.build("rfa", head_dim=D, causal=True),
    "rfa (causal, gated)": lambda: ak.mechanisms.build("rfa", head_dim=D, causal=True, gate=True),
    "fmm (causal)": lambda: ak.mechanisms.build("fmm", bandwidth=2, causal=True),
    "kernel_rpe_fft (causal)": lambda: ak.mechanisms.build(
        "kernel_rpe_fft", max_len=MAX_LEN, num_heads=H, causal=True
    ),
    "fast_weight": lambda: ak.mechanisms.build("fast_weight"),
}


def _factory(name):
    if name == "full":
        return lambda: None  # the default part: ak.Attention(scaled dot, softmax)
    if name in SPECIAL:
        return SPECIAL[name]
    if name in CAUSAL:
        return CAUSAL[name]
    return lambda: parts.build_slot_attention(name, head_dim=D, num_heads=H, max_len=MAX_LEN)


PART_NAMES = ["full", *parts.slot_mechanisms(), *[n for n in CAUSAL if n != "fast_weight"]]
SCHEMES = POSITIONS.available()
ABSOLUTE = [s for s in SCHEMES if getattr(POSITIONS.get(s), "absolute", False)]
SLOT_SCHEMES = [s for s in SCHEMES if s not in ABSOLUTE]

# Known failures of parts in other modules, kept visible (strict xfail) until fixed there.
OTHERS = {
    "causal": {},
}


def _params(test):
    out = []
    for name in PART_NAMES:
        reason = OTHERS.get(test, {}).get(name)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def _is_causal(name):
    # in CAUSAL, or a registered part that is causal by construction (a class attribute)
    if name in CAUSAL:
        return True
    cls = ak.mechanisms.REGISTRY.get(name) if name in ak.mechanisms.available() else None
    return getattr(cls, "causal", False) is True


def _mha(name, position=None, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    part = _factory(name)()
    kw = {} if part is None else {"attention": part}
    return ak.MultiHeadAttention(E, H, position=position, **kw).to(dtype).eval()


def _run(mha, *args, **kw):
    torch.manual_seed(1234)  # any part that draws at call time draws the same
    with torch.no_grad():
        return mha(*args, **kw).context


@functools.cache
def _outcome(name, scheme):
    """'ok' if the part runs with the scheme, else the exception it raised."""
    try:
        mha = _mha(name, scheme)
        _run(mha, torch.randn(2, 5, E, dtype=torch.float64))
    except (ValueError, TypeError) as err:
        return err
    return "ok"


@functools.cache
def _working(name):
    return tuple(s for s in SLOT_SCHEMES if _outcome(name, s) == "ok")


def _gives_bias(scheme):
    """Whether the scheme adds a bias or a value term (which parts that never form the
    (M, N) scores cannot take)."""
    built = ak.slots.position_scheme(scheme, head_dim=D, num_heads=H, dtype=torch.float64)
    q = torch.randn(1, H, 3, D, dtype=torch.float64)
    out = built(q, q)
    return out.bias is not None or out.values is not None


def test_every_registered_part_is_covered():
    for name in parts.slot_mechanisms():
        assert isinstance(_factory(name)(), torch.nn.Module), name
    assert "nystrom" in PART_NAMES and "soft" in PART_NAMES and "skyformer" in PART_NAMES


@pytest.mark.parametrize("scheme", ABSOLUTE)
def test_absolute_schemes_are_refused_by_the_slot(scheme):
    with pytest.raises(TypeError, match="token embeddings"):
        ak.MultiHeadAttention(E, H, position=scheme)


@pytest.mark.parametrize("name", PART_NAMES)
def test_each_scheme_runs_or_a_bias_is_refused_clearly(name):
    for scheme in SLOT_SCHEMES:
        outcome = _outcome(name, scheme)
        if outcome == "ok":
            continue
        assert isinstance(outcome, ValueError), f"{name}/{scheme}: {outcome!r}"
        assert _gives_bias(scheme), f"{name}/{scheme}: refused without a bias: {outcome}"
        assert "bias" in str(outcome), f"{name}/{scheme}: unclear refusal: {outcome}"
    assert _working(name), f"{name} runs with no position scheme at all"


def _padded(b, n, lengths, plant, seed):
    """x (B, N, E) whose positions past each length hold ``plant`` (or other random values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, E, generator=g, dtype=torch.float64)
    pad = torch.arange(n)[None, :] >= torch.tensor(lengths)[:, None]  # (B, N)
    fill = {
        "random": torch.randn(b, n, E, generator=g, dtype=torch.float64) * 3,
        "nan": torch.full((b, n, E), torch.nan, dtype=torch.float64),
        "inf": torch.full((b, n, E), torch.inf, dtype=torch.float64),
        "huge": torch.full((b, n, E), -1e30, dtype=torch.float64),
    }[plant]
    return torch.where(pad[..., None], fill, x)


def _mask(form, lengths, n, m=None):
    """Key padding for the lengths in one of three forms: (B, 1, N) from from_lengths, the same
    expanded to (B, M, N), and for self-attention (B, N, N) with padded query rows empty."""
    pad = ak.masks.from_lengths(torch.tensor(lengths), n)
    m = n if m is None else m
    if form == "key (B, 1, N)":
        return pad
    if form == "expanded (B, M, N)":
        return pad.expand(len(lengths), m, n)
    return pad & pad.transpose(-1, -2)  # "rows (B, N, N)": self-attention only


def _close(actual, expected, what, tol=1e-9):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: not finite"
    scale = 1 + float(expected.abs().max()) if expected.numel() else 1
    worst = float((actual - expected).abs().max()) if actual.numel() else 0.0
    assert worst <= tol * scale, f"{what}: max difference {worst:.3g}"


SETTINGS = settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: the failing case is printed as is
    suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def padded_batches(draw, n_min=1):
    b = draw(st.integers(1, 3))
    n = draw(st.integers(max(n_min, 2), 7))
    lengths = draw(st.lists(st.integers(1, n), min_size=b, max_size=b))
    return b, n, lengths


@pytest.mark.parametrize("name", PART_NAMES)
def test_every_scheme_keeps_items_apart_and_padding_out(name):
    """One fixed case per working scheme, so that every pair is run: batch == items and
    key padding (with NaN in the padding) == truncation. (The hypothesis tests below draw the
    scheme, sizes and padding; comparing a padded batch with each item alone there also checks
    that the items are independent.)"""
    lengths = [6, 3, 1]
    x = _padded(3, 6, lengths, "nan", seed=7)
    clean = torch.nan_to_num(x, nan=0.5)
    for scheme in _working(name):
        mha = _mha(name, scheme)
        whole = _run(mha, clean)
        items = torch.cat([_run(mha, clean[i : i + 1]) for i in range(3)])
        _close(whole, items, f"{name}/{scheme}: batch vs items")
        out = _run(mha, x, mask=_mask("key (B, 1, N)", lengths, 6))
        for i, n in enumerate(lengths):
            alone = _run(mha, x[i : i + 1, :n])
            _close(out[i : i + 1, :n], alone, f"{name}/{scheme}: item {i} padded vs truncated")


@pytest.mark.parametrize("name", PART_NAMES)
@SETTINGS
@given(case=padded_batches(), data=st.data())
def test_self_attention_padding_equals_truncation(name, case, data):
    b, n, lengths = case
    scheme = data.draw(st.sampled_from(_working(name)), label="scheme")
    form = data.draw(
        st.sampled_from(["key (B, 1, N)", "expanded (B, M, N)", "rows (B, N, N)"]), label="form"
    )
    plant = data.draw(st.sampled_from(["random", "nan", "inf", "huge"]), label="padding")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    mha = _mha(name, scheme, seed=seed)
    x = _padded(b, n, lengths, plant, seed)
    try:
        out = _run(mha, x, mask=_mask(form, lengths, n))
    except ValueError as err:  # a part may refuse a mask form, clearly
        assert "mask" in str(err), f"{name}: unclear refusal of {form}: {err}"
        assert form != "key (B, 1, N)", f"{name} refuses key padding: {err}"
        return
    for i, length in enumerate(lengths):
        alone = _run(mha, x[i : i + 1, :length])
        what = f"{name}/{scheme}, {form}, {plant} padding: item {i} vs truncated"
        _close(out[i : i + 1, :length], alone, what)


@pytest.mark.parametrize("name", [n for n in PART_NAMES if not _is_causal(n)])
@SETTINGS
@given(case=padded_batches(), data=st.data())
def test_cross_attention_key_padding_equals_truncation(name, case, data):
    b, n, lengths = case
    m = data.draw(st.integers(1, 5), label="queries")
    scheme = data.draw(st.sampled_from(_working(name)), label="scheme")
    form = data.draw(st.sampled_from(["key (B, 1, N)", "expanded (B, M, N)"]), label="form")
    plant = data.draw(st.sampled_from(["random", "nan", "inf", "huge"]), label="padding")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    mha = _mha(name, scheme, seed=seed)
    query = torch.randn(b, m, E, generator=torch.Generator().manual_seed(seed), dtype=torch.double)
    key = _padded(b, n, lengths, plant, seed + 1)
    value = _padded(b, n, lengths, plant, seed + 2)  # padded where the keys are, other content
    try:
        out = _run(mha, query, key, value, mask=_mask(form, lengths, n, m))
    except ValueError as err:
        assert "mask" in str(err), f"{name}: unclear refusal of {form}: {err}"
        assert form != "key (B, 1, N)", f"{name} refuses key padding: {err}"
        return
    for i, length in enumerate(lengths):
        alone = _run(mha, query[i : i + 1], key[i : i + 1, :length], value[i : i + 1, :length])
        _close(out[i : i + 1], alone, f"{name}/{scheme}, {form}, {plant}: item {i}")


@pytest.mark.parametrize("name", _params("causal"))
@SETTINGS
@given(case=padded_batches(n_min=3), data=st.data())
def test_causal_parts_ignore_later_tokens(name, case, data):
    """A causal part (by flag), or any part given a causal mask, answers the first t queries
    from the first t tokens: later tokens — other values, NaN or inf — change nothing there."""
    b, n, _ = case
    t = data.draw(st.integers(1, n - 1), label="t")
    scheme = data.draw(st.sampled_from(_working(name)), label="scheme")
    plant = data.draw(st.sampled_from(["random", "nan", "inf"]), label="later tokens")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    mha = _mha(name, scheme, seed=seed)
    mask = None if _is_causal(name) else ak.masks.causal(n)
    x = _padded(b, n, [n] * b, "random", seed)
    try:
        out = _run(mha, x, mask=mask)
    except ValueError as err:  # parts whose keys or landmarks are shared refuse causal masks
        assert "mask" in str(err), f"{name}: unclear refusal of a causal mask: {err}"
        return
    later = _padded(b, n, [t] * b, plant, seed + 1)  # positions ≥ t hold the plant
    changed = _run(mha, later.where(torch.arange(n)[:, None] >= t, x), mask=mask)
    _close(changed[:, :t], out[:, :t], f"{name}/{scheme}: later tokens ({plant}) leak")


@pytest.mark.parametrize("name", PART_NAMES)
def test_padding_content_reaches_nothing_in_training_either(name):
    """In training mode (where a part may update state, e.g. routing's centroids, or redraw
    random features), what the padding holds changes neither the real rows nor any buffer."""
    lengths = [5, 2]
    runs = []
    for plant in ("random", "nan"):
        mha = _mha(name).train()
        out = _run(
            mha, _padded(2, 5, lengths, plant, seed=3), mask=_mask("key (B, 1, N)", lengths, 5)
        )
        runs.append((mha, out))
    (first, a), (second, b) = runs
    for i, n in enumerate(lengths):
        _close(b[i, :n], a[i, :n], f"{name}: item {i} with NaN padding vs other padding")
    for (key, x), (_, y) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        if x.is_floating_point():
            _close(y, x, f"{name}: {key} after a training step")


@pytest.mark.parametrize("name", PART_NAMES)
def test_empty_batch_gives_an_empty_result(name):
    for scheme in _working(name):
        mha = _mha(name, scheme)
        x = torch.randn(0, 5, E, dtype=torch.float64)
        out = _run(mha, x)
        assert out.shape == (0, 5, E), f"{name}/{scheme}"
        pad = ak.masks.from_lengths(torch.zeros(0, dtype=torch.long), 5)
        assert _run(mha, x, mask=pad).shape == (0, 5, E), f"{name}/{scheme}: masked"


@pytest.mark.parametrize("name", PART_NAMES)
@SETTINGS
@given(case=padded_batches(), data=st.data())
def test_float32_agrees_with_float64_and_bfloat16_is_finite(name, case, data):
    b, n, lengths = case
    scheme = data.draw(st.sampled_from(_working(name)), label="scheme")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    masked = data.draw(st.booleans(), label="masked")
    mha = _mha(name, scheme, seed=seed)
    x = _padded(b, n, lengths, "random", seed)
    mask = _mask("key (B, 1, N)", lengths, n) if masked else None
    ref = _run(mha, x, mask=mask)
    out32 = _run(mha.float(), x.float(), mask=mask)
    assert out32.dtype == torch.float32
    _close(out32.double(), ref, f"{name}/{scheme}: float32 vs float64", tol=1e-3)
    out16 = _run(mha.bfloat16(), x.bfloat16(), mask=mask)
    assert out16.dtype == torch.bfloat16
    assert torch.isfinite(out16).all(), f"{name}/{scheme}: bfloat16 not finite"


class _Recorder(ak.HeadAttention):
    """A part that declares ``mixes_queries`` and records the mask it is given."""

    mask_forms = frozenset({"key", "padding", "causal", "full"})
    mixes_queries = True
    decodes_with_cache = True

    def __init__(self, mixes_queries=True):
        super().__init__()
        self.mixes_queries = mixes_queries
        self.seen = []

    def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
        self.seen.append(mask)
        return ak.AttentionOutput(torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype))


def test_self_attention_names_the_padded_queries_to_a_part_that_mixes_queries():
    pad = ak.masks.from_lengths(torch.tensor([3, 1]), 4)  # (2, 1, 4)
    rows = pad.transpose(-1, -2) & pad  # padded query i: row i all False
    x, memory = torch.randn(2, 4, E), torch.randn(2, 4, E)
    part = _Recorder()
    mha = ak.MultiHeadAttention(E, H, attention=part)
    mha(x, mask=pad)
    torch.testing.assert_close(part.seen[-1], rows[:, None].expand(2, 1, 4, 4))
    mha(x, memory, memory, mask=pad)  # cross-attention: the queries are not the keys
    torch.testing.assert_close(part.seen[-1], pad[:, None])
    causal = ak.masks.causal(4)  # every token is attended by some query: no row cleared
    mha(x, mask=causal)
    torch.testing.assert_close(part.seen[-1], causal)
    plain = _Recorder(mixes_queries=False)
    ak.MultiHeadAttention(E, H, attention=plain)(x, mask=pad)
    torch.testing.assert_close(plain.seen[-1], pad[:, None])


def test_a_cached_step_names_its_own_query_as_padding():
    """With a KV cache the queries are the last M of the N tokens."""
    from attnkit.kv_cache import LayerCache

    part = _Recorder()
    mha = ak.MultiHeadAttention(E, H, attention=part)
    cache = LayerCache()
    x = torch.randn(2, 4, E)
    mha(x[:, :3], cache=cache, mask=ak.masks.from_lengths(torch.tensor([3, 3]), 3))
    step = ak.masks.from_lengths(torch.tensor([4, 2]), 4)  # item 1: the new token is padding
    mha(x[:, 3:], cache=cache, mask=step)
    expected = step & torch.tensor([True, False])[:, None, None]
    torch.testing.assert_close(part.seen[-1], expected[:, None])
