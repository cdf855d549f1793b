"""The per-head attention part's base (:class:`attnkit.HeadAttention`): its template
``forward`` (NaN padding and empty rows kept out of a minimal part, masks read in the declared
forms, a state's mask columns), its refusals, ``for_heads``, ``check_head_inputs``, and toy
parts defined here in the layers. The contract every registered part meets is
``tests/test_head_contract.py``.

Properties inside :class:`attnkit.MultiHeadAttention` (padding equals truncation in every mask
form, NaN in padding, float32 vs float64, ...) are in ``tests/test_slot_properties.py``.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from test_head_contract import EveryFormPart

import attnkit as ak
from attnkit.head import HeadAttention, check_head_inputs

E, H, D, N, MAX_LEN = 8, 2, 4, 6, 8


class ToyPart(ak.HeadAttention):
    """Scaled dot-product softmax attention written out: the smallest complete per-head part."""

    causal_form = True
    decodes_with_cache = True  # each query attends over the keys it is given
    accepts_bias = True
    mask_forms = frozenset({"key", "padding", "causal", "full"})

    def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
        check_head_inputs(q, k, v, mask, bias, "ToyPart")
        e = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if bias is not None:
            e = e + bias
        if mask is not None:
            e = e.masked_fill(~mask, float("-inf"))
        w = torch.softmax(e, -1).nan_to_num(0.0)  # a fully masked row: weights 0, context 0
        ak.hooks.report(self, w)
        return ak.AttentionOutput(w @ v, w if need_weights else None)


class MinimalPart(EveryFormPart):
    """ReLU attention written from HeadAttention's docstring alone (the per-head contract's
    part that honours every mask form), under this file's name for its messages."""


class KeyOnlyPart(MinimalPart):
    """The same, declaring key masks only: a mask of equal rows is read as its first row."""

    causal_form = False
    decodes_with_cache = False
    mask_forms = frozenset({"key"})


def _build(name: str) -> HeadAttention:
    torch.manual_seed(0)
    if name == "attention":
        part = ak.Attention()
    elif name == "toy":
        part = ToyPart()
    elif name == "minimal":
        part = MinimalPart()
    elif name == "key only":
        part = KeyOnlyPart()
    else:
        cls = ak.head_registry.REGISTRY.get(name)
        part = cls.for_heads(embed_dim=E, num_heads=H, head_dim=D, max_len=MAX_LEN)
    return part.double().eval()


def _inputs(seed: int = 0, n: int = N) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, H, n, D, generator=g, dtype=torch.float64) for _ in range(3)]


def _call(part, q, k, v, **kw):
    torch.manual_seed(1234)  # a part drawing at call time draws the same
    with torch.no_grad():
        return part(q, k, v, **kw)


def _assert_rows_equal(a, b, what):
    assert torch.isfinite(a).all(), f"{what}: not finite"
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=what)


def test_refusal_names_every_reason_and_check_supported_raises():
    part = ToyPart()
    assert part.refusal(bias=True, cache=True, mask=ak.masks.causal(3), m=3) is None
    bare = type("Bare", (HeadAttention,), {})()
    reasons = bare.reasons_not_supported(
        mask=torch.ones(3, 3, dtype=torch.bool), m=3, bias=True, score_mod=True, cache=True
    )
    assert len(reasons) == 4 and all("Bare" in r for r in reasons)
    for word in ("mask_forms", "accepts_bias", "accepts_score_mod", "decodes_with_cache"):
        assert any(word in r for r in reasons), word
    with pytest.raises(ValueError, match=r"^caller: attention part Bare does not declare"):
        bare.check_supported("caller", block_mask=True)
    with pytest.raises(
        NotImplementedError,
        match=r"Bare must implement attend\(q, k, v, \*, mask, bias, need_weights\) \(or forward\)",
    ):
        bare(*_inputs())


def test_a_plain_module_is_refused_with_how_to_derive_it():
    class Plain(torch.nn.Module):
        def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
            return ak.AttentionOutput(v)

    with pytest.raises(TypeError, match=r"derive it from attnkit\.HeadAttention"):
        ak.MultiHeadAttention(E, H, attention=Plain())


def test_a_part_that_declares_no_mask_form_is_told_how_to_declare_one():
    class NoMask(HeadAttention):
        def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
            return ak.AttentionOutput(torch.softmax(q @ k.transpose(-1, -2), -1) @ v)

    x = torch.randn(2, N, E)
    declare = r"declare the mask forms .* mask_forms = frozenset\("
    pad = ak.masks.from_lengths(torch.tensor([N, 4]), N)
    with pytest.raises(ValueError, match=rf"NoMask honours no mask .* key padding mask.*{declare}"):
        ak.MultiHeadAttention(E, H, attention=NoMask())(x, mask=pad)
    layer = ak.TransformerDecoderLayer(E, H, cross_attention=False, attention=NoMask())
    with pytest.raises(ValueError, match=rf"NoMask honours no mask .* \(…, M, N\) mask.*{declare}"):
        layer(x)  # the decoder's self-attention is causal: the layer passes the mask itself


def test_for_heads_fills_the_declared_sizes_and_refuses_what_it_cannot_fill():
    class Sized(HeadAttention):
        size_arguments: ClassVar[dict[str, str]] = {
            "head_dim": "head_dim",
            "num_heads": "num_heads",
            "span": "max_len",
        }

        def __init__(self, head_dim, num_heads, *, span=3, scale=1.0, max_len=5):
            super().__init__()
            self.sizes = (head_dim, num_heads, span, scale, max_len)

    made = Sized.for_heads(embed_dim=8, num_heads=2, head_dim=4, max_len=16)
    # declared sizes are filled, a length included; an undeclared argument keeps its default,
    # whatever its name (nothing is guessed from names)
    assert made.sizes == (4, 2, 16, 1.0, 5)
    made = Sized.for_heads(embed_dim=8, num_heads=2, head_dim=4, max_len=16, scale=0.5)
    assert made.sizes[3] == 0.5
    with pytest.raises(
        TypeError, match=r"attention part 'Sized' got an unexpected argument 'scal'"
    ):
        Sized.for_heads(embed_dim=8, num_heads=2, head_dim=4, max_len=16, scal=0.5)

    class NeedsMore(HeadAttention):
        def __init__(self, head_dim, table):
            super().__init__()

    with pytest.raises(TypeError, match="needs the argument 'head_dim', which no size gives"):
        NeedsMore.for_heads(embed_dim=8, num_heads=2, head_dim=4, max_len=16)
    module, args, kwargs = ToyPart.example()
    assert isinstance(module, ToyPart) and module(*args, **kwargs).context.shape == (2, 2, 7, 4)


def test_check_head_inputs_validates_and_takes_a_checked_call_as_given():
    q, k, v = _inputs()
    assert check_head_inputs(q, k[:1], v[:1], None, None, "who") == (2, H)
    with pytest.raises(ValueError, match="who: q has 4 features but k has 3"):
        check_head_inputs(q, k[..., :3], v, None, None, "who")
    with pytest.raises(ValueError, match="who: the key set is empty"):
        check_head_inputs(q, k[..., :0, :], v[..., :0, :], None, None, "who")
    with pytest.raises(TypeError, match="mask must be boolean"):
        check_head_inputs(q, k, v, torch.ones(N, N), None, "who")
    with pytest.raises(ValueError, match="who: bias of shape"):
        check_head_inputs(q, k, v, None, torch.ones(3, N), "who")
    # the caller checked the mask (checked=True): only the sizes are read
    assert check_head_inputs(q, k, v, torch.ones(N, N), None, "who", checked=True) == (2, H)
    with pytest.raises(ValueError, match="the key set is empty"):
        check_head_inputs(q, k[..., :0, :], v[..., :0, :], None, None, "who", checked=True)


def test_the_toy_part_works_in_multi_head_attention_and_the_layers():
    """The toy part is scaled dot-product softmax attention, so each layer holding it equals the
    same layer with the default part and the same weights, a KV cache included."""
    torch.manual_seed(6)
    x = torch.randn(2, 5, E, dtype=torch.float64)
    mask = ak.masks.from_lengths(torch.tensor([5, 3]), 5)
    bias = torch.randn(5, 5, dtype=torch.float64)
    toy = ak.MultiHeadAttention(E, H, attention=ToyPart()).double()
    ref = ak.MultiHeadAttention(E, H).double()
    ref.load_state_dict(toy.state_dict())
    out = toy(x, mask=mask, bias=bias, need_weights=True)
    expected = ref(x, mask=mask, bias=bias, need_weights=True)
    torch.testing.assert_close(out.context, expected.context)
    torch.testing.assert_close(out.weights, expected.weights)
    with ak.evaluation.capture(toy) as rec:
        toy(x)
    assert list(rec) == ["attention"]

    layer = ak.TransformerEncoderLayer(E, H, 16, attention=ToyPart()).double().eval()
    plain = ak.TransformerEncoderLayer(E, H, 16).double().eval()
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x, mask=mask), plain(x, mask=mask))

    from attnkit.models.decoder_lm import DecoderLM

    lm = DecoderLM(11, E, H, 1, max_len=8, attention=ToyPart()).double().eval()
    plain_lm = DecoderLM(11, E, H, 1, max_len=8).double().eval()
    plain_lm.load_state_dict(lm.state_dict())
    tokens = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        whole = lm(tokens)
        torch.testing.assert_close(whole, plain_lm(tokens))
        cache = lm.new_cache()
        steps = [lm(tokens[:, :3], cache=cache)]
        steps += [lm(tokens[:, t : t + 1], cache=cache) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), whole)


def test_head_output_is_attention_output_with_the_mechanism_members():
    from attnkit.efficient import HeadOutput

    out = ak.AttentionOutput(torch.ones(2, 3), torch.zeros(2, 3))
    assert HeadOutput is ak.AttentionOutput
    assert out.representation is out.context
    assert set(out.named_weights()) == {"weights"}
    assert ak.AttentionOutput(torch.ones(2, 3)).named_weights() == {}
    # a part that names its weights reports those names in place of "weights"
    named = ak.AttentionOutput(torch.ones(2, 3), torch.zeros(2, 3), extra={"near": torch.ones(2)})
    assert list(named.named_weights()) == ["near"]
    c, w, s, lp, extra = named  # the fields, in order
    assert (c, w, s, lp) == (named.context, named.weights, None, None) and extra is named.extra
    halved = named.map(lambda t: t[:1])
    assert type(halved) is ak.AttentionOutput and halved.scores is None
    assert halved.context.shape == (1, 3) and halved.extra["near"].shape == (1,)


def test_causal_attention_is_refused_for_parts_without_a_causal_form_or_mask():
    assert "no causal form" in ak.efficient.Linformer(8, 16).refusal(causal=True)
    assert "honours no causal mask" in ak.efficient.LinearAttention(causal=True).refusal(
        causal=True
    )
    assert ak.Attention("scaled_dot", "softmax").refusal(causal=True) is None  # by a causal mask


@pytest.mark.parametrize("name", ["attention", "toy", "minimal", "performer", "gla"])
def test_a_mask_whose_batch_would_line_up_with_the_heads_is_refused(name):
    """A (B, 1, N) padding mask for per-head inputs (B, H, M, d), with B = H: right-aligned,
    its batch would be read as the heads (item 1's padding applied to head 1 of every item);
    it is refused, and the full-rank (B, 1, 1, N) and a (1, 1, N) are taken."""
    part = _build(name)
    q, k, v = _inputs()  # B = H = 2
    pad = ak.masks.from_lengths(torch.tensor([6, 3]), N)  # (B, 1, N)
    assert pad.shape == (2, 1, N)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 6\) has 3 dims .* \(2, 2, 6, 6\)"):
        _call(part, q, k, v, mask=pad)
    full = _call(part, q, k, v, mask=pad[:, None]).context
    short = _call(part, q[1:, :, :3], k[1:, :, :3], v[1:, :, :3]).context
    _assert_rows_equal(full[1:, :, :3], short, f"{name}: (B, 1, 1, N) padding = truncation")
    _call(part, q, k, v, mask=pad[1:])  # (1, 1, N): leading dims of 1 are unambiguous


def test_the_template_keeps_nan_padding_and_empty_rows_out_of_a_minimal_part():
    """MinimalPart multiplies its weights by the mask and nothing more: called through the
    template, NaN in padded keys and values reaches neither the output nor the gradients and a
    query without keys gets 0; its own attend() alone leaks the NaN (what the template adds)."""
    part = MinimalPart()
    q, k, v = _inputs()
    k, v = k.clone(), v.clone()
    k[1, :, 3:], v[1, :, 3:] = float("nan"), float("nan")  # item 1 has 3 keys
    pad = ak.masks.from_lengths(torch.tensor([N, 3]), N)[:, None]  # (B, 1, 1, N)
    q.requires_grad_()
    out = part(q, k, v, mask=pad).context
    assert torch.isfinite(out).all()
    short = part(q[1:, :, :, :].detach(), k[1:, :, :3], v[1:, :, :3]).context
    _assert_rows_equal(out[1:].detach(), short, "NaN padding = truncation")
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    leaked = part.attend(q.detach(), k, v, mask=pad, bias=None, need_weights=False).context
    assert not torch.isfinite(leaked).all()
    full = torch.ones(N, N, dtype=torch.bool)
    full[2] = False  # query 2 attends nothing
    row = part(q.detach(), k[:1], v[:1], mask=full, need_weights=True)
    assert torch.equal(row.context[:, :, 2], torch.zeros_like(row.context[:, :, 2]))


def test_finite_keys_whose_sums_overflow_are_not_taken_for_non_finite():
    """The template finds non-finite keys by a sum first: a value row of finite entries
    ±0.6·max, whose sum overflows, is looked at entry by entry and its rows are not set to NaN;
    a NaN key is still found, and only the rows that attend it are non-finite."""
    part = MinimalPart()
    q, k, v = _inputs()
    q = q * 1e-3  # small weights: w · 0.6·max stays finite
    big = 0.6 * torch.finfo(v.dtype).max
    v = v.clone()
    v[:, :, 2] = torch.tensor([big, big, -big, -big], dtype=v.dtype)[:D].repeat(D // 4 + 1)[:D]
    assert not torch.isfinite(v.sum(-1)).all() and torch.isfinite(v).all()
    causal = ak.masks.causal(N)
    out = part(q, k, v, mask=causal).context
    want = part(q, k, v, mask=causal, finite=True).context  # stated finite: no scan at all
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    k = k.clone()
    k[:, :, 4] = float("nan")  # attended by queries 4 and 5 only
    out = part(q, k, v, mask=causal).context
    assert torch.isfinite(out[:, :, :4]).all() and not torch.isfinite(out[:, :, 4:]).any()


def test_a_part_without_attend_or_forward_says_what_to_implement():
    class Nothing(ak.HeadAttention):
        mask_forms = frozenset({"key"})

    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match="Nothing must implement attend"):
        Nothing()(q, q, q)
    with pytest.raises(ValueError, match="KeyOnlyPart: the mask varies over queries"):
        KeyOnlyPart()(q, q, q, mask=torch.ones(3, 3, dtype=torch.bool).tril())
    # a key mask expanded over the queries is read as its first row
    key = torch.tensor([True, True, False])
    expanded = key.expand(3, 3)
    torch.testing.assert_close(
        KeyOnlyPart()(q, q, q, mask=expanded).context, KeyOnlyPart()(q, q, q, mask=key).context
    )


class StatePart(MinimalPart):
    """MinimalPart keeping the sum of its earlier values in a cache of its own: a mask covers
    the positions in that state and the keys given; attend() sees the mask it is given."""

    takes_cache = True
    seen: ClassVar[list] = []

    def state_positions(self, cache):
        return cache["positions"]

    def attend(self, q, k, v, *, mask, bias, need_weights, cache):
        StatePart.seen.append(mask)
        return super().attend(q, k, v, mask=mask, bias=bias, need_weights=need_weights)


class WholeMaskPart(MinimalPart):
    """MinimalPart declaring key masks only but reading every mask itself (declared_mask)."""

    mask_forms = frozenset({"key"})

    def declared_mask(self, mask, m, who):
        return mask


def test_a_part_keeping_a_state_is_given_the_mask_columns_of_its_keys():
    """A mask over 3 positions in the state and the 2 keys given: validated at that width,
    attend() gets its last 2 columns, and the empty rows and hidden keys follow them."""
    q, k, v = (x[..., :2, :] for x in _inputs())
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 3:] = False  # query 0 attends only positions in the state: no key given
    mask[1, 4] = False  # key 1 is attended by no query: hidden
    StatePart.seen.clear()
    out = StatePart()(q, k, v, mask=mask, need_weights=True, cache={"positions": 3})
    assert torch.equal(StatePart.seen[0], mask[:, 3:])
    want = MinimalPart()(q, k, v, mask=mask[:, 3:], need_weights=True)
    torch.testing.assert_close(out.context, want.context, rtol=0, atol=0)
    assert torch.equal(out.context[:, :, 0], torch.zeros_like(out.context[:, :, 0]))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 2\) does not broadcast .* 5\)"):
        StatePart()(q, k, v, mask=mask[:, 3:], cache={"positions": 3})
    key = torch.tensor([True, False, True, True, True])  # one row: over every query as it is
    StatePart()(q, k, v, mask=key, cache={"positions": 3})
    assert torch.equal(StatePart.seen[-1], key[None, 3:])
    StatePart()(q, k, v, mask=mask[:, 3:], cache={"positions": 0})  # nothing in the state
    assert torch.equal(StatePart.seen[-1], mask[:, 3:])


def test_a_part_may_read_masks_its_own_way():
    """declared_mask is the template's hole for a part that reads masks itself: a causal mask
    reaches WholeMaskPart, which KeyOnlyPart (the template's reading) refuses."""
    q, k, v = _inputs()
    causal = ak.masks.causal(N)
    with pytest.raises(ValueError, match="KeyOnlyPart: the mask varies over queries"):
        KeyOnlyPart()(q, k, v, mask=causal)
    out = WholeMaskPart()(q, k, v, mask=causal).context
    torch.testing.assert_close(out, MinimalPart()(q, k, v, mask=causal).context, rtol=0, atol=0)


class FactsPart(MinimalPart):
    """The minimal part, declaring that its attend takes the caller's facts; it records them."""

    takes_facts = True

    def attend(self, q, k, v, *, mask, bias, need_weights, checked, finite):
        self.seen = (checked, finite, bool(torch.isfinite(k).all() and torch.isfinite(v).all()))
        return super().attend(q, k, v, mask=mask, bias=bias, need_weights=need_weights)


def test_the_facts_reach_attend_only_where_declared_and_finite_holds_when_told():
    q, k, v = _inputs()
    part = FactsPart()
    part(q, k, v)
    assert part.seen == (False, False, True)  # no mask, nothing stated: not known finite
    part(q, k, v, checked=True, finite=True)
    assert part.seen == (True, True, True)
    k = k.clone()
    k[1, :, -2:] = float("nan")  # padding of the second item
    pad = ak.masks.from_lengths(torch.tensor([N, N - 2]), N)[:, None]  # (B, 1, 1, N)
    out = part(q, k, v, mask=pad).context
    assert part.seen == (False, True, True)  # the template cleared the keys: finite, and told
    torch.testing.assert_close(out, MinimalPart()(q, k.nan_to_num(), v, mask=pad).context)
    # a minimal part (no takes_facts) gets neither keyword, whatever the caller says
    out = MinimalPart()(q, k.nan_to_num(), v, mask=pad, checked=True, finite=True).context
    assert torch.isfinite(out).all()
    assert HeadAttention.forward_takes_facts and MinimalPart.forward_takes_facts


def test_a_part_with_its_own_forward_takes_the_facts_only_when_it_declares_them():
    class OwnForward(MinimalPart):
        def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
            return MinimalPart.forward(self, q, k, v, mask=mask, bias=bias)

    class OwnForwardWithFacts(FactsPart):
        def forward(self, q, k, v, *, checked=False, finite=False, **kw):
            self.given = (checked, finite)
            return FactsPart.forward(self, q, k, v, checked=checked, finite=finite, **kw)

    assert not OwnForward.forward_takes_facts and OwnForwardWithFacts.forward_takes_facts
    assert not type("Sub", (OwnForward,), {}).forward_takes_facts  # inherited with forward
    mha = ak.MultiHeadAttention(E, H, attention=OwnForward()).double()
    x = torch.randn(2, N, E, dtype=torch.float64)
    want = ak.MultiHeadAttention(E, H, attention=MinimalPart()).double()
    want.load_state_dict(mha.state_dict())
    torch.testing.assert_close(mha(x).context, want(x).context)  # called without the facts
    facts = ak.MultiHeadAttention(E, H, attention=OwnForwardWithFacts()).double()
    facts(x)
    assert facts.attention.given == (True, False)  # validated at the layer's door; not finite


def test_the_facts_must_be_bools_and_a_checked_call_still_refuses_empty_keys():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match="MinimalPart: checked must be a bool, got 1"):
        MinimalPart()(q, k, v, checked=1)
    with pytest.raises(TypeError, match="MinimalPart: finite must be a bool, got 'yes'"):
        MinimalPart()(q, k, v, finite="yes")
    with pytest.raises(ValueError, match="MinimalPart: the key set is empty"):
        MinimalPart()(q, k[..., :0, :], v[..., :0, :], checked=True)
    # unchecked, the full messages
    with pytest.raises(ValueError, match="MinimalPart: q has 4 features but k has 3"):
        MinimalPart()(q, k[..., :3], v)
    with pytest.raises(TypeError, match="mask must be boolean"):
        MinimalPart()(q, k, v, mask=torch.ones(N, N))
