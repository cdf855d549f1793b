"""Universal Transformer with ACT: one step equals one layer, the halting weights against a loop
over Graves' definitions (N, remainder, ponder cost), weights summing to 1 per position, the
fixed-depth form, and the shared layer."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.models.universal import UniversalTransformer, timestep_embedding

D = torch.float64


def _timing(t, d):
    return torch.tensor(
        [
            math.sin(t / 10000 ** (c / d)) if c % 2 == 0 else math.cos(t / 10000 ** ((c - 1) / d))
            for c in range(d)
        ],
        dtype=D,
    )


def test_timestep_embedding_is_the_sinusoid_at_t():
    for t in (1, 3):
        torch.testing.assert_close(timestep_embedding(t, 6, dtype=D), _timing(t, 6))
    assert timestep_embedding(2, 5, dtype=D).shape == (5,)


def test_act_with_one_step_equals_one_layer():
    torch.manual_seed(0)
    ut = UniversalTransformer(8, 2, 16, max_steps=5, threshold=0.0, dtype=D)
    x = torch.randn(2, 4, 8, dtype=D)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])[:, None]
    out = ut(x, mask)
    torch.testing.assert_close(out.output, ut.layer(x + _timing(1, 8), mask))
    want = torch.zeros(2, 4, 5, dtype=D)
    want[..., 0] = 1
    torch.testing.assert_close(out.halting_weights, want)
    torch.testing.assert_close(out.steps, torch.ones(2, 4, dtype=D))
    torch.testing.assert_close(out.ponder_cost, torch.full((2, 4), 2.0, dtype=D))  # N + R = 1 + 1


def test_act_against_a_loop_over_graves_definitions():
    torch.manual_seed(1)
    t_max = 4
    ut = UniversalTransformer(8, 2, 16, max_steps=t_max, threshold=0.9, dtype=D)
    with torch.no_grad():  # halting probabilities that spread the positions over several steps
        ut.halt.weight.normal_(0, 1.0)
        ut.halt.bias.fill_(-1.0)
    x = torch.randn(2, 5, 8, dtype=D)
    out = ut(x)
    states, s = [], x
    for t in range(1, t_max + 1):  # every step for every position
        s = ut.layer(s + _timing(t, 8))
        states.append(s)
    seen_steps = set()
    for b in range(2):
        for i in range(5):
            hs = [torch.sigmoid(ut.halt(st[b, i])).item() for st in states]
            total, p = 0.0, [0.0] * t_max
            for n in range(t_max):  # N = min{n : Σ_{t ≤ n} h_t ≥ 1 − ε}, at most T
                if total + hs[n] >= 0.9 or n == t_max - 1:
                    p[n] = 1 - total  # the remainder R
                    big_n, rest = n + 1, 1 - total
                    break
                p[n] = hs[n]
                total += hs[n]
            seen_steps.add(big_n)
            torch.testing.assert_close(out.halting_weights[b, i], torch.tensor(p, dtype=D))
            ref = sum(p[t] * states[t][b, i] for t in range(t_max))
            torch.testing.assert_close(out.output[b, i], ref)
            assert out.steps[b, i].item() == big_n
            torch.testing.assert_close(out.ponder_cost[b, i].item(), big_n + rest)
    assert len(seen_steps) > 1  # the positions halted at different steps


def test_halting_weights_sum_to_one_and_ponder_cost_has_gradients():
    torch.manual_seed(2)
    ut = UniversalTransformer(8, 2, max_steps=6, dtype=D)
    x = torch.randn(3, 7, 8, dtype=D)
    out = ut(x)
    torch.testing.assert_close(out.halting_weights.sum(-1), torch.ones(3, 7, dtype=D))
    assert (out.halting_weights >= 0).all()
    out.ponder_cost.mean().backward()
    assert ut.halt.weight.grad.abs().sum() > 0


def test_fixed_depth_applies_the_one_shared_layer_t_times():
    torch.manual_seed(3)
    ut = UniversalTransformer(8, 2, 16, max_steps=3, halting=False, dtype=D)
    x = torch.randn(2, 4, 8, dtype=D)
    ref = x
    for t in (1, 2, 3):
        ref = ut.layer(ref + _timing(t, 8))
    out = ut(x)
    torch.testing.assert_close(out.output, ref)
    assert out.halting_weights is None
    n_layer = sum(p.numel() for p in ut.layer.parameters())
    assert sum(p.numel() for p in ut.parameters()) == n_layer  # one layer, shared


def test_errors():
    with pytest.raises(ValueError, match="threshold"):
        UniversalTransformer(8, 2, threshold=1.5)
    with pytest.raises(ValueError, match=r"\(B, N, 8\)"):
        UniversalTransformer(8, 2)(torch.randn(2, 3, 4))
