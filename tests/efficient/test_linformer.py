"""Linformer (Wang et al. 2020): with k = N and identity projections it is softmax attention;
otherwise it is softmax(Q (EK)ᵀ/√d)(FV) (eq. 7, written out below); shared and per-head
projections; key padding honoured by zeroing before the projection; other masks, bias and
over-long inputs refused."""

from __future__ import annotations

import math

import pytest
import torch
from flag_task import flag_retrieval_accuracy

import attnkit as ak
from attnkit.efficient import Linformer

D = torch.float64


def _qkv(seed=0, lead=(2, 3), m=6, n=6, d=4, dv=5):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(*lead, m, d, generator=g, dtype=D),
        torch.randn(*lead, n, d, generator=g, dtype=D),
        torch.randn(*lead, n, dv, generator=g, dtype=D),
    )


def _reference(q, k, v, e, f):
    """Linformer eq. 7 by loops over batch items and queries (float64)."""
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=D)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in q.shape[:-2])).reshape(
        -1, q.dim() - 2
    ):
        i = tuple(idx.tolist())
        ek = (e[i[-1]] if e.dim() == 3 else e)[:, : k.shape[-2]] @ k[i]
        fv = (f[i[-1]] if f.dim() == 3 else f)[:, : k.shape[-2]] @ v[i]
        for row in range(q.shape[-2]):
            s = torch.tensor([q[i][row] @ ek[j] / math.sqrt(q.shape[-1]) for j in range(len(ek))])
            a = torch.exp(s - s.max())
            out[i][row] = (a / a.sum()).to(D) @ fv
    return out


def test_identity_projections_with_k_equal_n_give_softmax_attention():
    q, k, v = _qkv()
    part = Linformer(6, 6).to(D)
    with torch.no_grad():
        part.e_proj.copy_(torch.eye(6))
        part.f_proj.copy_(torch.eye(6))
    out = part(q, k, v, need_weights=True)
    torch.testing.assert_close(out.context, ak.attention(q, k, v).context)
    mha_ref = torch.softmax(q @ k.transpose(-1, -2) / 2, -1)
    torch.testing.assert_close(out.weights, mha_ref)


@pytest.mark.parametrize("heads", [None, 3])
def test_matches_the_papers_equation(heads):
    q, k, v = _qkv(1, m=4, n=5)
    part = Linformer(7, 3, num_heads=heads).to(D)
    ref = _reference(q, k, v, part.e_proj.detach(), part.f_proj.detach())
    torch.testing.assert_close(part(q, k, v).context, ref)


def test_per_head_projections_differ_and_shared_kv_uses_one_matrix():
    part = Linformer(5, 2, num_heads=3)
    assert part.e_proj.shape == (3, 2, 5) and not torch.equal(part.e_proj[0], part.e_proj[1])
    shared = Linformer(5, 2, share_kv=True).to(D)
    assert shared.f_proj is None and len(list(shared.parameters())) == 1
    q, k, v = _qkv(2, lead=(2,), n=5)
    e = shared.e_proj.detach()
    torch.testing.assert_close(shared(q, k, v).context, _reference(q, k, v, e, e))


def test_key_padding_equals_removing_the_keys_and_their_columns_of_e():
    """Zeroing padded keys before E is exactly E[:, real] K[real] (any padded positions)."""
    q, k, v = _qkv(3, lead=(1,), n=6)
    part = Linformer(6, 4).to(D)
    real = torch.tensor([True, False, True, True, False, True])
    out = part(q, k, v, mask=real[None, None, :])
    e, f = part.e_proj.detach()[:, real], part.f_proj.detach()[:, real]
    ref = _reference(q, k[:, real], v[:, real], e, f)
    torch.testing.assert_close(out.context, ref)


def test_padded_queries_get_zero_and_mha_slot_works():
    q, k, v = _qkv(4, lead=(2,), n=6)
    part = Linformer(8, 3).to(D)
    keep = ak.masks.from_lengths(torch.tensor([6, 4]), 6)[:, 0]
    mask = keep[:, :, None] & keep[:, None, :]  # padded self-attention (B, N, N)
    out = part(q, k, v, mask=mask, need_weights=True)
    assert (out.context[1, 4:] == 0).all() and (out.weights[1, 4:] == 0).all()
    torch.testing.assert_close(out.context[1:, :4], part(q[1:, :4], k[1:, :4], v[1:, :4]).context)
    mha = ak.MultiHeadAttention(8, 2, attention=Linformer(10, 4, num_heads=2)).to(D)
    x = torch.randn(2, 10, 8, dtype=D)
    assert mha(x, x, x).context.shape == (2, 10, 8)


def test_refuses_causal_masks_bias_and_long_inputs():
    q, k, v = _qkv(5, lead=(1,))
    part = Linformer(6, 3).to(D)
    with pytest.raises(ValueError, match="Linformer: the mask varies over queries"):
        part(q, k, v, mask=ak.masks.causal(6))
    with pytest.raises(ValueError, match="bias"):
        part(q, k, v, bias=torch.zeros(6, 6, dtype=D))
    q, k, v = _qkv(5, lead=(1,), n=7)
    with pytest.raises(ValueError, match=r"max_len=6\) got 7 keys"):
        part(q, k, v)
    with pytest.raises(ValueError, match=r"num_heads=2\) needs inputs"):
        Linformer(7, 3, num_heads=2).to(D)(q, k, v)


@pytest.mark.slow
def test_learns_flag_retrieval():
    """Inside MultiHeadAttention it learns the flag-retrieval task (chance 1/8)."""
    assert flag_retrieval_accuracy(Linformer(24, 16)) > 0.9
