"""The Mamba-2 SSD part against the transformers Mamba-2 torch path (its chunked SSD scan, and
its single-token state update for decoding) on the same inputs."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.mamba2 import modeling_mamba2

import attnkit as ak
from attnkit.linear_family import Mamba2SSD, RecurrentCache


def _part(form="chunkwise"):
    torch.manual_seed(0)
    part = Mamba2SSD(4, 3, form=form, chunk_size=4, dtype=torch.float64)
    with torch.no_grad():
        part.D.normal_()
        part.dt_weight.normal_()
    return part


def _reference_inputs(part, q, k, v):
    """The part's head inputs in transformers' layout: x (b, L, h, p), dt before the bias and
    softplus (b, L, h), A (h), B and C with one group per head (b, L, h, n), D (h)."""
    as32 = lambda t: t.detach().float()  # noqa: E731  (the reference runs in float32)
    dt = (k @ part.dt_weight).squeeze(-1).transpose(1, 2)
    return {
        "hidden_states": as32(v.transpose(1, 2)),
        "dt": as32(dt),
        "A": as32(-torch.exp(part.A_log.flatten())),
        "B": as32(k.transpose(1, 2)),
        "C": as32(q.transpose(1, 2)),
        "D": as32(part.D.flatten()),
        "dt_bias": as32(part.dt_bias.flatten()),
    }


@pytest.mark.parametrize("form", ["parallel", "chunkwise", "recurrent"])
def test_every_form_equals_the_transformers_ssd_scan(form):
    part = _part(form)
    q, k, v = (torch.randn(2, 3, 11, 4, dtype=torch.float64) for _ in range(3))
    ref = modeling_mamba2.mamba2_chunk_scan(
        **_reference_inputs(part, q, k, v), chunk_size=4, dt_softplus=True
    )
    ours = part(q, k, v).context
    torch.testing.assert_close(ours.transpose(1, 2).float(), ref, atol=2e-5, rtol=1e-4)


def test_decoding_equals_the_transformers_state_update():
    part = _part()
    mha = ak.MultiHeadAttention(12, 3, attention=part).double().eval()
    x = torch.randn(2, 6, 12, dtype=torch.float64)
    cache = RecurrentCache()
    state = torch.zeros(2, 3, 4, 4)  # transformers: (b, h, head_dim p, state n)
    for t in range(6):
        q, k, v = mha._project(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1])
        q, k, v = (mha._split_heads(y) for y in (q, k, v))
        ref_in = _reference_inputs(part, q, k, v)
        ref = modeling_mamba2.mamba2_selective_state_update(
            state,
            ref_in["hidden_states"][:, 0],
            ref_in["dt"][:, 0, :, None].expand(2, 3, 4),  # one step per head channel
            ref_in["A"][:, None, None].expand(3, 4, 4),
            ref_in["B"][:, 0],
            ref_in["C"][:, 0],
            D=ref_in["D"][:, None].expand(3, 4),
            dt_bias=ref_in["dt_bias"][:, None].expand(3, 4),
            dt_softplus=True,
        )
        ours = part(q, k, v, cache=cache, q_offset=t).context
        torch.testing.assert_close(ours[:, :, 0].float(), ref, atol=2e-5, rtol=1e-4)
        # the same state, stored (d_k = n, d_v = p) here and (p, n) there
        torch.testing.assert_close(
            cache.state.transpose(-1, -2).float(), state, atol=2e-5, rtol=1e-4
        )


def test_the_step_size_reads_the_key():
    part = _part()
    k = torch.randn(1, 3, 5, 4, dtype=torch.float64)
    expected = F.softplus(k @ part.dt_weight + part.dt_bias)
    torch.testing.assert_close(part.steps(k), expected)
    assert (part.steps(k) > 0).all()
