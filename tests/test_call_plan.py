"""A layer's plan per kind of call (attnkit.call_plan): resolved once, checked by size after, equal
to the general path, dropped when the layer changes, and stepping aside when it cannot be sure."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

import attnkit as ak
from attnkit import call_plan, checks, head, kernels
from attnkit.kernels import dense

E, H = 12, 3


def _twin(layer: ak.MultiHeadAttention, **kw) -> ak.MultiHeadAttention:
    """The same layer evaluated by the dense kernel (a reference independent of SDPA)."""
    ref = ak.MultiHeadAttention(E, H, kernel="dense", num_kv_heads=layer.num_kv_heads, **kw).to(
        next(layer.parameters()).dtype
    )
    ref.load_state_dict(layer.state_dict())
    return ref


def test_the_first_call_of_a_kind_is_validated_in_full_and_later_ones_by_size():
    mha = ak.MultiHeadAttention(E, H)
    x = torch.randn(2, 5, E)
    with mock.patch.object(checks, "part_matches", wraps=checks.part_matches) as walk:
        mha(x)
        assert walk.call_count == 1 and len(mha._plans) == 1
        mha(torch.randn(3, 7, E))  # same kind, other sizes: no second walk
        assert walk.call_count == 1 and len(mha._plans) == 1
        mha(x, mask=ak.masks.causal(5))  # a new kind: validated, planned
        assert walk.call_count == 2 and len(mha._plans) == 2
    # a planned kind still refuses bad sizes, with the full check's message
    with pytest.raises(ValueError, match="query has 11 features"):
        mha(torch.randn(2, 5, 11))
    with pytest.raises(ValueError, match=r"mask of shape \(6, 6\) does not broadcast"):
        mha(x, mask=ak.masks.causal(6))
    with pytest.raises(ValueError, match="N = 0"):
        mha(x, torch.randn(2, 0, E))


def test_sizes_the_quick_check_cannot_confirm_are_validated_in_full():
    mha = ak.MultiHeadAttention(E, H)
    q, kv = torch.randn(2, 4, E), torch.randn(2, 6, E)
    mha(q, kv, kv)
    # key batch 1 broadcasts over the query batch: valid, left to the full checks
    assert not call_plan.fits(mha, q, kv[:1], kv[:1], None, None, 0)
    torch.testing.assert_close(
        mha(q, kv[:1], kv[:1]).context,
        mha(q, kv[:1].expand(2, 6, E), kv[:1].expand(2, 6, E)).context,
    )
    with pytest.raises(ValueError, match="do not broadcast"):
        mha(q, torch.randn(3, 6, E), torch.randn(3, 6, E))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [H, 1])
def test_planned_calls_equal_the_dense_kernel_under_stress(dtype, kv_heads):
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(E, H, num_kv_heads=kv_heads).to(dtype)
    ref = _twin(mha)
    b, n = 3, 37
    x = torch.randn(b, n, E, dtype=dtype)
    x[0] += 1e4 * torch.randn(n, 1, dtype=dtype)  # large row offsets
    lengths = torch.tensor([n, 20, 1])
    pad = ak.masks.from_lengths(lengths, n)  # (B, 1, N)
    x[1, 20:] = float("nan")  # padding content reaches nothing
    causal = ak.masks.causal(n) & pad
    bias = torch.randn(b, 1, n, dtype=dtype)
    tol = {"atol": 1e-9, "rtol": 1e-9} if dtype == torch.float64 else {"atol": 3e-2, "rtol": 3e-2}
    for kw in ({"mask": pad}, {"mask": causal}, {"mask": pad, "bias": bias}):
        for _ in range(2):  # the first call plans the kind, the second uses the plan
            got = mha(x, **kw).context
        want = ref(x, **kw).context
        rows = lengths.view(-1, 1) > torch.arange(n)  # query rows of real tokens
        torch.testing.assert_close(got[rows], want[rows], **tol)
        assert torch.isfinite(got[rows]).all()
    # a row with no key allowed gives 0, as everywhere in attnkit
    none = torch.zeros(b, 1, n, dtype=torch.bool)
    none[1:] = True
    out = mha(x.nan_to_num(), mask=none).context
    out = mha(x.nan_to_num(), mask=none).context
    want = ref(x.nan_to_num(), mask=none).context
    torch.testing.assert_close(out, want, **tol)


def test_planned_gradients_equal_the_dense_kernel():
    torch.manual_seed(1)
    mha = ak.MultiHeadAttention(E, H, position="rope").double()
    ref = _twin(mha, position="rope")
    x = torch.randn(2, 9, E, dtype=torch.float64, requires_grad=True)
    mask = ak.masks.causal(9)
    mha(x, mask=mask)
    grads = []
    for layer in (mha, ref):
        out = layer(x, mask=mask).context
        grads.append(torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_planned_decoding_equals_the_causal_pass():
    torch.manual_seed(2)
    mha = ak.MultiHeadAttention(E, H, num_kv_heads=1, position="rope", gate="elementwise").double()
    x = torch.randn(2, 8, E, dtype=torch.float64)
    want = mha(x, mask=ak.masks.causal(8)).context
    cache = ak.kv_cache.LayerCache()
    steps = [mha(x[:, :3], mask=ak.masks.causal(3), cache=cache).context]
    steps += [mha(x[:, i : i + 1], cache=cache).context for i in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, 1), want)
    assert len(mha._plans) == 3  # the whole pass, the prefill and the step: three kinds


def test_a_plan_is_dropped_when_the_layer_changes_and_not_copied():
    mha = ak.MultiHeadAttention(E, H)
    x = torch.randn(2, 5, E)
    mha(x)
    assert len(copy.deepcopy(mha)._plans) == 0
    mha.double()
    assert len(mha._plans) == 0
    with pytest.raises(TypeError, match="float64"):
        mha(x)  # float32 input now refused by the full check, named
    mha(x.double())
    mha.attention = ak.Attention("scaled_dot", "sparsemax")
    assert len(mha._plans) == 0
    out = mha(x.double(), need_weights=True)
    assert (out.weights == 0).any()  # sparsemax, not the old plan's softmax


def test_the_direct_route_steps_aside_for_listeners_and_a_kernel_tried_first():
    mha = ak.MultiHeadAttention(E, H)
    x = torch.randn(2, 5, E)
    mha(x)
    with ak.hooks.listen() as reports:
        mha(x)
    assert len(reports) == 1 and reports[0].weights.shape == (2, H, 5, 5)

    used = []

    class First(dense.Dense):
        name = "first_for_test"
        priority = 1000

        def attend(self, call):
            used.append(1)
            return super().attend(call)

    saved = kernels.REGISTRY.snapshot()
    try:
        kernels.register(First)
        mha(x)
        assert used, "a kernel registered after the plan was made is tried first"
    finally:
        kernels.REGISTRY.restore(saved)
    used.clear()
    mha(x)
    assert not used


class _PerHeadScale(ak.qk_chain.QKTransform):
    """Scales each head's keys by its own factor: not the same for every head."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, heads).view(heads, 1, 1))

    def forward(self, q, k):
        return q, k * self.scale


@pytest.mark.parametrize("alike", [True, False])
def test_grouped_keys_are_placed_per_head_unless_every_head_is_alike(alike):
    """A grouped-query layer places each key head once only when its chain and scheme declare
    ``same_for_every_head``; a per-head step sees the keys per query head. Either way cached
    decoding equals the causal pass, and the whole pass equals the dense kernel."""
    torch.manual_seed(3)
    heads, kv_heads, d = 4, 2, 6
    step = ak.qk_chain.HeadNorm(d) if alike else _PerHeadScale(heads)
    mha = ak.MultiHeadAttention(
        24, heads, num_kv_heads=kv_heads, position="rope", qk=[step, "position"]
    ).double()
    with torch.no_grad():
        for p in step.parameters():
            p.copy_(torch.linspace(0.5, 2.0, p.numel()).view_as(p))
    ref = ak.MultiHeadAttention(
        24, heads, num_kv_heads=kv_heads, position="rope", qk=[step, "position"], kernel="dense"
    ).double()
    ref.load_state_dict(mha.state_dict())
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    mask = ak.masks.causal(7)
    want = ref(x, mask=mask).context
    mha(x, mask=mask)
    torch.testing.assert_close(mha(x, mask=mask).context, want)
    assert next(iter(mha._plans.values())).heads_alike is alike
    cache = ak.kv_cache.LayerCache()
    steps = [mha(x[:, :2], mask=ak.masks.causal(2), cache=cache).context]
    steps += [mha(x[:, i : i + 1], cache=cache).context for i in range(2, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), want)


class _ReluPart(ak.HeadAttention):
    """A minimal per-head part on the template (ReLU weights): no care for padding of its own."""

    causal_form = True
    accepts_bias = True
    mask_forms = frozenset({"key", "padding", "causal", "full"})

    def attend(self, q, k, v, *, mask, bias, need_weights):
        w = torch.relu(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5)
        if mask is not None:
            w = w * mask
        return ak.AttentionOutput(w @ v, w)


def _keywords_of_part_calls(layer: ak.MultiHeadAttention) -> list[dict]:
    seen: list[dict] = []
    layer.attention.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True
    )
    return seen


@pytest.mark.parametrize("part", ["attention", "relu"])
def test_a_layer_calls_its_part_with_the_facts_of_its_plan(part):
    attention = _ReluPart() if part == "relu" else None
    kw = {} if attention is None else {"attention": attention}
    mha = ak.MultiHeadAttention(E, H, **kw)
    seen = _keywords_of_part_calls(mha)
    x = torch.randn(2, 5, E)
    for _ in range(2):  # validated at the door, then planned
        mha(x, need_weights=True)  # (weights: the part is called, not the direct route)
    assert [(s["checked"], s["finite"]) for s in seen] == [(True, False)] * 2
    kind = next(iter(mha._plans))
    assert mha._plans[kind].facts == call_plan.part_facts(mha) == {"checked": True, "finite": False}
    mha.inputs_finite = True  # the callers' statement: the plans resolved before are dropped
    assert not mha._plans
    mha(x, need_weights=True)
    assert (seen[-1]["checked"], seen[-1]["finite"]) == (True, True)
    assert next(iter(mha._plans.values())).finite
    with pytest.raises(TypeError, match=r"MultiHeadAttention\.inputs_finite must be a bool, got 1"):
        mha.inputs_finite = 1


@pytest.mark.parametrize("part", ["attention", "attention+weights", "relu"])
def test_nan_in_padded_keys_reaches_nothing_through_a_layers_checked_call(part):
    """The layer's call says checked, not finite: the part still clears masked keys, so NaN
    padding of the keys and values changes no output and no gradient (each item equals itself
    alone)."""
    torch.manual_seed(0)
    kw = {"attention": _ReluPart()} if part == "relu" else {}
    mha = ak.MultiHeadAttention(E, H, **kw).double()
    need_weights = part == "attention+weights"
    lengths = [6, 4]
    query = torch.randn(2, 3, E, dtype=torch.float64)
    memory = torch.randn(2, 6, E, dtype=torch.float64)
    memory[1, 4:] = float("nan")
    memory.requires_grad_()
    mask = ak.masks.from_lengths(torch.tensor(lengths), 6)  # (B, 1, N)
    outs = [mha(query, memory, mask=mask, need_weights=need_weights).context for _ in range(2)]
    torch.testing.assert_close(outs[0], outs[1])  # validated, then planned
    out = outs[1]
    assert torch.isfinite(out).all()
    for i, n in enumerate(lengths):
        alone = mha(query[i : i + 1], memory[i : i + 1, :n].detach()).context
        torch.testing.assert_close(out[i : i + 1], alone)
    out.sum().backward()
    assert torch.isfinite(memory.grad[:, :4]).all() and (memory.grad[1, 4:] == 0).all()


def test_a_planned_checked_call_still_gives_the_full_validation_messages():
    mha = ak.MultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    mha(x, bias=torch.zeros(5, 5))
    mha(x)  # both kinds planned
    with pytest.raises(TypeError, match=r"bias has dtype torch\.float64 but query has"):
        mha(x, bias=torch.zeros(5, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"query has 7 features \(shape \(2, 5, 7\)\) but this"):
        mha(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match=r"bias of shape \(4, 5\) does not broadcast to"):
        mha(x, bias=torch.zeros(4, 5))
    # what the layer cannot know about its part is still checked inside the checked call
    other = ak.MultiHeadAttention(8, 2, score=ak.scores.Location(4, 8, num_heads=3))
    with pytest.raises(ValueError, match="num_heads=3"):
        other(x)
    part = ak.Attention(ak.scores.Location(4, 8, num_heads=3), "softmax")
    q = torch.randn(1, 2, 5, 4)  # two heads
    with pytest.raises(ValueError, match="num_heads=3"):
        part(q, q, q, checked=True)


def test_no_ambient_trust_switch_remains():
    """What a layer knows is passed as keywords: no module keeps it in a context variable (the
    only ones left hold hook listeners), and nothing asks for an ambient trust."""
    import re
    from pathlib import Path

    root = Path(ak.__file__).parent
    holders = {
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"\bContextVar\b", p.read_text(encoding="utf-8"))
    }
    assert holders <= {"hooks.py", "hook_points.py"}, holders
    for p in root.rglob("*.py"):
        text = p.read_text(encoding="utf-8")
        assert not re.search(r"\b(is_trusted|trusted)\(", text), p


class _Counts:
    """Counters on the validation helpers and on every torch.isfinite call (its input shape)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.mask_checks = 0
        self.validations = 0
        self.head_checks = 0
        self.finite_scans: list[tuple[int, ...]] = []
        mask_check, validate, isfinite = ak.masks.check, checks.validate, torch.isfinite
        check_head_inputs = head.check_head_inputs

        def counted_mask_check(*args, **kwargs):
            self.mask_checks += 1
            return mask_check(*args, **kwargs)

        def counted_validate(*args, **kwargs):
            self.validations += 1
            return validate(*args, **kwargs)

        def counted_head_check(*args, **kwargs):
            self.head_checks += 1
            return check_head_inputs(*args, **kwargs)

        def counted_isfinite(x):
            self.finite_scans.append(tuple(x.shape))
            return isfinite(x)

        monkeypatch.setattr(ak.masks, "check", counted_mask_check)
        monkeypatch.setattr(checks, "validate", counted_validate)
        monkeypatch.setattr(head, "check_head_inputs", counted_head_check)
        monkeypatch.setattr(torch, "isfinite", counted_isfinite)

    def reset(self) -> None:
        self.mask_checks = self.validations = self.head_checks = 0
        self.finite_scans.clear()


def _padded_reference(mha, x, lengths):
    """Each item alone, truncated to its length (the per-head part sees only real keys)."""
    return [mha(x[i : i + 1, :n]).context for i, n in enumerate(lengths)]


def test_a_masked_multi_head_call_validates_its_mask_and_inputs_once(monkeypatch):
    mha = ak.MultiHeadAttention(8, 2).eval()
    lengths = [5, 3]
    x = torch.randn(2, 5, 8)
    x[1, 3:] = float("nan")  # padding content: reaches nothing, is not looked for
    mask = ak.masks.from_lengths(torch.tensor(lengths), 5)
    counts = _Counts(monkeypatch)
    out = mha(x, mask=mask).context
    assert counts.mask_checks == 1  # at the layer's door, not again in the per-head call
    assert counts.validations == 0  # the per-head call is not validated a second time
    assert counts.finite_scans == []  # masked keys are excluded by construction
    for i, (want, n) in enumerate(zip(_padded_reference(mha, x, lengths), lengths, strict=True)):
        torch.testing.assert_close(out[i : i + 1, :n], want)


def test_a_padded_decoding_step_scans_no_cache(monkeypatch):
    """A step of batched decoding with key padding over a KV cache: the mask is checked once per
    layer call and no key or value of the cache is looked at for non-finite content."""
    torch.manual_seed(0)
    mha = ak.MultiHeadAttention(8, 2).eval()
    lengths, n = [6, 4], 6
    x = torch.randn(2, n + 1, 8)
    x[1, lengths[1] : n] = float("inf")  # the second row's padding, inside the cache
    pad = ak.masks.from_lengths(torch.tensor(lengths), n)  # (B, 1, N)
    keep = torch.cat([pad, torch.ones(2, 1, 1, dtype=torch.bool)], -1)  # + the new token
    cache = ak.kv_cache.LayerCache()
    with torch.no_grad():
        mha(x[:, :n], mask=pad & ak.masks.causal(n), cache=cache)
        counts = _Counts(monkeypatch)
        step = mha(x[:, n:], mask=keep, cache=cache).context
    # the prefill validated this kind of call in full; the step's mask is checked by its sizes
    # alone (attnkit.call_plan)
    assert counts.mask_checks == 0 and counts.validations == 0
    assert counts.finite_scans == []
    # reference: each row alone, its padding dropped, in one causal pass
    for i, length in enumerate(lengths):
        real = torch.cat([x[i : i + 1, :length], x[i : i + 1, n:]], 1)
        want = mha(real, mask=ak.masks.causal(length + 1)).context[:, -1:]
        torch.testing.assert_close(step[i : i + 1], want)


def test_a_decoding_step_of_the_decoder_lm_validates_nothing_twice(monkeypatch):
    from attnkit.models.decoder_lm import DecoderLM

    torch.manual_seed(0)
    lm = DecoderLM(50, 16, 2, 2, max_len=16).eval()
    tokens = torch.randint(0, 50, (2, 7))
    cache = lm.new_cache()
    with torch.no_grad():
        lm(tokens[:, :6], cache=cache)
        counts = _Counts(monkeypatch)
        step = lm(tokens[:, 6:], cache=cache)
        assert counts.validations == 0 and counts.mask_checks == 0
        assert counts.head_checks == 0
        assert counts.finite_scans == []
        counts.reset()
        whole = lm(tokens)  # the prompt's causal mask: the model states its activations finite
        assert counts.finite_scans == [] and counts.validations == 0
    torch.testing.assert_close(step[:, -1], whole[:, -1])
