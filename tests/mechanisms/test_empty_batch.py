"""Every registered mechanism accepts an empty batch (B = 0), as the core does: its example with
every input cut to zero items gives outputs of the full batch's shapes with B = 0."""

from __future__ import annotations

import pytest
import torch

from attnkit import mechanisms


def _empty(x):
    """Every tensor in nested tuples, lists and dicts cut to zero batch items."""
    if isinstance(x, torch.Tensor):
        return x[:0]
    if isinstance(x, (list, tuple)):
        return type(x)(_empty(y) for y in x)
    if isinstance(x, dict):
        return {k: _empty(v) for k, v in x.items()}
    return x


@pytest.mark.parametrize("name", mechanisms.available())
def test_empty_batch_gives_empty_outputs(name):
    torch.manual_seed(0)
    module, args, kwargs = mechanisms.example(name)
    module.eval()
    with torch.no_grad():
        full = module(*args, **kwargs)
        out = module(*_empty(args), **_empty(kwargs))
    assert out.representation.shape == (0, *full.representation.shape[1:])
    weights, full_weights = out.named_weights(), full.named_weights()
    assert weights.keys() == full_weights.keys()
    for key, w in weights.items():
        assert w.shape == (0, *full_weights[key].shape[1:]), key
