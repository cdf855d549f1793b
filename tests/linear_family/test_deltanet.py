"""DeltaNet against the delta rule written in the papers' layout (S d_v × d_k,
S_t = S_{t−1} − β_t (S_{t−1} k_t − v_t) k_tᵀ), Gated DeltaNet against the transformers torch
fallbacks of the gated delta rule (Qwen3-Next: chunked and recurrent) on the same inputs, every
form; DeltaNet learns multi-query associative recall."""

import math

import pytest
import torch
import torch.nn.functional as F
from mqar_task import EMBED, HEADS, recall_accuracy
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

import attnkit as ak
from attnkit.linear_family import DeltaNet, GatedDeltaNet, RecurrentCache
from attnkit.linear_family import deltanet as dn

FORMS = ["parallel", "chunkwise", "recurrent"]


def _qkv(h=2, n=11, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))


def _delta_rule(part, q, k, v):
    """The rule per head, one position at a time, with the state as a d_v × d_k matrix."""
    beta = torch.sigmoid(k @ part.beta_weight + part.beta_bias)  # from the raw key
    # ‖·‖ with ε = 1e-6 inside the root, as the flash-linear-attention kernels
    q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt() / math.sqrt(q.shape[-1])
    k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    s = torch.zeros(*q.shape[:-2], v.shape[-1], k.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[-2]):
        kt, vt = k[..., t, :, None], v[..., t, :, None]
        s = s - beta[..., t, :, None] * (s @ kt - vt) @ kt.transpose(-1, -2)
        outs.append((s @ q[..., t, :, None]).squeeze(-1))
    return torch.stack(outs, -2)


@pytest.mark.parametrize("form", FORMS)
def test_deltanet_is_the_delta_rule(form):
    torch.manual_seed(0)
    part = DeltaNet(4, 2, form=form, chunk_size=3, dtype=torch.float64)
    with torch.no_grad():
        part.beta_bias.normal_()
    q, k, v = _qkv()
    ref = _delta_rule(part, q, k, v)
    torch.testing.assert_close(part(q, k, v).context, ref, atol=1e-12, rtol=1e-10)


def _gates(part, k):
    """g_t = −exp(A_log) softplus(w_g · k_t + b_g) and β_t, (B, L, H) as transformers takes."""
    g = -torch.exp(part.A_log) * F.softplus(k @ part.dt_weight + part.dt_bias)
    beta = torch.sigmoid(k @ part.beta_weight + part.beta_bias)
    return g.squeeze(-1).transpose(1, 2), beta.squeeze(-1).transpose(1, 2)


def _gated_part(form="chunkwise"):
    torch.manual_seed(0)
    part = GatedDeltaNet(4, 2, form=form, chunk_size=3, dtype=torch.float64)
    with torch.no_grad():
        part.A_log.fill_(0.0)  # decays that matter over a dozen steps
        part.dt_bias.normal_()
        part.beta_bias.normal_()
    return part


@pytest.mark.parametrize("form", FORMS)
def test_gated_deltanet_equals_the_transformers_gated_delta_rule(form):
    part = _gated_part(form)
    q, k, v = _qkv(seed=1)
    g, beta = _gates(part, k)
    inputs = [t.transpose(1, 2).detach().float() for t in (q, k, v)]
    inputs += [g.detach().float(), beta.detach().float()]
    chunked, chunk_state = qwen3_next.torch_chunk_gated_delta_rule(
        *inputs, chunk_size=4, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    stepped, step_state = qwen3_next.torch_recurrent_gated_delta_rule(
        *inputs, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ours = part(q, k, v).context.transpose(1, 2)
    for ref in (chunked, stepped):  # float32 references
        torch.testing.assert_close(ours.float(), ref, atol=2e-5, rtol=1e-4)
    cache = RecurrentCache()
    part(q, k, v, cache=cache)  # the state after the sequence, (B, H, d_k, d_v) as theirs
    for ref in (chunk_state, step_state):
        torch.testing.assert_close(cache.state.float(), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("plant", [float("nan"), float("inf")])
def test_a_later_non_finite_position_reaches_no_earlier_row(plant):
    q, k, v = _qkv(n=9, seed=3)
    beta = torch.rand(2, 2, 9, 1, dtype=torch.float64)
    g = -torch.rand(2, 2, 9, 1, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True)
    clean = dn.delta_recurrent(q, k, v, beta, g)[0]
    bad = [x.clone() for x in (q, k, v, beta, g)]
    for x in bad:
        x[..., 6:, :] = plant
    for out in (
        dn.delta_parallel(*bad),
        dn.delta_weights(*[bad[i] for i in (0, 1, 3, 4)])
        @ torch.where(torch.arange(9)[:, None] < 6, bad[2], 0),
        dn.delta_chunkwise(*bad, 4)[0],
        dn.delta_recurrent(*bad)[0],
    ):
        torch.testing.assert_close(out[..., :6, :], clean[..., :6, :], atol=1e-12, rtol=1e-10)


def test_the_gate_decays_the_state():
    part = _gated_part()
    q, k, v = _qkv(n=8, seed=2)
    assert (part.log_decays(k) < 0).all()
    with torch.no_grad():
        part.A_log.fill_(-30.0)  # α ≈ 1: the plain delta rule
    plain = DeltaNet(4, 2, dtype=torch.float64)
    plain.load_state_dict(part.state_dict(), strict=False)
    torch.testing.assert_close(part(q, k, v).context, plain(q, k, v).context, atol=1e-9, rtol=1e-7)


def test_deltanet_learns_multi_query_associative_recall():
    def part():
        return ak.mechanisms.build("deltanet", head_dim=EMBED // HEADS, num_heads=HEADS)

    assert recall_accuracy(part(), steps=0) < 0.3  # chance is 1/8
    assert recall_accuracy(part(), steps=60) > 0.6


def _elements_computed(step) -> int:
    """The elements of every tensor the aten operators produce while ``step`` runs (forward and
    backward): a count of the work that does not depend on the machine's load."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.total += sum(x.numel() for x in tree_leaves(out) if isinstance(x, torch.Tensor))
            return out

    with Count():
        step()
    return Count.total


def _gated_rule(q, k, v, beta, g):
    """S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t, one position at a
    time (Yang et al. 2024b eq. 10) with S as a d_k × d_v matrix."""
    s = torch.zeros(*q.shape[:-2], k.shape[-1], v.shape[-1], dtype=q.dtype)
    eye = torch.eye(k.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[-2]):
        kt = k[..., t, :, None]
        b = beta[..., t, :, None]
        s = g[..., t, :, None].exp() * (eye - b * kt @ kt.transpose(-1, -2)) @ s
        s = s + b * kt @ v[..., t, None, :]
        outs.append((q[..., t, None, :] @ s).squeeze(-2))
    return torch.stack(outs, -2)


@pytest.mark.parametrize("form", ["chunkwise", "recurrent"])
def test_a_training_step_grows_linearly_in_the_length(form):
    """A forward and backward of the gated chunkwise (recurrent) form at 4N computes 4× the
    elements of one at N (O(N·C) at a fixed chunk size; O(N) steps), and its gradients equal
    those of the rule at many chunks."""

    def step(n, rule):
        gen = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(1, 2, n, 4, generator=gen, dtype=torch.float64) for _ in range(3))
        k = k / k.norm(dim=-1, keepdim=True)
        beta = torch.rand(1, 2, n, 1, generator=gen, dtype=torch.float64)
        g = -torch.rand(1, 2, n, 1, generator=gen, dtype=torch.float64)
        xs = [x.requires_grad_() for x in (q, k, v, beta, g)]
        out = rule(*xs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out).double()).sum().backward()
        return [x.grad for x in xs]

    def ours(*xs):
        if form == "chunkwise":
            return dn.delta_chunkwise(*xs, 4)[0]
        return dn.delta_recurrent(*xs)[0]

    small, large = (_elements_computed(lambda n=n: step(n, ours)) for n in (128, 512))
    assert large / small < 4.4, f"{large / small:.2f}× the elements for 4× the length"
    for a, b in zip(step(61, ours), step(61, _gated_rule), strict=True):  # 16 chunks of 4
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
