"""Lightning attention against its recurrence (S_t = λ S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t) and
against Lightning Attention-2's masked quadratic form [(Q Kᵀ) ⊙ M] V, in every form and at
several block sizes, forward and gradients; its decays are MiniMax's slopes; padding equals
truncation; decoding from the state equals the causal pass; and it learns multi-query
associative recall."""

import math

import pytest
import torch
from mqar_task import EMBED, HEADS, recall_accuracy

import attnkit as ak
from attnkit.linear_family import LightningAttention, RecurrentCache
from attnkit.linear_family.lightning import lightning_slopes

D = torch.float64
FORMS = ["parallel", "chunkwise", "recurrent"]


def _qkv(b=2, h=4, n=13, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=D) for _ in range(3))


def _recurrence(q, k, v, lam):
    """S_t = λ_h S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t, one position at a time; lam (H,)."""
    s = torch.zeros(*q.shape[:-2], k.shape[-1], v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[-2]):
        s = lam.view(-1, 1, 1) * s + k[..., t, :, None] @ v[..., t, None, :]
        outs.append((q[..., t, None, :] @ s).squeeze(-2))
    return torch.stack(outs, -2)


def _quadratic(q, k, v, lam):
    """[(Q Kᵀ) ⊙ M] V with M_ts = λ^(t−s) for t ≥ s, 0 above."""
    n = q.shape[-2]
    i = torch.arange(n)
    power = (i[:, None] - i[None, :]).clamp(min=0).to(D)
    m = lam.view(-1, 1, 1) ** power * (i[:, None] >= i[None, :])
    return (q @ k.transpose(-1, -2) * m) @ v


def _decays(h, layer_idx=0, num_layers=1):
    """λ_h = exp(−2^(−8(h+1)/H) (1 − l/(L − 1 + 1e-5) + 1e-5)), written out."""
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return torch.tensor([math.exp(-(2 ** (-8 * (j + 1) / h)) * factor) for j in range(h)], dtype=D)


def test_slopes_are_minimax_s():
    from transformers.models.minimax import modeling_minimax as mm

    cfg = mm.MiniMaxConfig(hidden_size=24, num_attention_heads=6, num_hidden_layers=5)
    for layer in (0, 2, 4):
        ref = mm.MiniMaxLightningAttention(cfg, layer).get_slope_rate().flatten()
        torch.testing.assert_close(lightning_slopes(6, layer, 5).float(), ref)
    torch.testing.assert_close(lightning_slopes(4, 1, 3), -_decays(4, 1, 3).log())
    with pytest.raises(ValueError, match="layer_idx"):
        lightning_slopes(4, 3, 3)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_every_form_is_the_recurrence_and_the_quadratic_form(form, chunk_size):
    part = LightningAttention(4, 4, layer_idx=1, num_layers=3, form=form, chunk_size=chunk_size)
    part = part.double()
    q, k, v = _qkv()
    lam = _decays(4, 1, 3)
    ref = _recurrence(q, k, v, lam)
    torch.testing.assert_close(_quadratic(q, k, v, lam), ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(part(q, k, v).context, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_equal_the_recurrences(form):
    part = LightningAttention(4, 4, form=form, chunk_size=3, dtype=D)
    q, k, v = (x.requires_grad_() for x in _qkv(n=9, seed=4))
    weight = torch.linspace(-1, 1, 2 * 4 * 9 * 4, dtype=D).view(2, 4, 9, 4)
    ours = torch.autograd.grad((part(q, k, v).context * weight).sum(), (q, k, v))
    ref = torch.autograd.grad((_recurrence(q, k, v, _decays(4)) * weight).sum(), (q, k, v))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_padding_equals_truncation_and_decoding_equals_the_causal_pass(form):
    part = LightningAttention(4, 4, form=form, chunk_size=4, dtype=D)
    q, k, v = _qkv(b=3, n=10, seed=7)
    lengths = [10, 7, 3]
    pad = ak.masks.from_lengths(torch.tensor(lengths), 10)[:, None]  # (B, 1, 1, N)
    full = part(q, k, v, mask=pad).context
    for i, n in enumerate(lengths):
        alone = _recurrence(*(x[i : i + 1, :, :n] for x in (q, k, v)), _decays(4))
        torch.testing.assert_close(full[i : i + 1, :, :n], alone, atol=1e-12, rtol=1e-10)
        assert (full[i, :, n:] == 0).all()
    whole = _recurrence(q, k, v, _decays(4))
    cache = RecurrentCache()
    steps = [part(q[..., :5, :], k[..., :5, :], v[..., :5, :], cache=cache).context]
    for t in range(5, 10):
        step = (x[..., t : t + 1, :] for x in (q, k, v))
        steps.append(part(*step, q_offset=t, cache=cache).context)
    torch.testing.assert_close(torch.cat(steps, -2), whole, atol=1e-12, rtol=1e-10)
    assert cache.state.shape == (3, 4, 4, 4) and len(cache) == 10


def test_lightning_learns_multi_query_associative_recall():
    def part():
        return ak.mechanisms.build("lightning", head_dim=EMBED // HEADS, num_heads=HEADS)

    assert recall_accuracy(part(), steps=0) < 0.3  # chance is 1/8
    assert recall_accuracy(part(), steps=60) > 0.9  # 0.997 or more when measured


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="layer_idx must be one of the num_layers = 2"):
        LightningAttention(4, 2, layer_idx=2, num_layers=2)
    with pytest.raises(ValueError, match="num_layers"):
        LightningAttention(4, 2, num_layers=0)
    with pytest.raises(ValueError, match="num_heads"):
        LightningAttention(4, 0)
    part = LightningAttention(4, 4, dtype=D)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"need 13 keys"):
        part(q, k[..., :5, :], v[..., :5, :])
    window = ak.masks.causal(13) & ~ak.masks.causal(13).tril(-3)  # a sliding window
    with pytest.raises(ValueError, match="varies over queries"):
        part(q, k, v, mask=window)
