"""Attention flow: maximum flows against hand-computed graphs and a brute-force minimum cut."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.evaluation.flow import attention_flow, max_flow
from attnkit.evaluation.rollout import residual_weights


def test_max_flow_of_the_textbook_network():
    # Cormen et al., Introduction to Algorithms, Fig. 26.1: s=0, v1..v4, t=5; max flow 23.
    cap = np.zeros((6, 6))
    for u, v, c in [(0, 1, 16), (0, 2, 13), (1, 3, 12), (2, 1, 4), (2, 4, 14), (3, 2, 9),
                    (3, 5, 20), (4, 3, 7), (4, 5, 4)]:  # fmt: skip
        cap[u, v] = c
    assert max_flow(cap, 0, 5) == pytest.approx(23.0)
    assert max_flow(torch.from_numpy(cap), 5, 0) == 0.0  # no edge leaves the sink


def test_two_layers_by_hand():
    # With residual 0 the capacities are the weights; between input j and output i the only
    # paths are j -> (layer 1, k) -> i, edge-disjoint: flow = sum_k min(A1[k, j], A2[i, k]).
    a1 = torch.tensor([[0.6, 0.4], [0.1, 0.9]], dtype=torch.float64)
    a2 = torch.tensor([[0.3, 0.7], [0.5, 0.5]], dtype=torch.float64)
    raw = attention_flow([a1, a2], residual=0.0, head_dim=None, normalize=False)
    # (0,0): min(.6,.3)+min(.1,.7); (0,1): min(.4,.3)+min(.9,.7);
    # (1,0): min(.6,.5)+min(.1,.5); (1,1): min(.4,.5)+min(.9,.5)
    want = torch.tensor([[0.4, 1.0], [0.6, 0.9]], dtype=torch.float64)
    torch.testing.assert_close(raw, want)
    norm = attention_flow([a1, a2], residual=0.0, head_dim=None)
    torch.testing.assert_close(norm, want / want.sum(-1, keepdim=True))


def _min_cut(cap: np.ndarray, s: int, t: int) -> float:
    """The smallest capacity of a cut separating s from t, over every node set holding s and
    not t (max-flow min-cut theorem)."""
    others = [x for x in range(cap.shape[0]) if x not in (s, t)]
    best = np.inf
    for bits in itertools.product((False, True), repeat=len(others)):
        side = np.zeros(cap.shape[0], dtype=bool)
        side[s] = True
        side[others] = bits
        best = min(best, cap[np.ix_(side, ~side)].sum())
    return float(best)


def test_three_layers_three_tokens_equal_the_brute_force_minimum_cut():
    g = torch.Generator().manual_seed(0)
    weights = [
        torch.softmax(3 * torch.randn(2, 3, 3, generator=g, dtype=torch.float64), -1)
        for _ in range(3)
    ]  # fmt: skip  (H = 2 heads, N = 3 tokens)
    raw = attention_flow(weights, normalize=False)
    layers = [a.numpy() for a in residual_weights(weights)]
    # The graph from its definition: node l*3 + t, edge (l-1, j) -> (l, i) with Ã_l[i, j].
    cap = np.zeros((12, 12))
    for lay, a in enumerate(layers, start=1):
        for i in range(3):
            for j in range(3):
                cap[(lay - 1) * 3 + j, lay * 3 + i] = a[i, j]
    for i in range(3):
        for j in range(3):
            assert raw[i, j].item() == pytest.approx(_min_cut(cap, j, 9 + i), abs=1e-12)


def test_one_layer_is_the_residual_weights_and_batches_are_items():
    g = torch.Generator().manual_seed(1)
    weights = [torch.softmax(torch.randn(3, 2, 4, 4, generator=g), -1)]
    got = attention_flow(weights)
    assert got.dtype == torch.float32 and got.shape == (3, 4, 4)
    torch.testing.assert_close(got, residual_weights(weights)[0])  # rows already sum to 1
    two = [torch.softmax(torch.randn(3, 2, 4, 4, generator=g), -1) for _ in range(2)]
    whole = attention_flow(two)
    for b in range(3):
        torch.testing.assert_close(whole[b], attention_flow([w[b] for w in two]))


def test_flow_of_a_recorded_model():
    torch.manual_seed(0)
    model = ak.TransformerEncoder(2, 8, 2).eval()
    names = [f"layers.{i}.self_attention.module.weights" for i in range(2)]
    with ak.hooks.record(model, names=names) as cache:
        model(torch.randn(1, 4, 8))
    flow = ak.evaluation.attention_flow([cache[n] for n in names])
    assert flow.shape == (1, 4, 4)
    torch.testing.assert_close(flow.sum(-1), torch.ones(1, 4))


def test_refusals():
    with pytest.raises(ValueError, match="square"):
        max_flow(np.zeros((2, 3)), 0, 1)
    with pytest.raises(ValueError, match="non-negative"):
        max_flow(np.array([[0.0, -1.0], [0.0, 0.0]]), 0, 1)
    with pytest.raises(ValueError, match="sink must be a node"):
        max_flow(np.zeros((2, 2)), 0, 2)
    with pytest.raises(ValueError, match="must differ"):
        max_flow(np.zeros((2, 2)), 1, 1)
    with pytest.raises(TypeError, match="normalize"):
        attention_flow([torch.rand(1, 1, 2, 2)], normalize=1)
