"""Rotatory attention against a loop from Brauwers eqs. 17-20, and its multi-hop form."""

import pytest
import torch
from features.batching import assert_batch_equals_items
from features.test_coattention import softmax, weighted
from helpers import assert_same_forward_backward, rand

from attnkit.features import RotatoryAttention


def act_general(score, q, k):
    return torch.tanh(k @ score.W.weight @ q + score.b)


@pytest.mark.parametrize("hops", [1, 3])
@pytest.mark.parametrize("share", [True, False])
def test_eqs_17_to_20(hops, share):
    torch.manual_seed(0)
    m = RotatoryAttention(4, 4, 4, hops=hops, share_weights=share, dtype=torch.float64)
    left, target, right = rand(2, 5, 4, seed=1), rand(2, 3, 4, seed=2), rand(2, 6, 4, seed=3)

    def loop():
        rows = []
        for b in range(2):
            L, T, R = list(left[b]), list(target[b]), list(right[b])
            ql = qr = sum(T) / len(T)  # eq. 17
            for hop in range(hops):
                mods = m.rounds[min(hop, len(m.rounds) - 1)]
                sc = {k: mods[k].score for k in mods}
                r_l = weighted(softmax([act_general(sc["left"], ql, k) for k in L]), L)  # eq. 18
                r_r = weighted(softmax([act_general(sc["right"], qr, k) for k in R]), R)
                r_lt = weighted(softmax([act_general(sc["target_left"], r_l, k) for k in T]), T)
                r_rt = weighted(softmax([act_general(sc["target_right"], r_r, k) for k in T]), T)
                ql, qr = r_lt, r_rt
            rows.append(torch.cat([r_l, r_r, r_lt, r_rt]))  # eq. 20
        return torch.stack(rows)

    assert_same_forward_backward(
        lambda: m(left, target, right).representation,
        loop,
        [left, target, right, *m.parameters()],
        atol=1e-12,
        rtol=1e-12,
    )


def test_masks_equal_truncation():
    torch.manual_seed(0)
    m = RotatoryAttention(4, 4, 4, hops=2).double()
    left, target, right = rand(2, 5, 4, seed=1), rand(2, 3, 4, seed=2), rand(2, 6, 4, seed=3)
    ml = torch.tensor([[True] * 5, [True] * 2 + [False] * 3])
    mt = torch.tensor([[True] * 3, [True] + [False] * 2])
    mr = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    out = m(left, target, right, ml, mt, mr).representation
    for b in range(2):
        nl, nt, nr = int(ml[b].sum()), int(mt[b].sum()), int(mr[b].sum())
        alone = m(left[b : b + 1, :nl], target[b : b + 1, :nt], right[b : b + 1, :nr])
        torch.testing.assert_close(out[b : b + 1], alone.representation)


def test_hops_need_matching_sizes():
    with pytest.raises(ValueError, match="d_t == d_l"):
        RotatoryAttention(4, 5, 4, hops=2)
    with pytest.raises(ValueError, match="hops"):
        RotatoryAttention(4, 4, 4, hops=0)


def test_batch_equals_items_with_masks_from_lengths():
    torch.manual_seed(0)
    m = RotatoryAttention(4, 4, 4, hops=2).double()
    xs = [rand(3, 5, 4, seed=1, grad=False), rand(3, 3, 4, seed=2), rand(3, 6, 4, seed=3)]
    assert_batch_equals_items(
        lambda x, ms: m(*x, *ms).representation,
        [x.detach() for x in xs],
        [[5, 2, 1], [3, 1, 2], [4, 6, 1]],
    )


def test_refuses_masks_and_inputs_that_do_not_fit():
    m = RotatoryAttention(4, 4, 4)
    left, target, right = torch.randn(3, 5, 4), torch.randn(3, 3, 4), torch.randn(3, 6, 4)
    with pytest.raises(ValueError, match=r"mask_target of shape \(1, 3\) does not fit target"):
        m(left, target, right, None, torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"right has 5 features .* d_r = 4"):
        m(left, target, torch.randn(3, 6, 5))
    with pytest.raises(ValueError, match=r"target has batch size 2"):
        m(left, target[:2], right)
