"""Gated linear attention against its recurrence written with the gates themselves (Yang et al.
2023 eqs. 3-4), in every form; and it learns multi-query associative recall."""

import math

import pytest
import torch
from mqar_task import EMBED, HEADS, recall_accuracy

import attnkit as ak
from attnkit.linear_family import GatedLinearAttention


def _reference(part, q, k, v):
    """α_t = σ(k_t W + b)^(1/τ), S_t = diag(α_t) S_{t−1} + k_tᵀ v_t, o_t = (q_t/√d) S_t."""
    alpha = torch.sigmoid(k @ part.gate_weight + part.gate_bias) ** (1 / part.tau)
    s = torch.zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[-2]):
        s = alpha[..., t, :, None] * s + k[..., t, :, None] * v[..., t, None, :]
        outs.append((q[..., t, None, :] / math.sqrt(q.shape[-1]) @ s).squeeze(-2))
    return torch.stack(outs, -2)


@pytest.mark.parametrize("form", ["parallel", "chunkwise", "recurrent"])
def test_every_form_is_the_gated_recurrence(form):
    torch.manual_seed(0)
    part = GatedLinearAttention(4, 2, tau=2.0, form=form, chunk_size=3, dtype=torch.float64)
    with torch.no_grad():
        part.gate_bias.normal_()
    q, k, v = (torch.randn(2, 2, 10, 4, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(
        part(q, k, v).context, _reference(part, q, k, v), atol=1e-12, rtol=1e-10
    )


def test_gla_learns_multi_query_associative_recall():
    def part():
        return ak.mechanisms.build("gla", head_dim=EMBED // HEADS, num_heads=HEADS)

    assert recall_accuracy(part(), steps=0) < 0.3  # chance is 1/8
    assert recall_accuracy(part(), steps=60) > 0.6
