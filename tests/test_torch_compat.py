"""TorchMultiheadAttention against torch.nn.MultiheadAttention itself: same parameters, same
calls, same outputs, weights and gradients; and inside torch's own TransformerEncoderLayer."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.torch_compat import TorchMultiheadAttention

E, H, L, S, N = 8, 2, 4, 5, 3
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


def _pair(dtype=torch.float64, *, cross=False, seed=0, **kw):
    """A torch module with nonzero biases everywhere and our copy of it."""
    torch.manual_seed(seed)
    sizes = {"kdim": 5, "vdim": 3} if cross else {}
    theirs = nn.MultiheadAttention(E, H, **sizes, **kw).to(dtype)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return theirs, TorchMultiheadAttention.from_torch(theirs)


def _inputs(theirs, dtype, *, batched=True, seed=1):
    g = torch.Generator().manual_seed(seed)
    lead = (N,) if batched else ()

    def make(length, d):
        x = torch.randn(*lead, length, d, generator=g, dtype=dtype)  # batch first
        return x.transpose(0, 1) if batched and not theirs.batch_first else x

    return make(L, E), make(S, theirs.kdim), make(S, theirs.vdim)


def _masks(kind_kpm, kind_attn, dtype, *, batched=True, seed=2):
    """Torch-convention masks; key 0 stays allowed so that no row is fully masked."""
    g = torch.Generator().manual_seed(seed)
    kpm = attn = None
    if kind_kpm is not None:
        ignore = torch.rand(N, S, generator=g) < 0.4
        ignore[:, 0] = False
        if kind_kpm == "float":
            kpm = torch.randn(N, S, generator=g, dtype=dtype)
            kpm = kpm.masked_fill(ignore, float("-inf"))
        else:
            kpm = ignore
        kpm = kpm if batched else kpm[0]
    if kind_attn is not None:
        rank, form = kind_attn
        shape = (L, S) if rank == 2 else ((N * H) if batched else H, L, S)
        ignore = torch.rand(shape, generator=g) < 0.4
        ignore[..., 0] = False
        if form == "float":
            attn = torch.randn(shape, generator=g, dtype=dtype)
            attn = attn.masked_fill(ignore, float("-inf"))
        else:
            attn = ignore
    return kpm, attn


def _close(ours, theirs, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)


CONFIGS = [
    dict(zip(("batch_first", "cross", "add_bias_kv", "add_zero_attn"), c, strict=True))
    for c in itertools.product((False, True), repeat=4)
]
CONFIG_IDS = ["-".join(k for k, v in c.items() if v) or "plain" for c in CONFIGS]
MASKS = list(
    itertools.product(
        (None, "bool", "float"),
        (None, (2, "bool"), (3, "bool"), (2, "float"), (3, "float")),
    )
)
CALLS = [
    {"need_weights": False},
    {"need_weights": True, "average_attn_weights": True},
    {"need_weights": True, "average_attn_weights": False},
]


def _same_call(theirs, ours, args, kwargs, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notice on mixed bool/float masks
        expected = theirs(*args, **kwargs)
    got = ours(*args, **kwargs)
    _close(got[0], expected[0], dtype)
    if expected[1] is None:
        assert got[1] is None
    else:
        _close(got[1], expected[1], dtype)


@pytest.mark.parametrize(("i", "config"), list(enumerate(CONFIGS)), ids=CONFIG_IDS)
def test_every_option_and_mask_matches_torch_float64(i, config):
    """Every module option with every pair of masks; the three kinds of call take turns, so
    that each (masks, call) pair meets several module configurations."""
    config = dict(config)
    cross = config.pop("cross")
    theirs, ours = _pair(torch.float64, cross=cross, **config)
    args = _inputs(theirs, torch.float64)
    for j, (kpm_kind, attn_kind) in enumerate(MASKS):
        call = CALLS[(i + j) % len(CALLS)]
        kpm, attn = _masks(kpm_kind, attn_kind, torch.float64)
        kwargs = {"key_padding_mask": kpm, "attn_mask": attn, **call}
        _same_call(theirs, ours, args, kwargs, torch.float64)


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_every_option_matches_torch_float32(config):
    config = dict(config)
    cross = config.pop("cross")
    theirs, ours = _pair(torch.float32, cross=cross, **config)
    args = _inputs(theirs, torch.float32)
    for masks, call in [(("bool", (3, "float")), CALLS[2]), (("float", (2, "bool")), CALLS[0])]:
        kpm, attn = _masks(*masks, torch.float32)
        kwargs = {"key_padding_mask": kpm, "attn_mask": attn, **call}
        _same_call(theirs, ours, args, kwargs, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("extras", [False, True])
def test_unbatched_inputs_match_torch(dtype, extras):
    theirs, ours = _pair(dtype, add_bias_kv=extras, add_zero_attn=extras)
    args = _inputs(theirs, dtype, batched=False)
    for (kpm_kind, attn_kind), call in itertools.product(MASKS, CALLS):
        kpm, attn = _masks(kpm_kind, attn_kind, dtype, batched=False)
        kwargs = {"key_padding_mask": kpm, "attn_mask": attn, **call}
        _same_call(theirs, ours, args, kwargs, dtype)
    out, weights = ours(*args, average_attn_weights=False)
    assert out.shape == (L, E)
    assert weights.shape == (H, L, S + 2 * extras)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("form", ["bool", "float"])
def test_is_causal_with_its_mask_matches_torch(dtype, form):
    theirs, ours = _pair(dtype, batch_first=True)
    x = torch.randn(N, L, E, dtype=dtype)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=dtype)
    mask = causal.isinf() if form == "bool" else causal
    kpm, _ = _masks("bool", None, dtype)
    kpm = kpm[:, :L]
    for need_weights, padding in itertools.product((False, True), (None, kpm)):
        # torch's need_weights=False path without padding applies SDPA's is_causal instead
        # of the mask: both must agree with ours
        kwargs = {"attn_mask": mask, "is_causal": True, "need_weights": need_weights}
        _same_call(theirs, ours, (x, x, x), {**kwargs, "key_padding_mask": padding}, dtype)


def test_gradients_match_torch():
    dtype = torch.float64
    theirs, ours = _pair(dtype, cross=True, add_bias_kv=True, add_zero_attn=True)
    kpm, attn = _masks("float", (3, "float"), dtype)
    inputs = [x.requires_grad_() for x in _inputs(theirs, dtype)]
    mine = [x.detach().clone().requires_grad_() for x in inputs]
    kwargs = {"key_padding_mask": kpm, "attn_mask": attn, "average_attn_weights": False}
    out, weights = theirs(*inputs, **kwargs)
    (out.square().sum() + (weights * weights.detach().cos()).sum()).backward()
    out, weights = ours(*mine, **kwargs)
    (out.square().sum() + (weights * weights.detach().cos()).sum()).backward()
    for a, b in zip(mine, inputs, strict=True):
        _close(a.grad, b.grad, dtype)
    grads = {name: p.grad for name, p in theirs.named_parameters()}
    assert set(grads) == {name for name, _ in ours.named_parameters()}
    for name, p in ours.named_parameters():
        _close(p.grad, grads[name], dtype)


def test_gradient_through_a_float_mask_matches_torch():
    dtype = torch.float64
    theirs, ours = _pair(dtype)
    args = _inputs(theirs, dtype)
    _, attn = _masks(None, (2, "float"), dtype)
    learned = [attn.clone().requires_grad_() for _ in range(2)]
    theirs(*args, attn_mask=learned[0])[0].sum().backward()
    ours(*args, attn_mask=learned[1])[0].sum().backward()
    _close(learned[1].grad, learned[0].grad, dtype)


def test_dropout_in_eval_mode_matches_torch_and_is_applied_in_training():
    theirs, ours = _pair(torch.float64, dropout=0.3)
    assert ours.dropout == 0.3 and ours.training
    theirs.eval()
    ours.eval()
    args = _inputs(theirs, torch.float64)
    for call in CALLS:
        _same_call(theirs, ours, args, call, torch.float64)
    ours.train()
    torch.manual_seed(0)
    trained = ours(*args)[0]
    assert not torch.allclose(trained, ours.eval()(*args)[0])


@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_state_dicts_load_both_ways(cross, bias):
    sizes = {"kdim": 5, "vdim": 3} if cross else {}
    theirs = nn.MultiheadAttention(E, H, bias=bias, add_bias_kv=True, **sizes).double()
    ours = TorchMultiheadAttention(E, H, bias=bias, add_bias_kv=True, **sizes).double()
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    args = _inputs(theirs, torch.float64)
    _same_call(theirs, ours, args, {}, torch.float64)
    fresh = nn.MultiheadAttention(E, H, bias=bias, add_bias_kv=True, **sizes).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.mul_(1.5)
    fresh.load_state_dict(ours.state_dict())
    _same_call(fresh, ours, args, {}, torch.float64)


def test_a_score_with_parameters_adds_only_its_own_state():
    theirs = nn.MultiheadAttention(E, H)
    ours = TorchMultiheadAttention(E, H, score="additive")
    result = ours.load_state_dict(theirs.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys and all(
        k.startswith("attention.score.") for k in result.missing_keys
    )
    copied = TorchMultiheadAttention.from_torch(theirs, score="additive", align="sparsemax")
    torch.testing.assert_close(copied.in_proj_weight, theirs.in_proj_weight, rtol=0, atol=0)
    torch.testing.assert_close(copied.out_proj.bias, theirs.out_proj.bias, rtol=0, atol=0)
    back = TorchMultiheadAttention.from_torch(copied)  # from ours: the default parts again
    x = torch.randn(L, N, E)
    torch.testing.assert_close(back(x, x, x)[1], theirs(x, x, x)[1], rtol=1e-6, atol=1e-6)


def _layers(batch_first, dtype=torch.float64):
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(
        E, H, dim_feedforward=16, dropout=0.0, batch_first=batch_first, dtype=dtype
    )
    ours = copy.deepcopy(theirs)
    ours.self_attn = TorchMultiheadAttention.from_torch(theirs.self_attn)
    return theirs, ours


@pytest.mark.parametrize("batch_first", [False, True])
def test_swapped_into_torch_encoder_layer_gives_the_same_outputs(batch_first):
    theirs, ours = _layers(batch_first)
    x = torch.randn(N, L, E, dtype=torch.float64)
    x = x if batch_first else x.transpose(0, 1)
    padding = torch.zeros(N, L, dtype=torch.bool)
    padding[1, 2:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    calls = [{}, {"src_key_padding_mask": padding}, {"src_mask": causal, "is_causal": True}]
    for kwargs in calls:
        expected = theirs(x, **kwargs)
        got = ours(x, **kwargs)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        got.sum().backward()  # training mode: gradients flow through the swapped module
    # eval mode without gradients: torch's layer takes its fused fast path, ours is still called
    theirs.eval()
    ours.eval()
    with torch.no_grad(), ak.evaluation.capture(ours) as records:
        expected = theirs(x, src_key_padding_mask=padding)
        got = ours(x, src_key_padding_mask=padding)
    assert records["self_attn.attention"][0].shape == (N, H, L, L)
    keep = ~padding if batch_first else ~padding.T  # torch's fast path leaves padded rows free
    torch.testing.assert_close(got[keep], expected[keep], rtol=1e-10, atol=1e-10)


def test_swapped_into_torch_decoder_layer_gives_the_same_outputs():
    """Self-attention and cross-attention (keys from the memory) of torch's decoder layer."""
    torch.manual_seed(0)
    theirs = nn.TransformerDecoderLayer(E, H, 16, dropout=0.0, dtype=torch.float64)
    ours = copy.deepcopy(theirs)
    ours.self_attn = TorchMultiheadAttention.from_torch(theirs.self_attn)
    ours.multihead_attn = TorchMultiheadAttention.from_torch(theirs.multihead_attn)
    tgt = torch.randn(L, N, E, dtype=torch.float64)
    memory = torch.randn(S, N, E, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.float64)
    padding = torch.zeros(N, S, dtype=torch.bool)
    padding[0, 3:] = True
    kwargs = {"tgt_mask": causal, "tgt_is_causal": True, "memory_key_padding_mask": padding}
    expected = theirs(tgt, memory, **kwargs)
    torch.testing.assert_close(ours(tgt, memory, **kwargs), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("score", "align"), [("additive", "softmax"), ("scaled_dot", "sparsemax")])
def test_other_parts_run_inside_torch_encoder_layer(score, align):
    theirs, ours = _layers(batch_first=True, dtype=torch.float32)
    ours.self_attn = TorchMultiheadAttention.from_torch(theirs.self_attn, score=score, align=align)
    torch.manual_seed(3)
    x = 3 * torch.randn(N, 6, E)
    padding = torch.zeros(N, 6, dtype=torch.bool)
    padding[0, 4:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(6)  # float, -inf above the diagonal
    padding_bias = torch.zeros(N, 6).masked_fill(padding, float("-inf"))
    with ak.evaluation.capture(ours) as records:
        out = ours(x, src_mask=causal, src_key_padding_mask=padding_bias, is_causal=True)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, theirs(x, src_mask=causal, src_key_padding_mask=padding_bias))
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.self_attn.parameters())
    (weights,) = records["self_attn.attention"]  # (N, H, L, L)
    allowed = ~causal.isinf() & ~padding[:, None, None, :]
    assert (weights[~allowed.expand_as(weights)] == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(N, H, 6))
    if align == "sparsemax":  # exact zeros among the allowed keys: sparse rows
        assert (weights[allowed.expand_as(weights)] == 0).any()
        _, direct = ours.self_attn(x, x, x, attn_mask=causal, average_attn_weights=False)
        zeros = (direct == 0) & ~causal.isinf()
        assert zeros.any()


@pytest.mark.parametrize("form", ["bool", "float"])
@pytest.mark.parametrize("align", ["softmax", "sparsemax"])
def test_a_query_with_no_key_gets_zeros_not_nan(form, align):
    theirs, _ = _pair(torch.float64, batch_first=True)
    ours = TorchMultiheadAttention.from_torch(theirs, align=align)
    x = torch.randn(1, L, E, dtype=torch.float64)
    blocked = torch.zeros(L, L, dtype=torch.bool)
    blocked[1] = True  # query 1 may attend nothing (torch gives NaN there)
    blocked[2, 3] = True
    if form == "float":
        blocked = torch.zeros(L, L, dtype=torch.float64).masked_fill(blocked, float("-inf"))
    out, weights = ours(x, x, x, attn_mask=blocked)
    assert (weights[0, 1] == 0).all() and weights[0, 2, 3] == 0
    torch.testing.assert_close(out[0, 1], ours.out_proj.bias)
    assert torch.isfinite(out).all()
    if align == "softmax":
        expected = theirs(x, x, x, attn_mask=blocked)[0]
        torch.testing.assert_close(out[0, [0, 2, 3]], expected[0, [0, 2, 3]])


def test_fast_path_flag_and_export():
    assert ak.TorchMultiheadAttention is TorchMultiheadAttention
    ours = TorchMultiheadAttention(E, H, batch_first=True)
    assert ours.packed and not ours._qkv_same_embed_dim
    assert "batch_first=True" in repr(ours)


def test_errors_name_the_argument():
    ours = TorchMultiheadAttention(E, H, batch_first=True)
    x = torch.randn(N, L, E)
    with pytest.raises(ValueError, match="is_causal"):
        ours(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match="key_padding_mask"):
        ours(x, x, x, key_padding_mask=torch.zeros(N, L + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(H, L, L, dtype=torch.bool))  # needs N·H
    with pytest.raises(TypeError, match="attn_mask"):
        ours(x, x, x, attn_mask=torch.zeros(L, L, dtype=torch.int64))
    with pytest.raises(ValueError, match="query"):
        ours(x[0, 0], x[0, 0], x[0, 0])
    with pytest.raises(ValueError, match="key"):
        ours(x, x[0], x[0])
    with pytest.raises(ValueError, match="batch size"):
        ours(x, x[:1], x[:1])
    with pytest.raises(TypeError, match="key_padding_mask"):
        ours(x, x, x, key_padding_mask=[[True] * L] * N)
    with pytest.raises(TypeError, match="need_weights"):
        ours(x, x, x, need_weights=1)
    with pytest.raises(ValueError, match="add_bias_kv"):
        TorchMultiheadAttention(
            E, H, add_bias_kv=True, score=ak.scores.Location(E // H, 8, num_heads=H)
        )
    with pytest.raises(ValueError, match="add_zero_attn"):
        TorchMultiheadAttention(
            E, H, add_zero_attn=True, align=ak.alignments.build("local", window=2)
        )

    class MixesQueries(ak.HeadAttention):
        mixes_queries = True

        def forward(self, q, k, v, *, mask=None, bias=None, need_weights=False):
            return ak.attention(q, k, v, mask=mask, bias=bias, need_weights=need_weights)

    with pytest.raises(ValueError, match="mixes the queries"):
        TorchMultiheadAttention(E, H, add_bias_kv=True, attention=MixesQueries())
    with pytest.raises(ValueError, match="query-free"):
        TorchMultiheadAttention(E, H, score="learned_query")
    with pytest.raises(ValueError, match="dropout"):
        TorchMultiheadAttention(E, H, dropout=0.1, attention=ak.Attention())
    with pytest.raises(TypeError, match="MultiheadAttention"):
        TorchMultiheadAttention.from_torch(nn.Linear(E, E))
