"""Capsule-based attention against a loop from Brauwers eqs. 43-45, and its joint loss."""

import pytest
import torch
from features.batching import assert_batch_equals_items
from features.test_coattention import softmax, weighted
from helpers import assert_same_forward_backward, rand

from attnkit.queries import CapsuleAttention, capsule_loss


def test_eqs_43_to_45():
    torch.manual_seed(0)
    m = CapsuleAttention(4, 3, dtype=torch.float64)
    f = rand(2, 5, 4, seed=1)

    def loop():
        out = []
        for b in range(2):
            F = list(f[b])
            caps = []
            for c in range(3):
                ctx = weighted(softmax([m.queries[c] @ k for k in F]), F)  # eq. 43
                p = torch.sigmoid(m.w[c] @ ctx + m.b[c])  # eq. 44
                caps.append(torch.cat([p.reshape(1), p * ctx]))  # eq. 45
            out.append(torch.stack(caps))
        return torch.stack(out)

    def fast():
        o = m(f)
        return torch.cat([o.probabilities.unsqueeze(-1), o.representations], -1)

    assert_same_forward_backward(fast, loop, [f, *m.parameters()], atol=1e-12, rtol=1e-12)


def test_joint_loss_trains_the_right_capsule():
    torch.manual_seed(0)
    m = CapsuleAttention(4, 3)
    f = torch.randn(8, 5, 4)
    y = torch.randint(0, 3, (8,))
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    first = None
    for _ in range(60):
        loss = capsule_loss(m(f), f, y)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < first
    assert (m(f).probabilities.argmax(-1) == y).float().mean() > 0.7


def test_batch_equals_items_with_masks_from_lengths():
    torch.manual_seed(0)
    m = CapsuleAttention(4, 3).double()

    def run(xs, ms):
        o = m(xs[0], ms[0])
        return torch.cat([o.probabilities.unsqueeze(-1), o.representations], -1)

    assert_batch_equals_items(run, [rand(3, 5, 4, seed=1, grad=False)], [[5, 2, 1]])


def test_refuses_masks_and_features_that_do_not_fit():
    m = CapsuleAttention(4, 3)
    with pytest.raises(ValueError, match=r"mask of shape \(5,\) does not fit features"):
        m(torch.randn(3, 5, 4), torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"features has 6 features .* d_f = 4"):
        m(torch.randn(3, 5, 6))
    with pytest.raises(ValueError, match=r"features must be \(B, n, d\), got shape \(5, 4\)"):
        m(torch.randn(5, 4))
