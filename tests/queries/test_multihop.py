"""Multi-hop attention against a loop from Brauwers eqs. 41-42."""

import pytest
import torch
from features.test_coattention import additive, softmax, weighted
from helpers import assert_same_forward_backward, rand

from attnkit.queries import MultiHop


@pytest.mark.parametrize("transform", ["query", "context", "both"])
@pytest.mark.parametrize("share", [True, False])
def test_eqs_41_42(transform, share):
    torch.manual_seed(0)
    m = MultiHop(3, 4, 5, hops=3, transform=transform, share_weights=share, d_w=6).double()
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

    assert_same_forward_backward(lambda: m(q0, k, v).context, loop, [q0, k, v, *m.parameters()])


def test_mask_equals_truncation():
    torch.manual_seed(0)
    m = MultiHop(3, 4, 4, hops=2).double()
    q, k = rand(2, 3, seed=1), rand(2, 6, 4, seed=2)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = m(q, k, mask=mask)
    torch.testing.assert_close(out.context[1:], m(q[1:], k[1:, :4]).context)
    assert out.contexts.shape == (2, 2, 4) and out.weights.shape == (2, 2, 6)
