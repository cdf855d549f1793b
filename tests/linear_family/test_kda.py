"""Kimi Delta Attention against its rule written with the matrices of the paper
(S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ, Kimi Linear eq. 1) in every form,
forward and gradients; against transformers' torch KDA kernels (chunked and recurrent) on the
same inputs; it reduces to the gated delta rule when the channels share a decay; later
non-finite positions reach no earlier row; padding equals truncation; decoding from the state
equals the causal pass; and it learns multi-query associative recall."""

import math

import pytest
import torch
import torch.nn.functional as F
from mqar_task import EMBED, HEADS, recall_accuracy
from transformers.models.kimi_linear import modeling_kimi_linear as kimi

import attnkit as ak
from attnkit.linear_family import KimiDeltaAttention, RecurrentCache, kda
from attnkit.linear_family import deltanet as dn

D = torch.float64
FORMS = ["parallel", "chunkwise", "recurrent"]


def _qkv(b=2, h=2, n=11, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g, dtype=D) for _ in range(3))


def _part(form="chunkwise", chunk_size=3, seed=0):
    torch.manual_seed(seed)
    part = KimiDeltaAttention(4, 2, form=form, chunk_size=chunk_size, dtype=D)
    with torch.no_grad():
        part.A_log.fill_(0.0)  # decays that matter over a dozen steps
        part.dt_bias.normal_()
        part.dt_weight.normal_(0, 0.5)
        part.beta_bias.normal_()
    return part


def _rule(q, k, v, beta, alpha):
    """The rule one position at a time with explicit matrices: S_t = (I − β k kᵀ) Diag(α_t)
    S_{t−1} + β k vᵀ, o_t = S_tᵀ q_t (S d_k × d_v); q, k already normalised and scaled."""
    s = torch.zeros(*q.shape[:-2], k.shape[-1], v.shape[-1], dtype=q.dtype)
    eye = torch.eye(k.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[-2]):
        kt = k[..., t, :, None]
        b = beta[..., t, :, None]
        s = (eye - b * kt @ kt.transpose(-1, -2)) @ torch.diag_embed(alpha[..., t, :]) @ s
        s = s + b * kt @ v[..., t, None, :]
        outs.append((q[..., t, None, :] @ s).squeeze(-2))
    return torch.stack(outs, -2), s


def _paper(part, q, k, v):
    """The part's rule from its parameters: α = exp(−e^{A_log} softplus(k W_f + b_f)) and
    β = σ(w_β · k + b_β) from the raw key, q and k L2-normalised (ε inside the root, as
    flash-linear-attention), q scaled by d^−1/2."""
    alpha = torch.exp(-torch.exp(part.A_log) * F.softplus(k @ part.dt_weight + part.dt_bias))
    beta = torch.sigmoid(k @ part.beta_weight + part.beta_bias)
    qn = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() / math.sqrt(q.shape[-1])
    kn = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    return _rule(qn, kn, v, beta, alpha)


@pytest.mark.parametrize("form", FORMS)
def test_every_form_is_the_papers_rule(form):
    part = _part(form)
    q, k, v = _qkv()
    ref, _ = _paper(part, q, k, v)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(part(q, k, v).context, ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_equal_the_rules(form):
    part = _part(form)
    q, k, v = (x.requires_grad_() for x in _qkv(n=9, seed=4))
    weight = torch.linspace(-1, 1, 2 * 2 * 9 * 4, dtype=D).view(2, 2, 9, 4)
    leaves = [q, k, v, *part.parameters()]
    ours = torch.autograd.grad((part(q, k, v).context * weight).sum(), leaves)
    ref = torch.autograd.grad((_paper(part, q, k, v)[0] * weight).sum(), leaves)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_gradcheck_of_the_chunkwise_kernel():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 5, 2, generator=g, dtype=D) for _ in range(3))
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(1, 1, 5, 1, generator=g, dtype=D)
    lg = -torch.rand(1, 1, 5, 2, generator=g, dtype=D)
    s0 = torch.randn(1, 1, 2, 2, generator=g, dtype=D)
    xs = [x.requires_grad_() for x in (q, k, v, beta, lg, s0)]

    def fn(*xs):
        return kda.kda_chunkwise(*xs[:5], 2, xs[5])

    assert torch.autograd.gradcheck(fn, xs)


def _gates(part, k):
    """g (B, L, H, d_k) and β (B, L, H) as transformers' kernels take them."""
    g = -torch.exp(part.A_log) * F.softplus(k @ part.dt_weight + part.dt_bias)
    beta = torch.sigmoid(k @ part.beta_weight + part.beta_bias)
    return g.transpose(1, 2), beta.squeeze(-1).transpose(1, 2)


@pytest.mark.parametrize("form", FORMS)
def test_equals_the_transformers_kda_kernels(form):
    part = _part(form)
    q, k, v = _qkv(seed=1)
    g, beta = _gates(part, k)
    inputs = [t.transpose(1, 2).detach().float() for t in (q, k, v)]
    kw = {"g": g.detach().float(), "beta": beta.detach().float(), "output_final_state": True}
    chunked, chunk_state = kimi.chunk_kimi_delta_attention(
        *inputs, chunk_size=4, use_qk_l2norm_in_kernel=True, **kw
    )
    stepped, step_state = kimi.recurrent_kimi_delta_attention(
        *inputs, initial_state=None, use_qk_l2norm_in_kernel=True, **kw
    )
    ours = part(q, k, v).context.transpose(1, 2)
    cache = RecurrentCache()
    part(q, k, v, cache=cache)  # the state after the sequence, (B, H, d_k, d_v) as theirs
    for ref, state in ((chunked, chunk_state), (stepped, step_state)):  # float32 references
        torch.testing.assert_close(ours.float(), ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(cache.state.float(), state, atol=2e-5, rtol=1e-4)


def test_one_decay_for_all_channels_is_the_gated_delta_rule():
    q, k, v = _qkv(n=13, seed=5)
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.rand(2, 2, 13, 1, dtype=D, generator=torch.Generator().manual_seed(0))
    g = -torch.rand(2, 2, 13, 1, dtype=D, generator=torch.Generator().manual_seed(1))
    ref, ref_state = dn.delta_chunkwise(q, k, v, beta, g, 4)
    ours, state = kda.kda_chunkwise(q, k, v, beta, g.expand(-1, -1, -1, 4), 5)
    torch.testing.assert_close(ours, ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(state, ref_state, atol=1e-12, rtol=1e-10)


def test_the_channels_decay_apart():
    """A channel whose decay is 0 at a step forgets only its own row of the state."""
    q, k, v = _qkv(b=1, h=1, n=6, seed=6)
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.full((1, 1, 6, 1), 0.5, dtype=D)
    g = torch.zeros(1, 1, 6, 4, dtype=D)
    g[..., 5, 0] = -1e4  # channel 0 forgets everything at the last step
    _, state = kda.kda_recurrent(q, k, v, beta, g)
    _, before = kda.kda_recurrent(*(x[..., :5, :] for x in (q, k, v, beta, g)))
    decayed = before.clone()
    decayed[..., 0, :] = 0
    k5, v5 = k[..., 5, :, None], v[..., 5, None, :]
    step = decayed + 0.5 * k5 @ (v5 - k5.transpose(-1, -2) @ decayed)
    torch.testing.assert_close(state, step, atol=1e-12, rtol=1e-10)
    assert before[..., 1:, :].abs().min() > 0 and (state[..., 1:, :] != before[..., 1:, :]).all()


@pytest.mark.parametrize("plant", [float("nan"), float("inf")])
def test_a_later_non_finite_position_reaches_no_earlier_row(plant):
    q, k, v = _qkv(n=9, seed=3)
    beta = torch.rand(2, 2, 9, 1, dtype=D)
    g = -torch.rand(2, 2, 9, 4, dtype=D)
    k = k / k.norm(dim=-1, keepdim=True)
    clean = kda.kda_recurrent(q, k, v, beta, g)[0]
    bad = [x.clone() for x in (q, k, v, beta, g)]
    for x in bad:
        x[..., 6:, :] = plant
    for out in (
        kda.kda_parallel(*bad),
        kda.kda_chunkwise(*bad, 4)[0],
        kda.kda_recurrent(*bad)[0],
    ):
        torch.testing.assert_close(out[..., :6, :], clean[..., :6, :], atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_padding_equals_truncation_and_decoding_equals_the_causal_pass(form):
    part = _part(form, chunk_size=4)
    q, k, v = _qkv(b=3, n=10, seed=7)
    lengths = [10, 7, 3]
    pad = ak.masks.from_lengths(torch.tensor(lengths), 10)[:, None]  # (B, 1, 1, N)
    full = part(q, k, v, mask=pad).context
    for i, n in enumerate(lengths):
        alone = part(q[i : i + 1, :, :n], k[i : i + 1, :, :n], v[i : i + 1, :, :n]).context
        torch.testing.assert_close(full[i : i + 1, :, :n], alone, atol=1e-12, rtol=1e-10)
        assert (full[i, :, n:] == 0).all()
    whole = part(q, k, v).context
    cache = RecurrentCache()
    steps = [part(q[..., :5, :], k[..., :5, :], v[..., :5, :], cache=cache).context]
    for t in range(5, 10):
        step = (x[..., t : t + 1, :] for x in (q, k, v))
        steps.append(part(*step, q_offset=t, cache=cache).context)
    torch.testing.assert_close(torch.cat(steps, -2), whole, atol=1e-12, rtol=1e-10)
    assert cache.state.shape == (3, 2, 4, 4) and len(cache) == 10


def test_kda_learns_multi_query_associative_recall():
    def part():  # chunks of 16: the per-channel decays make chunks of 64 slow on short tasks
        return ak.mechanisms.build("kda", head_dim=EMBED // HEADS, num_heads=HEADS, chunk_size=16)

    assert recall_accuracy(part(), steps=0) < 0.3  # chance is 1/8
    assert recall_accuracy(part(), steps=60) > 0.9  # 0.997 or more when measured


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="head_dim"):
        KimiDeltaAttention(0, 2)
    with pytest.raises(ValueError, match="form must be one of"):
        KimiDeltaAttention(4, 2, form="quadratic")
    part = KimiDeltaAttention(4, 2, dtype=D)
    q, k, v = _qkv(h=3)
    with pytest.raises(ValueError, match=r"parameters for 2 heads of size 4"):
        part(q, k, v)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="need_weights must be False"):
        part(q, k, v, need_weights=True, cache=RecurrentCache())
    window = ak.masks.causal(11) & ~ak.masks.causal(11).tril(-3)  # a sliding window
    with pytest.raises(ValueError, match="varies over queries"):
        part(q, k, v, mask=window)
