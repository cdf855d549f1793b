"""What the family shares: the forms agree inside multi-head attention with key padding, the
masks a recurrent state can honour (and the refusal of others), decoding from a constant-size
state through the KV-cache interface, and the unnormalised alignment."""

import pytest
import torch

import attnkit as ak
from attnkit import linear_family as lf
from attnkit.kv_cache import LayerCache

NAMES = ["retention", "gla", "mamba2", "deltanet", "gated_deltanet", "kda", "lightning"]
E, H = 8, 2


def _mha(name, position=None, seed=0, **kw):
    torch.manual_seed(seed)
    part = ak.mechanisms.build(name, head_dim=E // H, num_heads=H, dtype=torch.float64, **kw)
    return ak.MultiHeadAttention(E, H, attention=part, position=position).double().eval()


def _x(b=3, n=10, seed=1):
    return torch.randn(b, n, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_every_part_is_registered_and_a_causal_slot_part():
    from attnkit.tasks import parts

    assert set(NAMES) <= set(parts.slot_mechanisms("attnkit.linear_family"))
    for name in NAMES:
        cls = ak.mechanisms.REGISTRY.get(name)
        assert cls.causal and cls.decodes_with_cache and cls.takes_q_offset and cls.takes_cache


@pytest.mark.parametrize("name", NAMES)
def test_forms_agree_with_random_chunks_and_key_padding(name):
    g = torch.Generator().manual_seed(7)
    x = _x()
    lengths = [10, 7, 3]
    pad = ak.masks.from_lengths(torch.tensor(lengths), 10)
    ref = _mha(name, form="recurrent")(x, mask=pad).context
    for form, chunk in [
        ("parallel", 64),
        *[("chunkwise", int(c)) for c in torch.randint(1, 12, (4,), generator=g)],
    ]:
        out = _mha(name, form=form, chunk_size=chunk)(x, mask=pad).context
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10, msg=f"{form} {chunk}")
    for i, n in enumerate(lengths):  # padding equals truncation
        alone = _mha(name, form="chunkwise", chunk_size=3)(x[i : i + 1, :n]).context
        torch.testing.assert_close(ref[i : i + 1, :n], alone, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("position", [None, "rope"])
def test_decoding_from_the_state_equals_the_causal_pass(name, position):
    mha = _mha(name, position, chunk_size=3)
    x = _x(n=9)
    full = mha(x).context
    cache = lf.RecurrentCache()
    steps = [mha(x[:, :4], cache=cache).context]  # a prompt, then one token at a time
    sizes = []
    for i in range(4, 9):
        steps.append(mha(x[:, i : i + 1], cache=cache).context)
        sizes.append(cache.nbytes)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-10)
    assert len(cache) == 9
    # the state: (B, H, d_k, d_v) float64, whatever the length
    assert cache.state.shape == (3, H, E // H, E // H)
    assert sizes == [3 * H * (E // H) ** 2 * 8] * 5
    # a KV cache of keys and values gives the same (the last rows of the causal sequence)
    kv = LayerCache()
    steps = [mha(x[:, i : i + 1], cache=kv).context for i in range(9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-10)


def test_decoding_skips_a_padded_step_and_zeroes_its_row():
    mha = _mha("gated_deltanet", chunk_size=2)
    x = _x(b=2, n=6)
    cache = lf.RecurrentCache()
    mha(x[:, :3], cache=cache)
    step = ak.masks.from_lengths(torch.tensor([4, 3]), 4)  # item 1: the new token is padding
    out = mha(x[:, 3:4], cache=cache, mask=step).context
    assert (out[1] == mha.out_proj.bias).all()  # row 0 before the output projection
    nxt = mha(x[:, 4:5], cache=cache).context
    # item 1 goes on as if the padded token had not been there
    alone = torch.cat([x[1:, :3], x[1:, 4:5]], 1)
    torch.testing.assert_close(nxt[1:], mha(alone).context[:, -1:], atol=1e-12, rtol=1e-10)


def test_a_decoder_mask_is_honoured_and_a_window_refused():
    mha = _mha("gla")
    x = _x(b=2, n=6)
    pad = ak.masks.from_lengths(torch.tensor([6, 4]), 6)
    causal = ak.masks.causal(6)
    plain = mha(x, mask=pad).context
    for mask in (causal, causal & pad, pad.expand(2, 6, 6), pad & pad.transpose(-1, -2)):
        out = mha(x, mask=mask).context
        torch.testing.assert_close(out[0], plain[0], atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(out[1, :4], plain[1, :4], atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match=r"GatedLinearAttention: the mask .* varies over queries"):
        mha(x, mask=ak.masks.window(6, 6, 2))


def test_the_door_refuses_what_a_state_cannot_do():
    part = ak.mechanisms.build("deltanet", head_dim=4, num_heads=2)
    q = torch.randn(1, 2, 5, 4)
    with pytest.raises(ValueError, match="bias"):
        part(q, q, q, bias=torch.zeros(5, 5))
    with pytest.raises(ValueError, match="causal self-attention: the 3 queries"):
        part(q[..., :3, :], q, q)
    with pytest.raises(ValueError, match=r"parameters for 2 heads of size 4"):
        part(torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4))
    with pytest.raises(ValueError, match="form must be one of chunkwise, parallel, recurrent"):
        ak.mechanisms.build("gla", head_dim=4, num_heads=2, form="scan")
    with pytest.raises(ValueError, match="need_weights must be False"):
        part(q, q, q, need_weights=True, cache=lf.RecurrentCache())
    with pytest.raises(ValueError, match="q_offset 2 is not the 0 positions"):
        part(q, q, q, q_offset=2, cache=lf.RecurrentCache())
    with pytest.raises(TypeError, match="cache must be a LayerCache or None, got dict"):
        part(q, q, q, cache={})


def test_a_recurrent_cache_belongs_to_one_part_and_one_batch_when_called_directly():
    """Parts called without a layer: a second part may not continue the first part's state,
    nor a step of another batch size; the first part's own next step is taken."""
    torch.manual_seed(0)
    first, second = (ak.mechanisms.build("gla", head_dim=4, num_heads=2) for _ in range(2))
    q = torch.randn(1, 2, 3, 4)
    cache = lf.RecurrentCache()
    first(q, q, q, cache=cache)
    with pytest.raises(ValueError, match="holds the state of another part, not of GatedLinear"):
        second(q[..., :1, :], q[..., :1, :], q[..., :1, :], q_offset=3, cache=cache)
    wider = torch.randn(2, 2, 1, 4)
    with pytest.raises(ValueError, match=r"a state for inputs .* = \(1, 2\), .* \(2, 2\)"):
        first(wider, wider, wider, q_offset=3, cache=cache)
    assert len(cache) == 3  # neither refused step moved it
    step = q[..., :1, :]
    first(step, step, step, q_offset=3, cache=cache)
    assert len(cache) == 4


def test_a_recurrent_cache_is_refused_by_a_part_that_does_not_read_it():
    mha = ak.MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match=r"RecurrentCache holds the state .* holds Attention"):
        mha(torch.randn(1, 1, E), cache=lf.RecurrentCache())


def test_a_decoder_stack_decodes_with_one_recurrent_cache_per_layer():
    torch.manual_seed(0)
    part = lf.GatedDeltaNet(8, 2, chunk_size=2)
    decoder = ak.TransformerDecoder(2, 16, 2, cross_attention=False, attention=part)
    decoder = decoder.double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    full = decoder(x)
    cache = lf.recurrent_cache(2)
    assert len(cache) == 2 and all(isinstance(c, lf.RecurrentCache) for c in cache.layers)
    steps = [decoder(x[:, :3], cache=cache)]
    steps += [decoder(x[:, i : i + 1], cache=cache) for i in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-12, rtol=1e-10)
    assert cache.length == 7 and cache.nbytes == 2 * (2 * 2 * 8 * 8 * 8)  # two layers' states


@pytest.mark.parametrize("name", NAMES)
def test_weights_give_the_context_before_the_head_norm_and_only_the_causal_triangle(name):
    torch.manual_seed(0)
    kw = {"group_norm": False} if name == "retention" else {}
    part = ak.mechanisms.build(name, head_dim=4, num_heads=2, dtype=torch.float64, **kw)
    q, k, v = (torch.randn(2, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    pad = ak.masks.from_lengths(torch.tensor([6, 4]), 6)[:, None]  # (B, 1, 1, N)
    out = part(q, k, v, mask=pad, need_weights=True)
    w = out.weights
    assert (w.triu(1) == 0).all() and (w[1, :, :, 4:] == 0).all() and (w[1, :, 4:] == 0).all()
    vz = torch.where(pad.transpose(-1, -2), v, 0)
    torch.testing.assert_close(w @ vz, out.context, atol=1e-12, rtol=1e-10)
    with ak.evaluation.capture(part) as records:
        part(q, k, v, mask=pad)
    torch.testing.assert_close(next(iter(records.values()))[0], w)


def test_the_alignment_keeps_the_scores_where_allowed():
    s = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    mask = torch.tensor([[True, False], [True, True]])
    torch.testing.assert_close(lf.UnnormalizedWeights()(s, mask).weights, s * mask)
    assert lf.UnnormalizedWeights()(s).weights is s and not lf.UnnormalizedWeights.normalized


def test_a_recurrent_cache_reads_the_part_and_refuses_one_that_does_not_declare_decoding():
    class StateWithoutDecoding(ak.HeadAttention):  # reads a cache, does not claim a step is exact
        mask_forms = frozenset({"key"})
        takes_cache = True

    mha = ak.MultiHeadAttention(E, H, attention=StateWithoutDecoding())
    cache = lf.RecurrentCache()
    with pytest.raises(
        ValueError,
        match=r"^RecurrentCache of MultiHeadAttention: attention part StateWithoutDecoding does "
        r"not declare decodes_with_cache = True",
    ):
        cache.claim(mha)
    with pytest.raises(ValueError, match="holds no attention part that does not declare takes_c"):
        cache.claim(torch.nn.Module())
    _mha("retention")(_x(1, 2), cache=cache)  # the refused layers did not claim it
    assert len(cache) == 2


def test_a_capture_while_decoding_from_the_state_records_only_the_steps_with_keys():
    """Under a capture the template asks every part for its weights: a step from a
    RecurrentCache has none (its keys are gone), runs unchanged and reports nothing, while a
    call given its keys reports its weights."""
    torch.manual_seed(0)
    part = ak.mechanisms.build("gla", head_dim=4, num_heads=2, dtype=torch.float64)
    q, k, v = (torch.randn(1, 2, 4, 4, dtype=torch.float64) for _ in range(3))
    full = part(q, k, v).context
    with ak.evaluation.capture(part) as records:
        part(q, k, v)
    assert [w.shape for w in next(iter(records.values()))] == [(1, 2, 4, 4)]
    cache = lf.RecurrentCache()
    with ak.evaluation.capture(part) as records:
        first = part(q[..., :3, :], k[..., :3, :], v[..., :3, :], cache=cache)
        second = part(q[..., 3:, :], k[..., 3:, :], v[..., 3:, :], q_offset=3, cache=cache)
    assert not any(records.values()) and first.weights is None and second.weights is None
    torch.testing.assert_close(torch.cat([first.context, second.context], -2), full)
