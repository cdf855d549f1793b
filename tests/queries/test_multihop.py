"""Multi-hop attention against a loop from Brauwers eqs. 41-42."""

import pytest
import torch
from features.batching import assert_batch_equals_items
from features.test_coattention import additive, softmax, weighted
from helpers import assert_same_forward_backward, rand

from attnkit.queries import MultiHop


@pytest.mark.parametrize("transform", ["query", "context", "both"])
@pytest.mark.parametrize("share", [True, False])
def test_eqs_41_42(transform, share):
    torch.manual_seed(0)
    m = MultiHop(
        3, 4, 5, hops=3, transform=transform, share_weights=share, d_w=6, dtype=torch.float64
    )
    q0, k, v = rand(2, 3, seed=1), rand(2, 6, 4, seed=2), rand(2, 6, 5, seed=3)

    def loop():
        rows = []
        for b in range(2):
            K, V = list(k[b]), list(v[b])
            q, c = q0[b], sum(V) / len(V)  # c⁽⁰⁾
            for s in range(3):
                i = 0 if share else s
                x = {"query": q, "context": c, "both": torch.cat([q, c])}[transform]
                lin = m.transforms[i]
                q = torch.tanh(lin.weight @ x + lin.bias)  # eq. 41
                qc = torch.cat([q, c])
                c = weighted(softmax([additive(m.attentions[i].score, qc, kk) for kk in K]), V)
            rows.append(c)
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: m(q0, k, v).context, loop, [q0, k, v, *m.parameters()], atol=1e-12, rtol=1e-12
    )


def test_mask_equals_truncation():
    torch.manual_seed(0)
    m = MultiHop(3, 4, 4, hops=2).double()
    q, k = rand(2, 3, seed=1), rand(2, 6, 4, seed=2)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = m(q, k, mask=mask)
    torch.testing.assert_close(out.context[1:], m(q[1:], k[1:, :4]).context)
    assert out.contexts.shape == (2, 2, 4) and out.weights.shape == (2, 2, 6)


def test_batch_equals_items_with_masks_from_lengths():
    torch.manual_seed(0)
    m = MultiHop(3, 4, 5, hops=2).double()
    q, k, v = rand(3, 3, seed=1), rand(3, 6, 4, seed=2), rand(3, 6, 5, seed=3)
    assert_batch_equals_items(
        lambda xs, ms: m(xs[0], xs[1], xs[2], ms[1]).context,
        [q.detach(), k.detach(), v.detach()],
        [None, [6, 2, 1], [6, 2, 1]],
    )


def test_refuses_masks_and_inputs_that_do_not_fit():
    m = MultiHop(3, 4, 4)
    q, k = torch.randn(3, 3), torch.randn(3, 6, 4)
    with pytest.raises(ValueError, match=r"mask of shape \(1, 6\) does not fit keys"):
        m(q, k, mask=torch.ones(1, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"query must be \(B, d\), got shape \(3, 1, 3\)"):
        m(q.unsqueeze(1), k)
    with pytest.raises(ValueError, match=r"keys has batch size 2 .* query has 3"):
        m(q, k[:2])
