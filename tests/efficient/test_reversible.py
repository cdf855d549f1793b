"""Reversible residual layers (RevNet; Reformer Sec. 3): the inverse reconstructs the input, and
the memory-saving backward pass gives the gradients of the plain stack y₁ = x₁ + F(x₂),
y₂ = x₂ + G(y₁), written out here with ordinary autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnkit as ak
from attnkit.efficient import LSHAttention, ReversibleStack

D = torch.float64


class Attend(nn.Module):
    def __init__(self, d, dropout=0.0):
        super().__init__()
        self.mha = ak.MultiHeadAttention(d, 2, dropout=dropout)

    def forward(self, x, mask=None):
        return self.mha(x, mask=mask).context


def _stack(dropout=0.0, seed=0):
    torch.manual_seed(seed)
    f = [Attend(6, dropout) for _ in range(3)]
    g = [
        nn.Sequential(nn.Linear(6, 12), nn.Dropout(dropout), nn.GELU(), nn.Linear(12, 6))
        for _ in range(3)
    ]
    return ReversibleStack(f, g).to(D)


def _plain(stack, x, mask=None):
    x1, x2 = x[..., :6], x[..., 6:]
    for f, g in zip(stack.f, stack.g, strict=True):
        x1 = x1 + f(x2, mask=mask)
        x2 = x2 + g(x1)
    return torch.cat([x1, x2], -1)


def _grads(out, x, stack):
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=D)
    return torch.autograd.grad((out * r).sum(), [x, *stack.parameters()])


def test_inverse_reconstructs_the_input():
    stack = _stack().eval()
    x = torch.randn(2, 7, 12, dtype=D)
    y = stack(x).output
    assert (y - x).abs().max() > 0.1  # the layers do something
    torch.testing.assert_close(stack.inverse(y), x, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_same_output_and_gradients_as_the_plain_stack(dropout):
    """With dropout in training too: the backward pass replays each block's random draws."""
    stack = _stack(dropout).train()
    x = torch.randn(2, 7, 12, dtype=D, requires_grad=True)
    mask = ak.masks.from_lengths(torch.tensor([7, 5]), 7)
    torch.manual_seed(1)
    plain = _plain(stack, x, mask)
    ref = _grads(plain, x, stack)
    torch.manual_seed(1)
    rev = stack(x, mask=mask).output
    got = _grads(rev, x, stack)
    torch.testing.assert_close(rev, plain, atol=1e-12, rtol=1e-12)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_backward_keeps_only_the_output():
    """The autograd graph holds the stack's output, not the activations of every layer: the
    tensors saved for backward are y₁, y₂ (and the mask), whatever the depth."""
    stack = _stack()
    x = torch.randn(2, 7, 12, dtype=D, requires_grad=True)
    out = stack(x).output
    node = out.grad_fn.next_functions[0][0]  # the reversible function under cat
    saved = node.saved_tensors
    assert len(saved) == 2 and all(t.shape == (2, 7, 6) for t in saved)


def test_reformer_layers_with_lsh_attention_and_weights():
    module, args, kwargs = ak.mechanisms.example("reversible")
    out = module(*args, **kwargs, need_weights=True)
    assert len(out.named_weights()) == 2  # one LSH attention per layer
    for w in out.named_weights().values():
        assert w.shape == (2, 2, 6, 6)
    assert isinstance(module.f[0].mha.attention, LSHAttention)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="as many F blocks as G blocks"):
        ReversibleStack([nn.Identity()], [])
    with pytest.raises(TypeError, match=r"f must hold nn\.Modules"):
        ReversibleStack([lambda x: x], [nn.Identity()])
    stack = ReversibleStack([nn.Linear(3, 3)], [nn.Linear(3, 3)])
    with pytest.raises(ValueError, match="even feature size"):
        stack(torch.randn(2, 4, 5))
    with pytest.raises(ValueError, match="no block takes a mask"):
        stack(torch.randn(2, 4, 6), mask=torch.ones(2, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="same shape"):
        ReversibleStack([nn.Linear(3, 4)], [nn.Linear(3, 3)])(torch.randn(2, 4, 6))
