"""The model's own score for swap_attention: s · qᵀk with the model's scaling, one instance per
scale."""

from __future__ import annotations

import torch

from attnkit.integrations import transformers_score as hf_score


def test_model_scaled_dot_is_the_scaled_product_of_each_pair():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, dtype=torch.float64, generator=g)
    k = torch.randn(2, 5, 4, dtype=torch.float64, generator=g)
    score = hf_score.model_score(0.3, 4)
    e = score(q, k)
    for b in range(2):
        for i in range(3):
            for j in range(5):
                ref = 0.3 * sum(float(q[b, i, t] * k[b, j, t]) for t in range(4))
                assert abs(float(e[b, i, j]) - ref) < 1e-12
    assert hf_score.model_score(None, 16).fixed_scale == 0.25  # 1/√d without the model's scaling
    assert hf_score.model_score(0.3, 4) is score  # one instance per scale
    assert not list(score.parameters()) and not list(score.buffers())
