"""Hard alignment (Brauwers eq. 26): samples follow softmax(e); log_prob is log a_m."""

import torch

import attnkit as ak
from attnkit import alignments as al


def test_samples_follow_the_softmax():
    torch.manual_seed(0)
    e = torch.tensor([[[1.0, 0.0, -1.0, 2.0]]]).expand(20000, 1, 4)
    mask = torch.tensor([True, True, False, True])
    out = al.Hard().train()(e, mask)
    assert ((out.weights == 0) | (out.weights == 1)).all()
    assert (out.weights.sum(-1) == 1).all()
    freq = out.weights.mean(dim=(0, 1))
    p = torch.softmax(torch.tensor([1.0, 0.0, float("-inf"), 2.0]), dim=0)
    torch.testing.assert_close(freq, p, atol=0.015, rtol=0)
    chosen = out.weights.argmax(-1)
    torch.testing.assert_close(out.log_prob, torch.log(p)[chosen])


def test_eval_takes_the_most_probable_key():
    e = torch.tensor([[[0.1, 0.7, 0.3], [2.0, -1.0, 0.0]]])
    out = al.Hard().eval()(e)
    assert out.weights.argmax(-1).tolist() == [[1, 0]]
    torch.testing.assert_close(out.log_prob, torch.log_softmax(e, -1).amax(-1))


def test_straight_through_gradient_is_the_relaxed_softmax_gradient():
    torch.manual_seed(0)
    e = torch.randn(1, 2, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 3, dtype=torch.float64)
    align = al.Hard(straight_through=True, tau=0.7).eval()
    out = align(e)
    (g,) = torch.autograd.grad((out.weights @ v).sum(), e)
    e2 = e.detach().clone().requires_grad_()
    relaxed = torch.softmax(torch.log_softmax(e2, -1) / 0.7, -1)
    (g_ref,) = torch.autograd.grad((relaxed @ v).sum(), e2)
    torch.testing.assert_close(g, g_ref)
    assert ((out.weights.detach() == 0) | (out.weights.detach() == 1)).all()


def test_reinforce_gradient_flows_through_log_prob():
    e = torch.randn(3, 2, 4, requires_grad=True)
    out = al.Hard().train()(e)
    out.log_prob.sum().backward()
    assert e.grad is not None and e.grad.abs().sum() > 0


def _nan_rows(align):
    e = torch.randn(2, 3, 5, dtype=torch.float64)
    e[0, 1, 2] = float("nan")  # an attendable key: the row is undefined
    e[1, 0, 4] = float("nan")  # a masked key: no influence
    mask = torch.ones(2, 1, 5, dtype=torch.bool)
    mask[1, :, 4] = False
    return align(e, mask)


def test_nan_in_an_attendable_score_gives_nan_not_a_finite_choice():
    for train in (False, True):
        out = _nan_rows(al.Hard().train(train))
        assert out.weights[0, 1].isnan().all() and out.log_prob[0, 1].isnan()
        rest = torch.ones(2, 3, dtype=torch.bool)
        rest[0, 1] = False
        assert torch.isfinite(out.weights[rest]).all() and torch.isfinite(out.log_prob[rest]).all()
        assert (out.weights[rest].sum(-1) == 1).all()


def test_nan_query_row_reaches_the_context_through_attention():
    q = torch.randn(1, 3, 4)
    q[0, 2, 0] = float("nan")
    out = ak.attention(q, torch.randn(1, 5, 4), align="hard", need_weights=True)
    assert out.context[0, 2].isnan().all() and torch.isfinite(out.context[0, :2]).all()
