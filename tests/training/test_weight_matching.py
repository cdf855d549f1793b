"""Pairing two models' attention: TinyBERT's uniform layer map, head maps, and one paired run
whose trained side keeps its graph and whose reference side has none."""

import pytest
import torch

from attnkit.training.weight_matching import match_heads, run_matched, uniform_pairs
from attnkit.transformer import TransformerEncoder

NAME = "layers.{}.self_attention.module"


def _stack(layers, heads=2):
    return TransformerEncoder(layers, 8, heads, 16)


@pytest.mark.parametrize(("s", "t"), [(1, 1), (2, 4), (3, 4), (1, 3)])
def test_uniform_pairs_follow_g_of_m(s, t):
    pairs = uniform_pairs(_stack(s), _stack(t))
    # TinyBERT: student layer m (from 1) learns from teacher layer g(m) = m·T/S (floored)
    expected = {NAME.format(m - 1): NAME.format(m * t // s - 1) for m in range(1, s + 1)}
    assert pairs == expected


def test_uniform_pairs_refuses_a_larger_trained_model():
    with pytest.raises(ValueError, match="more than the reference's 1"):
        uniform_pairs(_stack(2), _stack(1))


def test_match_heads():
    a, b = torch.rand(2, 3, 4, 5), torch.rand(2, 6, 4, 5)
    x, y = match_heads(a, b, [5, 0, 2])
    assert x is a
    torch.testing.assert_close(y, torch.stack([b[:, 5], b[:, 0], b[:, 2]], dim=1))
    x, y = match_heads(a, b, "mean")
    torch.testing.assert_close(x[:, 0], a.mean(1))
    torch.testing.assert_close(y[:, 0], b.mean(1))
    with pytest.raises(ValueError, match="give heads='mean'"):
        match_heads(a, b)
    with pytest.raises(ValueError, match="one reference head per trained head"):
        match_heads(a, b, [0, 1])
    with pytest.raises(ValueError, match="must index the reference's 6 heads"):
        match_heads(a, b, [0, 1, 6])
    with pytest.raises(ValueError, match="heads must be None, 'mean'"):
        match_heads(a, b, "max")
    with pytest.raises(TypeError, match="sequence of ints"):
        match_heads(a, b, [0.0, 1, 2])


def test_run_matched_pairs_weights_with_and_without_graph():
    torch.manual_seed(0)
    trained, reference = _stack(1), _stack(2, heads=4)
    x = torch.randn(2, 5, 8)
    out, pairs = run_matched(trained, reference, x, heads=[3, 1])
    torch.testing.assert_close(out, trained(x), rtol=1e-5, atol=1e-6)
    ((mine, theirs),) = pairs
    assert mine.grad_fn is not None and theirs.grad_fn is None and not theirs.requires_grad
    with torch.no_grad():
        inner = reference.layers[0](x)
        reference_weights = reference.layers[1].self_attention(inner, need_weights=True).weights
    torch.testing.assert_close(theirs, reference_weights[:, [3, 1]])


def test_run_matched_errors():
    trained, reference = _stack(1), _stack(1)
    x = torch.randn(1, 3, 8)
    with pytest.raises(ValueError, match=r"not attention modules of the reference model"):
        run_matched(trained, reference, x, pairs={NAME.format(0): "layers.0"})
    with pytest.raises(TypeError, match="pairs must be a non-empty mapping"):
        run_matched(trained, reference, x, pairs={})
