"""Weights with their graph: the same values the core reports (detached) to
``attnkit.evaluation.capture``, the model's output unchanged, and gradients that reach exactly
the parameters the weights depend on."""

import pytest
import torch

import attnkit as ak
from attnkit.evaluation import capture
from attnkit.training.graph_capture import attention_modules, capture_weights, stack_head_weights
from attnkit.transformer import TransformerDecoder, TransformerEncoder


def _encoder():
    torch.manual_seed(0)
    return TransformerEncoder(2, 8, 2, 16)


def test_attention_modules_names_the_outermost_attention_parts():
    enc = _encoder()
    assert list(attention_modules(enc)) == [
        "layers.0.self_attention.module",
        "layers.1.self_attention.module",
    ]
    dec = TransformerDecoder(1, 8, 2, 16)
    assert list(attention_modules(dec)) == [
        "layers.0.self_attention.module",
        "layers.0.cross_attention.module",
    ]
    mha = ak.MultiHeadAttention(8, 2)
    assert attention_modules(mha) == {"": mha}
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        attention_modules("encoder")


def test_weights_equal_the_reported_ones_and_keep_the_graph():
    enc = _encoder()
    x = torch.randn(3, 5, 8)
    plain = enc(x)
    with capture(enc) as reported:
        enc(x)
    with capture_weights(enc) as records:
        out = enc(x)
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    assert len(records) == 2
    for name, (w,) in records.items():
        assert w.shape == (3, 2, 5, 5) and w.grad_fn is not None
        (ref,) = reported[name + ".attention"]  # the per-head part reports (detached)
        torch.testing.assert_close(w.detach(), ref)
    # the hooks are gone after the block
    for module in attention_modules(enc).values():
        assert not module._forward_pre_hooks and not module._forward_hooks


def test_gradients_reach_the_layers_below_and_not_above():
    enc = _encoder()
    x = torch.randn(2, 4, 8, requires_grad=True)
    _, w = stack_head_weights(enc, x, layer=0, head=1)
    (w[..., 0] * torch.arange(4.0)).sum().backward()
    first, second = enc.layers[0].self_attention.module, enc.layers[1]
    grads_first = [p.grad for p in first.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads_first)
    assert all(p.grad is None for p in second.parameters())
    assert x.grad.abs().sum() > 0


def test_stack_head_weights_selects_a_layer_and_head():
    enc = _encoder()
    x = torch.randn(2, 4, 8)
    with capture_weights(enc) as records:
        enc(x)
    _, every = stack_head_weights(enc, x, layer=-1)
    _, one = stack_head_weights(enc, x, layer=1, head=0)
    torch.testing.assert_close(every, records["layers.1.self_attention.module"][0])
    torch.testing.assert_close(one, every[:, 0])


def test_cross_attention_of_a_decoder():
    torch.manual_seed(0)
    dec = TransformerDecoder(2, 8, 2, 16)
    x, memory = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    _, w = stack_head_weights(dec, x, memory=memory, layer=1, attention="cross_attention")
    assert w.shape == (2, 2, 3, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 3))


def test_an_unbatched_call_is_recorded_once():
    mha = ak.MultiHeadAttention(8, 2)
    with capture_weights(mha) as records:
        mha(torch.randn(4, 8))
    (calls,) = records.values()
    assert len(calls) == 1 and calls[0].shape == (2, 4, 4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"layer": 2}, ValueError, r"layer must be an int in \[-2, 2\), got 2"),
        ({"layer": True}, ValueError, "layer must be an int"),
        ({"layer": 0, "head": 2}, ValueError, r"head must be < 2"),
        ({"layer": 0, "head": -1}, ValueError, "head must be an int >= 0"),
        ({"layer": 0, "attention": "cross_attention"}, ValueError, "attention must name"),
    ],
)
def test_stack_head_weights_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        stack_head_weights(_encoder(), torch.randn(1, 3, 8), **kwargs)


def test_stack_head_weights_needs_a_stack():
    with pytest.raises(TypeError, match="stack must hold its layers"):
        stack_head_weights(ak.MultiHeadAttention(8, 2), torch.randn(1, 3, 8), layer=0)


def test_a_failed_call_does_not_stop_the_recording():
    mha = ak.MultiHeadAttention(8, 2)
    with capture_weights(mha) as records:
        with pytest.raises(ValueError, match="has 7 features"):
            mha(torch.randn(1, 3, 7))
        mha(torch.randn(1, 3, 8))
    (calls,) = records.values()
    assert len(calls) == 1
