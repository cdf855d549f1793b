"""Contract tests: every registered score × every registered alignment (DESIGN 4), and the
properties of SPEC 8 for the general attention module."""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from registered_parts import ALIGNMENTS, SCORES, Dims, build_attention, inputs

import attnkit as ak

PAIRS = list(itertools.product(SCORES, ALIGNMENTS))
DIMS = Dims()


def pairs_where(predicate) -> list[tuple[str, str]]:
    """The (score, alignment) pairs whose built modules satisfy ``predicate(score, align)``:
    properties that a capability rules out are not asserted for it."""
    out = []
    for s, a in PAIRS:
        att = build_attention(s, a)
        if predicate(att.score, att.align):
            out.append((s, a))
    return out


# Masking == removing holds unless the score mixes neighbouring keys' content (convolutional).
UNMIXED = pairs_where(lambda s, a: not s.mixes_keys)
# Permutation identities hold unless the alignment looks at positions (local).
UNPOSITIONED = pairs_where(lambda s, a: not a.position_based)
# Straight-through estimators are by design not the true gradient: gradcheck does not apply.
TRUE_GRADIENT = pairs_where(lambda s, a: not getattr(a, "straight_through", False))


def _rows_with_keys_sum_to_one(w: torch.Tensor, multi: bool) -> torch.Tensor:
    return w.sum(dim=-2 if multi else -1)


@pytest.mark.parametrize(("score", "align"), PAIRS)
def test_shapes_and_simplex(score, align):
    att = build_attention(score, align)
    q, k, v = inputs()
    out = att(q, k, v, need_weights=True)
    multi = att.score.multi_dimensional
    assert out.context.shape == (2, 3, DIMS.d_v)
    expected = (2, 3, 5, DIMS.d_v) if multi else (2, 3, 5)
    assert out.weights.shape == expected
    assert out.scores.shape == expected
    assert torch.isfinite(out.context).all()
    assert (out.weights >= 0).all()
    if att.align.normalized:
        total = _rows_with_keys_sum_to_one(out.weights, multi)
        torch.testing.assert_close(total, torch.ones_like(total))
    if att.align.stochastic:
        assert out.log_prob is not None
        assert out.log_prob.shape == ((2, 3, DIMS.d_v) if multi else (2, 3))
    # The context is the weighted sum of the values (eq. 4 / eq. 30).
    if multi:
        ref = torch.einsum("bmnd,bnd->bmd", out.weights, v)
    else:
        ref = out.weights @ v
    torch.testing.assert_close(out.context, ref)
    if att.align.normalized and not multi:
        # Convex hull: each context coordinate lies between the values' min and max.
        lo, hi = v.min(dim=1, keepdim=True).values, v.max(dim=1, keepdim=True).values
        assert (out.context >= lo - 1e-12).all() and (out.context <= hi + 1e-12).all()


@pytest.mark.parametrize(("score", "align"), UNMIXED)
def test_masking_a_key_equals_removing_it(score, align):
    att = build_attention(score, align)
    q, k, v = inputs(n=6)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    mask[:, :, -1] = False
    masked = att(q, k, v, mask=mask, need_weights=True)
    removed = att(q, k[:, :-1], v[:, :-1], need_weights=True)
    torch.testing.assert_close(masked.context, removed.context)
    torch.testing.assert_close(masked.weights[:, :, :-1], removed.weights)
    assert (masked.weights[:, :, -1] == 0).all()


@pytest.mark.parametrize(("score", "align"), UNPOSITIONED)
def test_permutations(score, align):
    """Attention(AQ, BK, BV) = A·Attention(Q, K, V) for permutations A, B (SPEC 8)."""
    att = build_attention(score, align)
    q, k, v = inputs(m=4, n=5)
    base = att(q, k, v).context
    a, b = torch.randperm(4), torch.randperm(5)
    if att.score.content_based:
        torch.testing.assert_close(att(q[:, a], k[:, b], v[:, b]).context, base[:, a])
    torch.testing.assert_close(att(q[:, a], k, v).context, base[:, a])


@pytest.mark.parametrize(("score", "align"), PAIRS)
def test_batch_equals_items(score, align):
    att = build_attention(score, align)
    q, k, v = inputs(b=3)
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [False] + [True] * 4])[:, None]
    batched = att(q, k, v, mask=mask).context
    for i in range(3):
        one = att(q[i : i + 1], k[i : i + 1], v[i : i + 1], mask=mask[i : i + 1]).context
        torch.testing.assert_close(batched[i : i + 1], one)


@pytest.mark.parametrize(("score", "align"), TRUE_GRADIENT)
def test_gradcheck(score, align):
    att = build_attention(score, align)
    q, k, v = inputs(b=1, m=2, n=4, requires_grad=True)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    assert torch.autograd.gradcheck(
        lambda q, k, v: att(q, k, v, mask=mask).context, (q, k, v), atol=1e-6
    )


@pytest.mark.parametrize(("score", "align"), PAIRS)
def test_fully_masked_rows_give_zeros(score, align):
    att = build_attention(score, align).train()
    q, k, v = inputs(requires_grad=True)
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[0, 1] = False
    out = att(q, k, v, mask=mask, need_weights=True)
    assert torch.isfinite(out.context).all()
    assert (out.context[0, 1] == 0).all()
    assert (out.weights[0, 1] == 0).all()
    if out.log_prob is not None:
        assert torch.isfinite(out.log_prob).all()
    loss = out.context.sum() + (0 if out.log_prob is None else out.log_prob.sum())
    loss.backward()
    assert v.grad is not None
    for x in (q, k, v):
        # q (query-free scores) and k (location scores) may not be used at all.
        assert x.grad is None or torch.isfinite(x.grad).all()


@pytest.mark.parametrize(("score", "align"), PAIRS)
def test_huge_logits_stay_finite(score, align):
    att = build_attention(score, align, dtype=torch.float32)
    q, k, v = inputs(dtype=torch.float32, requires_grad=True)
    out = att(q * 100, k * 100, v, need_weights=True)
    assert torch.isfinite(out.context).all()
    out.context.sum().backward()
    assert v.grad is not None
    for x in (q, k, v):
        assert x.grad is None or torch.isfinite(x.grad).all()


@pytest.mark.parametrize(("score", "align"), PAIRS)
def test_bfloat16_forward(score, align):
    att = build_attention(score, align, dtype=torch.bfloat16)
    q, k, v = inputs(dtype=torch.bfloat16)
    out = att(q, k, v)
    assert out.context.dtype == torch.bfloat16
    assert torch.isfinite(out.context.float()).all()


@pytest.mark.parametrize("score", list(SCORES))
def test_training_mode_runs_for_stochastic_alignments(score):
    for align in ("hard", "reinforced"):
        att = build_attention(score, align).train()
        q, k, v = inputs(requires_grad=True)
        out = att(q, k, v, need_weights=True)
        assert out.log_prob is not None and torch.isfinite(out.log_prob).all()
        (out.context.sum() + out.log_prob.sum()).backward()


# ---- SPEC 8 properties through the functional core ------------------------------------------


def test_v_defaults_to_k():
    q, k, _ = inputs()
    torch.testing.assert_close(ak.attention(q, k).context, ak.attention(q, k, k).context)


@pytest.mark.parametrize("align", ["softmax", "sparsemax", "entmax15", "sigmoid"])
def test_causal_mask_and_receptive_field(align):
    torch.manual_seed(0)
    n, d = 6, 4
    x = torch.randn(2, n, d, dtype=torch.float64, requires_grad=True)
    mask = ak.masks.causal(n)
    out = ak.attention(x, x, x, align=align, mask=mask, need_weights=True)
    assert (out.weights.triu(diagonal=1) == 0).all()
    if align != "sigmoid":
        # Row 1 attends only to key 1: it equals value row 1.
        torch.testing.assert_close(out.context[:, 0], x[:, 0])
    for i in range(n):
        (g,) = torch.autograd.grad(out.context[:, i].sum(), x, retain_graph=True)
        assert (g[:, i + 1 :] == 0).all(), f"output {i} depends on later positions"


def test_self_attention_is_permutation_equivariant():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 4, dtype=torch.float64)
    p = torch.randperm(7)
    torch.testing.assert_close(
        ak.attention(x[:, p], x[:, p], x[:, p]).context, ak.attention(x, x, x).context[:, p]
    )


def test_bias_is_added_to_scores():
    q, k, v = inputs()
    bias = torch.randn(3, 5, dtype=torch.float64)
    out = ak.attention(q, k, v, bias=bias, need_weights=True)
    plain = ak.attention(q, k, v, need_weights=True)
    torch.testing.assert_close(out.scores, plain.scores + bias)
    # SDPA path (no weights requested) agrees with the dense path.
    torch.testing.assert_close(ak.attention(q, k, v, bias=bias).context, out.context)


def test_query_free_score_accepts_no_query():
    torch.manual_seed(0)
    att = ak.Attention(ak.scores.Additive(None, 4, 6)).double()
    _, k, v = inputs()
    out = att(None, k, v, need_weights=True)
    assert out.context.shape == (2, 1, 3)
    q, _, _ = inputs()
    with_q = att(q, k, v).context
    torch.testing.assert_close(with_q, out.context.expand(2, 3, 3))


def test_multi_dimensional_assertion():
    with pytest.raises(ValueError, match="multi_dimensional"):
        ak.Attention(ak.scores.Additive(4, 4, 6), multi_dimensional=True)
    ak.Attention(ak.scores.Additive(4, 4, 6, d_out=3), multi_dimensional=True)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    att = ak.Attention("dot", dropout=0.5)
    q, k, v = inputs()
    att.eval()
    torch.testing.assert_close(att(q, k, v).context, ak.attention(q, k, v, score="dot").context)
    att.train()
    assert not torch.allclose(att(q, k, v).context, ak.attention(q, k, v, score="dot").context)


def test_a_mostly_empty_dense_mask_runs_block_sparse_and_equals_the_dense_result():
    from attnkit.kernels import chunked

    n = 1100  # 9 tiles of 128 a side, the last one ragged
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    mask = ak.masks.window(n, n, 50)
    mask[7] = False  # a row with no key
    mask[:, 3] = False
    with torch.no_grad():
        v[:, :, 3] = float("nan")  # a key no query may attend: no influence
    r = torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64)
    with mock.patch.object(chunked, "attend", wraps=chunked.attend) as spy:
        out = ak.attention(q, k, v, mask=mask).context
        assert spy.call_count == 1 and spy.call_args.kwargs["block_mask"] is not None
        assert spy.call_args.kwargs["mask"] is None  # the mask's tiles are read from it
        ak.attention(q, k, v, mask=mask, need_weights=True)  # weights: the dense kernel
        assert spy.call_count == 1
    ref = ak.attention(q, k, v, mask=mask, kernel="dense").context
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref)
    assert torch.equal(out[:, :, 7], torch.zeros_like(out[:, :, 7]))
    grads = torch.autograd.grad((out * r).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * r).sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)


def _softmax_reference(q, k, v, allowed):
    """Scaled-dot softmax attention row by row over the allowed keys only (eqs. 2-4)."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for idx in itertools.product(*(range(s) for s in q.shape[:-1])):
        *lead, m = idx
        keys = allowed[(*lead, m)].nonzero().flatten()
        e = k[(*lead, keys)] @ q[idx] / q.shape[-1] ** 0.5
        out[idx] = torch.softmax(e, -1) @ v[(*lead, keys)]
    return out


def test_key_padding_excludes_the_masked_keys_by_construction():
    """A mask the same for every query: masked keys and values become zeros in the call (no look
    at their content), the kernels are told so, and NaN there reaches nothing."""
    from attnkit.core import prepare_call

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k[1, :, 4:] = float("nan")
    v[1, :, 4:] = float("inf")
    mask = ak.masks.from_lengths(torch.tensor([6, 4]), 6)[:, None]  # (B, 1, 1, N)
    call = prepare_call(q, k, v, mask=mask)
    assert call.masked_finite
    assert (call.k[1, :, 4:] == 0).all() and (call.v[1, :, 4:] == 0).all()
    torch.testing.assert_close(call.k[0], k[0])
    assert ak.kernels.explain(call).chosen == "sdpa"
    want = _softmax_reference(q, k, v, mask.expand(2, 3, 6, 6))
    torch.testing.assert_close(ak.attention(q, k, v, mask=mask).context, want)
    dense = ak.attention(q, k, v, mask=mask, kernel="dense").context
    torch.testing.assert_close(dense, want)


def test_the_scores_at_masked_positions_are_returned_as_they_are():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = ak.masks.from_lengths(torch.tensor([5, 2]), 5)
    out = ak.attention(q, k, v, mask=mask, need_weights=True)
    torch.testing.assert_close(out.scores, q @ k.transpose(-1, -2) / 2.0)


def test_a_per_query_mask_over_non_finite_keys_is_guarded_by_the_kernel():
    """A causal mask hides a later NaN key from the earlier queries only: the call cannot clear
    it, so SDPA (which would let it through) is passed over and the rows stay exact."""
    from attnkit.core import prepare_call

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k[0, 4], v[0, 3] = float("nan"), float("inf")
    causal = ak.masks.causal(5)
    call = prepare_call(q, k, v, mask=causal)
    assert not call.masked_finite
    assert "not finite" in " ".join(ak.kernels.explain(call).why_not("sdpa"))
    out = ak.attention(q, k, v, mask=causal).context
    want = _softmax_reference(q[:, :3], k, v, causal[:3].expand(1, 3, 5))
    torch.testing.assert_close(out[:, :3], want)  # rows that cannot see the non-finite keys
    assert not torch.isfinite(out[:, 3:]).any()  # rows that see them: not finite, as unmasked
    clean = prepare_call(q, k.nan_to_num(), v.nan_to_num(posinf=0.0), mask=causal)
    assert clean.masked_finite  # looked at once: finite, the kernels need not look again


def test_inputs_stated_finite_are_neither_looked_at_nor_cleared(monkeypatch):
    from attnkit.core import prepare_call

    q, k, v = (torch.randn(2, 5, 4) for _ in range(3))
    mask = ak.masks.from_lengths(torch.tensor([5, 2]), 5)
    looked = []
    isfinite = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda x: looked.append(x.shape) or isfinite(x))
    call = prepare_call(q, k, v, mask=mask & ak.masks.causal(5), finite=True)
    out = ak.Attention()(q, k, v, mask=mask, finite=True).context
    assert call.masked_finite and call.k is k and call.v is v
    assert looked == []
    torch.testing.assert_close(out, _softmax_reference(q, k, v, mask.expand(2, 5, 5)))
