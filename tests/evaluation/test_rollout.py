"""Attention rollout against a loop written from Abnar & Zuidema (2020)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.evaluation.rollout import attention_rollout, residual_weights


def _weights(layers: int, b: int = 2, h: int = 3, n: int = 4, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(torch.randn(b, h, n, n, generator=g, dtype=torch.float64), -1)
            for _ in range(layers)]  # fmt: skip


def _rollout_loop(layers, residual=0.5):
    """One batch entry, element by element: Ã_l[i][j] = r·[i = j] + (1 − r)·mean_h A_l[h][i][j],
    rows renormalised; R_1 = Ã_1, R_l[i][j] = Σ_k Ã_l[i][k] R_{l−1}[k][j]."""
    h, n = len(layers[0]), len(layers[0][0])
    aug = []
    for a in layers:
        rows = []
        for i in range(n):
            row = [residual * (i == j) + (1 - residual) * sum(a[x][i][j] for x in range(h)) / h
                   for j in range(n)]  # fmt: skip
            total = sum(row)
            rows.append([x / total for x in row])
        aug.append(rows)
    joint = aug[0]
    for a in aug[1:]:
        joint = [[sum(a[i][k] * joint[k][j] for k in range(n)) for j in range(n)]
                 for i in range(n)]  # fmt: skip
    return torch.tensor(joint, dtype=torch.float64)


@pytest.mark.parametrize(("layers", "residual"), [(1, 0.5), (3, 0.5), (4, 0.2), (2, 0.0)])
def test_rollout_equals_its_loop(layers, residual):
    weights = _weights(layers, seed=layers)
    got = attention_rollout(weights, residual=residual)
    for b in range(got.shape[0]):
        want = _rollout_loop([w[b].tolist() for w in weights], residual)
        torch.testing.assert_close(got[b], want)
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[:-1], dtype=torch.float64))


def test_all_layers_are_the_partial_products():
    weights = _weights(3)
    every = attention_rollout(weights, all_layers=True)
    assert every.shape == (3, 2, 4, 4)
    for i in range(3):
        torch.testing.assert_close(every[i], attention_rollout(weights[: i + 1]))


def test_rollout_of_a_recorded_model_equals_its_loop():
    torch.manual_seed(0)
    model = ak.TransformerEncoder(3, 8, 2, dtype=torch.float64).eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    names = [f"layers.{i}.self_attention.module.weights" for i in range(3)]
    with ak.hooks.record(model, names=names) as cache:
        model(x)
    got = ak.evaluation.attention_rollout([cache[n] for n in names])
    for b in range(2):
        want = _rollout_loop([cache[n][b].tolist() for n in names])
        torch.testing.assert_close(got[b], want)


def test_weights_without_heads_and_a_padding_row():
    a = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    (aug,) = residual_weights([a], head_dim=None)
    want = torch.tensor(
        [[0.75, 0.25, 0.0], [0.0, 1.0, 0.0], [0.1, 0.15, 0.75]], dtype=torch.float64
    )
    # The padding query's row (no weight) is its residual alone, renormalised: a row of I.
    torch.testing.assert_close(aug, want)


def test_refusals():
    w = _weights(2)
    with pytest.raises(TypeError, match="sequence of tensors"):
        attention_rollout(w[0])
    with pytest.raises(ValueError, match="residual must be in"):
        attention_rollout(w, residual=1.5)
    with pytest.raises(ValueError, match="self-attention weights"):
        attention_rollout([torch.rand(2, 3, 4, 5)])
    with pytest.raises(ValueError, match="same tokens"):
        attention_rollout([w[0], _weights(1, n=5)[0]])
    with pytest.raises(ValueError, match="head_dim=-1"):
        attention_rollout(w, head_dim=-1)
    with pytest.raises(TypeError, match="floating-point"):
        attention_rollout([torch.ones(2, 3, 4, 4, dtype=torch.long)])
