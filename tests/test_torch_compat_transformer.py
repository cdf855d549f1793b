"""TorchMultiheadAttention swapped into torch's own nn.TransformerEncoder, nn.TransformerDecoder
and nn.Transformer, against the unswapped modules with the same weights, in every mode they run
in: training, evaluation with and without gradients, inference mode, with and without nested
tensors (torch's encoder packs a padded batch into a nested tensor at inference), norm first or
last, batch first or not, causal and padding masks for sources, targets and memories."""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

from attnkit.torch_compat import TorchMultiheadAttention

E, H, FF, N, L, T = 8, 2, 16, 3, 5, 4  # T: target length of the decoder
DTYPE = torch.float64
TOL = 1e-10
MODES = ("train", "eval", "no_grad", "inference_mode")


def _swapped(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every torch.nn.MultiheadAttention replaced by ours."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.MultiheadAttention:
                setattr(module, name, TorchMultiheadAttention.from_torch(child))
    return model


def _models(kind: str, batch_first: bool, norm_first: bool, nested: bool):
    """Torch's model (every weight moved off its initial value, the layers different from
    each other) and its copy with our attention."""
    torch.manual_seed(0)
    sizes = {"dim_feedforward": FF, "dropout": 0.0, "batch_first": batch_first}
    kw = {**sizes, "norm_first": norm_first, "dtype": DTYPE}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notice when nested tensors cannot be used

        def encoder():
            layer = nn.TransformerEncoderLayer(E, H, **kw)
            norm = nn.LayerNorm(E, dtype=DTYPE)
            return nn.TransformerEncoder(layer, 2, norm=norm, enable_nested_tensor=nested)

        def decoder():
            return nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, **kw), 2)

        if kind == "encoder":
            theirs = encoder()
        elif kind == "decoder":
            theirs = decoder()
        else:
            theirs = nn.Transformer(E, H, custom_encoder=encoder(), custom_decoder=decoder(), **kw)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.2 * torch.randn_like(p))
    ours = _swapped(theirs)
    assert not any(type(m) is nn.MultiheadAttention for m in ours.modules())
    return theirs, ours


def _inputs():
    g = torch.Generator().manual_seed(1)
    src = torch.randn(N, L, E, generator=g, dtype=DTYPE)
    tgt = torch.randn(N, T, E, generator=g, dtype=DTYPE)
    # padding at the ends (left-aligned, as torch's nested conversion wants), no row empty
    src_pad = torch.arange(L) >= torch.tensor([L, 3, 4])[:, None]
    tgt_pad = torch.arange(T) >= torch.tensor([2, T, 3])[:, None]
    memory_mask = torch.rand(T, L, generator=g) < 0.3
    memory_mask[:, 0] = False  # every target position keeps a memory position
    return src, tgt, src_pad, tgt_pad, memory_mask


def _float(mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=DTYPE).masked_fill(mask, float("-inf"))


def _calls(kind: str) -> list[dict]:
    """Keyword arguments of each call (batch first; the inputs are named src, tgt)."""
    src, tgt, src_pad, tgt_pad, memory_mask = _inputs()
    causal_src = nn.Transformer.generate_square_subsequent_mask(L, dtype=DTYPE)
    causal_tgt = nn.Transformer.generate_square_subsequent_mask(T, dtype=DTYPE)
    if kind == "encoder":
        return [
            {"src": src},
            {"src": src, "src_key_padding_mask": src_pad},
            {"src": src, "src_key_padding_mask": _float(src_pad)},
            {"src": src, "mask": causal_src, "is_causal": True},
            {"src": src, "mask": causal_src},  # torch detects the causal mask
            {"src": src, "mask": causal_src.isinf(), "src_key_padding_mask": src_pad},
        ]
    if kind == "decoder":
        return [
            {"tgt": tgt, "memory": src},
            {"tgt": tgt, "memory": src, "tgt_mask": causal_tgt, "tgt_is_causal": True},
            {"tgt": tgt, "memory": src, "tgt_mask": causal_tgt, "tgt_key_padding_mask": tgt_pad},
            {"tgt": tgt, "memory": src, "memory_key_padding_mask": src_pad},
            {
                "tgt": tgt,
                "memory": src,
                "memory_mask": memory_mask,
                "tgt_key_padding_mask": tgt_pad,
            },
            {
                "tgt": tgt,
                "memory": src,
                "tgt_mask": causal_tgt,
                "memory_mask": _float(memory_mask),
                "memory_key_padding_mask": src_pad,
            },
        ]
    return [
        {"src": src, "tgt": tgt},
        {"src": src, "tgt": tgt, "src_key_padding_mask": src_pad},
        {
            "src": src,
            "tgt": tgt,
            "src_key_padding_mask": src_pad,
            "memory_key_padding_mask": src_pad,
            "tgt_mask": causal_tgt,
            "tgt_is_causal": True,
        },
        {
            "src": src,
            "tgt": tgt,
            "src_mask": causal_src,
            "src_is_causal": True,
            "src_key_padding_mask": src_pad,
            "tgt_key_padding_mask": tgt_pad,
        },
        {
            "src": src,
            "tgt": tgt,
            "src_key_padding_mask": src_pad,
            "tgt_key_padding_mask": tgt_pad,
            "memory_mask": memory_mask,
        },
    ]


def _mode(name: str):
    if name == "no_grad":
        return torch.no_grad()
    if name == "inference_mode":
        return torch.inference_mode()
    return contextlib.nullcontext()


def _call(model: nn.Module, kind: str, batch_first: bool, kwargs: dict, grad: bool):
    """model(**kwargs) with the sequence inputs in the model's layout; output batch first, and
    the sequence inputs (leaves that take gradients when ``grad``)."""
    kwargs = dict(kwargs)
    names = ("src", "tgt", "memory")
    seqs = {k: v.clone().requires_grad_(grad) for k, v in kwargs.items() if k in names}
    for k, v in seqs.items():
        kwargs[k] = v if batch_first else v.transpose(0, 1)
    if kind == "encoder":
        out = model(kwargs.pop("src"), **kwargs)
    elif kind == "decoder":
        out = model(kwargs.pop("tgt"), kwargs.pop("memory"), **kwargs)
    else:
        out = model(kwargs.pop("src"), kwargs.pop("tgt"), **kwargs)
    return (out if batch_first else out.transpose(0, 1)), seqs


def _record_nested(model: nn.Module, seen: list[bool]) -> None:
    """Note, at every call of our attention, whether it got a nested tensor."""
    for m in model.modules():
        if isinstance(m, TorchMultiheadAttention):
            m.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_nested))


def _close(got, expected):
    torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("norm_first", [False, True], ids=["norm_last", "norm_first"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq_first", "batch_first"])
@pytest.mark.parametrize("kind", ["encoder", "decoder", "transformer"])
def test_swapped_model_equals_torch_in_every_mode(kind, batch_first, norm_first):
    """Every mode × nested tensors on/off × masks: the whole output (padded positions too: the
    nested path gives zeros there, as torch's) and, in training, every gradient."""
    nested_cells = set()
    for nested, mode in itertools.product((False, True) if kind != "decoder" else (False,), MODES):
        theirs, ours = _models(kind, batch_first, norm_first, nested)
        theirs.train(mode == "train")
        ours.train(mode == "train")
        seen: list[bool] = []
        _record_nested(ours, seen)
        for i, kwargs in enumerate(_calls(kind)):
            seen.clear()
            with _mode(mode):
                expected, their_inputs = _call(theirs, kind, batch_first, kwargs, mode == "train")
                got, our_inputs = _call(ours, kind, batch_first, kwargs, mode == "train")
            _close(got, expected)
            if any(seen):
                nested_cells.add((nested, mode, i))
            if mode != "train":
                continue
            (expected.square().sum() + expected.sin().sum()).backward()
            (got.square().sum() + got.sin().sum()).backward()
            for name, x in our_inputs.items():
                _close(x.grad, their_inputs[name].grad)
            grads = dict(theirs.named_parameters())
            for name, p in ours.named_parameters():
                _close(p.grad, grads[name].grad)
            theirs.zero_grad()
            ours.zero_grad()
    # torch packs a padded source into nested tensors only at inference, without a source
    # mask, when its encoder was built on batch-first, norm-last torch attention
    packs = kind != "decoder" and batch_first and not norm_first
    padded_only = [
        i
        for i, c in enumerate(_calls(kind))
        if "src_key_padding_mask" in c and not {"mask", "src_mask"} & c.keys()
    ]
    expected_cells = {
        (True, mode, i) for mode in ("no_grad", "inference_mode") for i in padded_only
    }
    assert nested_cells == (expected_cells if packs else set())


def test_an_empty_sequence_in_a_packed_batch_equals_torch():
    """A fully padded source in the nested path: torch drops it (zeros before the final norm),
    and so does ours."""
    theirs, ours = _models("encoder", True, False, True)
    theirs.eval()
    ours.eval()
    src, *_ = _inputs()
    padding = torch.arange(L) >= torch.tensor([L, 0, 2])[:, None]
    seen: list[bool] = []
    _record_nested(ours, seen)
    with torch.inference_mode():
        expected = theirs(src, src_key_padding_mask=padding)
        got = ours(src, src_key_padding_mask=padding)
    assert seen and all(seen)
    _close(got, expected)
    _close(got[1], ours.norm(torch.zeros(L, E, dtype=DTYPE)))


@pytest.mark.parametrize("mode", MODES)
def test_is_causal_without_a_mask_is_refused_in_every_mode(mode):
    """torch's encoder raises in training and ignores the hint in its nested fast path; ours
    refuses in every mode, naming the missing mask."""
    _, ours = _models("encoder", True, False, True)
    ours.train(mode == "train")
    src, _, src_pad, *_ = _inputs()
    for padding in (None, src_pad):
        with _mode(mode), pytest.raises(ValueError, match=r"is_causal=True.*attn_mask"):
            ours(src, src_key_padding_mask=padding, is_causal=True)


def _attention_pair():
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, batch_first=True, dtype=DTYPE)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return theirs, TorchMultiheadAttention.from_torch(theirs)


def _nested(parts, layout):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype notice for the strided layout
        return torch.nested.as_nested_tensor(parts, layout=layout)


def _padding(lengths, size):
    return torch.arange(size) >= torch.tensor(lengths)[:, None]


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("average", [False, True])
def test_nested_self_attention_equals_torch_on_the_padded_batch(layout, average):
    """Each nested sequence attends to itself: torch's module on the padded batch with the
    padding as key_padding_mask, on the real positions; outputs, weights and gradients."""
    theirs, ours = _attention_pair()
    lengths = [L, 2, 4]
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, E, generator=g, dtype=DTYPE, requires_grad=True) for n in lengths]
    x = torch.nested.to_padded_tensor(_nested([p.detach() for p in parts], layout), 0.0)
    x.requires_grad_()
    padding = _padding(lengths, L)
    expected, expected_weights = theirs(
        x, x, x, key_padding_mask=padding, average_attn_weights=average
    )
    nt = _nested(parts, layout)
    got, weights = ours(nt, nt, nt, average_attn_weights=average)
    assert got.is_nested and got.layout == layout
    outside = padding[:, None, :, None] if not average else padding[:, :, None]
    _close(weights, expected_weights.masked_fill(outside, 0.0))
    assert weights.shape == ((N, L, L) if average else (N, H, L, L))
    for i, (row, n) in enumerate(zip(got.unbind(), lengths, strict=True)):
        _close(row, expected[i, :n])
    expected_weights = expected_weights.masked_fill(outside, 0.0)  # rows of padded queries
    (expected[~padding].square().sum() + expected_weights.sin().sum()).backward()
    (torch.nested.to_padded_tensor(got, 0.0).square().sum() + weights.sin().sum()).backward()
    for i, (part, n) in enumerate(zip(parts, lengths, strict=True)):
        _close(part.grad, x.grad[i, :n])
    assert ours(nt, nt, nt, need_weights=False)[1] is None


def test_nested_cross_attention_equals_torch_on_the_padded_batch():
    """Nested queries over a nested memory of other lengths, and padded queries over it."""
    theirs, ours = _attention_pair()
    g = torch.Generator().manual_seed(4)
    q_lengths, k_lengths = [3, T, 1], [L, 2, 4]
    queries = [torch.randn(n, E, generator=g, dtype=DTYPE) for n in q_lengths]
    memory = [torch.randn(n, E, generator=g, dtype=DTYPE) for n in k_lengths]
    q = torch.nested.to_padded_tensor(_nested(queries, torch.strided), 0.0)
    m = torch.nested.to_padded_tensor(_nested(memory, torch.strided), 0.0)
    expected, _ = theirs(q, m, m, key_padding_mask=_padding(k_lengths, L))
    nested_memory = _nested(memory, torch.strided)
    got, _ = ours(_nested(queries, torch.strided), nested_memory, nested_memory)
    for i, (row, n) in enumerate(zip(got.unbind(), q_lengths, strict=True)):
        _close(row, expected[i, :n])
    padded_queries, _ = ours(q, nested_memory, nested_memory)
    assert not padded_queries.is_nested
    _close(padded_queries, expected)


def test_nested_inputs_that_cannot_be_read_are_refused():
    _, ours = _attention_pair()
    nt = _nested([torch.randn(n, E, dtype=DTYPE) for n in (2, 3)], torch.strided)
    other = _nested([torch.randn(n, E, dtype=DTYPE) for n in (3, 3)], torch.strided)
    padded = torch.nested.to_padded_tensor(nt, 0.0)
    with pytest.raises(ValueError, match="attn_mask cannot be given with nested"):
        ours(nt, nt, nt, attn_mask=torch.zeros(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask cannot be given with nested"):
        ours(nt, nt, nt, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="key and value must both be nested"):
        ours(nt, nt, padded)
    with pytest.raises(ValueError, match=r"same lengths, got \[2, 3\] and \[3, 3\]"):
        ours(nt, nt, other)
    with pytest.raises(ValueError, match="feature sizes"):
        ours(_nested([torch.randn(2, E), torch.randn(2, E + 1)], torch.strided), padded, padded)
    with pytest.raises(TypeError, match=r"key must be a torch\.Tensor"):
        ours(nt, [[0.0] * E], nt)
    with pytest.raises(ValueError, match="batch_first=False"):
        TorchMultiheadAttention(E, H)(nt, nt, nt)
