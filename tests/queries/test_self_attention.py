"""Self-attention with Q = W_Q F (eq. 35) and the updates of eqs. 36-37."""

import math

import pytest
import torch
from helpers import rand

import attnkit as ak
from attnkit.queries import SelfAttention
from attnkit.taxonomy import describe


@pytest.mark.parametrize("update", ["replace", "residual"])
def test_eqs_35_to_37(update):
    torch.manual_seed(0)
    m = SelfAttention(4, 3, update=update, dtype=torch.float64)
    f = rand(2, 5, 4, seed=1, grad=False)
    new, _ = m(f)
    Q, K, V = f @ m.W_Q.weight.T, f @ m.W_K.weight.T, f @ m.W_V.weight.T  # eq. 35
    c = torch.softmax(Q @ K.transpose(-1, -2) / math.sqrt(3), -1) @ V
    expected = (
        c
        if update == "replace"
        else torch.nn.functional.layer_norm(f + c, (4,), m.norm.weight, m.norm.bias)
    )  # eq. 36 / 37
    torch.testing.assert_close(new, expected, atol=1e-12, rtol=1e-12)
    assert describe(m).query_type == "Self-Attentive"


def test_batch_equals_items_with_masks_from_lengths():
    torch.manual_seed(0)
    m = SelfAttention(4, 3).double()
    f = rand(3, 5, 4, seed=1, grad=False)
    lengths = [5, 2, 1]
    new, _ = m(f, ak.masks.from_lengths(torch.tensor(lengths), 5))
    for b, n in enumerate(lengths):
        torch.testing.assert_close(new[b : b + 1, :n], m(f[b : b + 1, :n])[0])


def test_refuses_two_dim_masks():
    m = SelfAttention(4)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 3\) for f of shape \(3, 3, 4\)"):
        m(torch.randn(3, 3, 4), torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"f has 5 features .* d_f = 4"):
        m(torch.randn(3, 3, 5))
