"""Retention against the paper's parallel form written out (Sun et al. 2023 eqs. 5 and 8) with
torch's group_norm, in every form."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnkit.linear_family import Retention
from attnkit.linear_family.retention import retention_decays


def test_decays_are_one_minus_two_to_the_minus_five_minus_h():
    torch.testing.assert_close(
        retention_decays(3),
        torch.tensor([1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128], dtype=torch.float64),
    )


def _reference(q, k, v, gammas, norm_weight, norm_bias, eps):
    """(QKᵀ/√d ⊙ D) V with D_nm = γ^(n−m) (n ≥ m), then GroupNorm with the heads as groups."""
    b, h, n, d = q.shape
    i = torch.arange(n)
    power = (i[:, None] - i[None, :]).clamp(min=0).double()
    d_mat = gammas.view(h, 1, 1) ** power * (i[:, None] >= i[None, :])
    y = ((q @ k.transpose(-1, -2)) / math.sqrt(d) * d_mat) @ v  # (B, H, N, d_v)
    if norm_weight is None:
        return y
    flat = y.permute(0, 2, 1, 3).reshape(b * n, h * d)  # channels grouped by head
    normed = F.group_norm(flat, h, norm_weight.flatten(), norm_bias.flatten(), eps)
    return normed.reshape(b, n, h, d).permute(0, 2, 1, 3)


@pytest.mark.parametrize("form", ["parallel", "chunkwise", "recurrent"])
@pytest.mark.parametrize("group_norm", [True, False])
def test_every_form_is_the_papers_retention(form, group_norm):
    torch.manual_seed(0)
    part = Retention(4, 3, group_norm=group_norm, form=form, chunk_size=5, dtype=torch.float64)
    if group_norm:
        with torch.no_grad():
            part.norm_weight.uniform_(0.5, 1.5)
            part.norm_bias.normal_()
    q, k, v = (torch.randn(2, 3, 12, 4, dtype=torch.float64) for _ in range(3))
    weight = part.norm_weight if group_norm else None
    bias = part.norm_bias if group_norm else None
    ref = _reference(q, k, v, retention_decays(3), weight, bias, part.eps)
    torch.testing.assert_close(part(q, k, v).context, ref, atol=1e-10, rtol=1e-8)
