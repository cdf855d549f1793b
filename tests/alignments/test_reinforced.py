"""Reinforced alignment (Shen et al.): Bernoulli subset, softmax inside it, REINFORCE log_prob."""

import torch
import torch.nn.functional as F
from alignments.test_softmax import softmax_row

from attnkit import alignments as al


def test_softmax_inside_the_sampled_subset_and_log_prob():
    torch.manual_seed(0)
    align = al.Reinforced(scale=1.5, bias=0.2, dtype=torch.float64).train()
    e = torch.randn(4, 3, 6, dtype=torch.float64)
    mask = torch.ones(4, 1, 6, dtype=torch.bool)
    mask[0, :, 4:] = False
    out = align(e, mask)
    kept = out.weights > 0
    logits = 1.5 * e + 0.2  # the float64 parameters hold 1.5 and 0.2 exactly as given
    for i in range(4):
        for m in range(3):
            allowed = (kept[i, m] & mask[i, 0]).tolist()
            torch.testing.assert_close(
                out.weights[i, m], softmax_row(e[i, m], allowed, m), atol=1e-12, rtol=1e-12
            )
            # Σ over attendable keys of log P(z_l) for the observed choice.
            lp = sum(
                (F.logsigmoid(logits[i, m, j]) if kept[i, m, j] else F.logsigmoid(-logits[i, m, j]))
                for j in range(6)
                if mask[i, 0, j]
            )
            torch.testing.assert_close(out.log_prob[i, m], lp, atol=1e-12, rtol=1e-12)
    assert not kept[0, :, 4:].any()


def test_the_best_key_is_always_kept():
    align = al.Reinforced(bias=-50.0).eval()  # the policy keeps nothing on its own
    e = torch.randn(2, 3, 5)
    w = align(e).weights
    assert (w.argmax(-1) == e.argmax(-1)).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3))


def test_eval_keeps_keys_with_positive_policy_logit():
    align = al.Reinforced().eval()
    e = torch.tensor([[[1.0, -1.0, 0.5, -0.2]]])
    w = align(e).weights
    assert ((w > 0) == torch.tensor([True, False, True, False])).all()


def test_nan_in_an_attendable_score_gives_nan_rows_in_training_and_eval():
    for train in (False, True):
        align = al.Reinforced().double().train(train)
        e = torch.randn(2, 3, 5, dtype=torch.float64)
        e[0, 1, 2] = float("nan")
        e[1, 0, 4] = float("nan")  # masked: no influence
        mask = torch.ones(2, 1, 5, dtype=torch.bool)
        mask[1, :, 4] = False
        out = align(e, mask)
        assert out.weights[0, 1].isnan().all() and out.log_prob[0, 1].isnan()
        rest = torch.ones(2, 3, dtype=torch.bool)
        rest[0, 1] = False
        assert torch.isfinite(out.weights[rest]).all() and torch.isfinite(out.log_prob[rest]).all()
        torch.testing.assert_close(out.weights[rest].sum(-1), torch.ones(5, dtype=torch.float64))


def test_parameters_are_created_in_the_dtype_asked():
    align = al.Reinforced(scale=0.1, bias=-0.3, dtype=torch.float64)
    assert align.scale.dtype == torch.float64 and float(align.scale.detach()) == 0.1
    assert float(align.bias.detach()) == -0.3
    assert al.Reinforced().double().scale.dtype == torch.float64
    assert al.Reinforced(device="meta").bias.device.type == "meta"
