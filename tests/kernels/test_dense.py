"""The dense kernel against loops from Brauwers eqs. 2-4 and, multi-dimensional, eqs. 30-32."""

import torch
from helpers import assert_same_forward_backward, rand

from attnkit import alignments as al
from attnkit import scores as sc
from attnkit.kernels import dense


def test_multi_dimensional_attention_eqs_30_to_32():
    torch.manual_seed(0)
    score = sc.Additive(4, 5, 6, d_out=3).double()
    q, k, v = rand(2, 3, 4, seed=1), rand(2, 7, 5, seed=2), rand(2, 7, 3, seed=3)

    def loop():
        out = torch.zeros(2, 3, 3, dtype=torch.float64)
        rows = []
        for b in range(2):
            for m in range(3):
                e = [
                    score.w.weight
                    @ torch.tanh(
                        score.W1.weight @ q[b, m] + score.W2.weight @ k[b, l] + score.W2.bias
                    )
                    for l in range(7)
                ]  # eq. 31
                c = []
                for i in range(3):
                    den = sum(torch.exp(e[j][i]) for j in range(7))
                    a = [torch.exp(e[l][i]) / den for l in range(7)]  # eq. 32
                    c.append(sum(a[l] * v[b, l, i] for l in range(7)))  # eq. 30
                rows.append(torch.stack(c))
        return out + torch.stack(rows).reshape(2, 3, 3)

    assert_same_forward_backward(
        lambda: dense.attend(q, k, v, score, al.Softmax()).context,
        loop,
        [q, k, v, *score.parameters()],
    )


def test_single_dimensional_eqs_2_to_4():
    q, k, v = rand(2, 3, 4, seed=1), rand(2, 7, 4, seed=2), rand(2, 7, 3, seed=3)

    def loop():
        rows = []
        for b in range(2):
            for m in range(3):
                e = [q[b, m] @ k[b, l] for l in range(7)]  # eq. 2
                den = sum(torch.exp(x) for x in e)
                a = [torch.exp(x) / den for x in e]  # eq. 3 (softmax, eq. 25)
                rows.append(sum(a[l] * v[b, l] for l in range(7)))  # eq. 4
        return torch.stack(rows).reshape(2, 3, 3)

    assert_same_forward_backward(
        lambda: dense.attend(q, k, v, sc.Dot(), al.Softmax()).context, loop, [q, k, v]
    )
