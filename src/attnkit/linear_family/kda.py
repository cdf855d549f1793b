"""Kimi Delta Attention (KDA; Kimi Team 2025, "Kimi Linear: An Expressive, Efficient Attention
Architecture"): the gated delta rule whose decay is per key channel instead of per head.

Per head, with the state S (d_k × d_v, read as o_t = Sᵀ q_t), a fine-grained decay
α_t = exp(g_t) ∈ (0, 1)^(d_k) and the writing strength β_t ∈ (0, 1) (Kimi Linear eq. 1):

    S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} + β_t k_t v_tᵀ,

i.e. the state first decays row by row (row d by α_td), then the delta rule corrects what the
decayed state returns at k_t towards v_t. This is the order of the paper and of transformers'
``recurrent_kimi_delta_attention`` (decay, then δ_t = β_t (v_t − (Diag(α_t) S_{t−1})ᵀ k_t),
then S_t = Diag(α_t) S_{t−1} + k_t δ_tᵀ). With one α per head it is Gated DeltaNet
(:mod:`attnkit.linear_family.deltanet`).

Chunkwise (the WY representation of :mod:`attnkit.linear_family.deltanet` with per-channel
decays): inside a chunk starting from S_0, with G_t = Σ_{s≤t} g_s (per channel, from the chunk's
start), the corrections solve (I + L) δ = β ⊙ (V − (K ⊙ e^G) S_0) with
L_tj = β_t Σ_d k_td k_jd e^{G_td − G_jd} (j < t), so δ = U − W S_0 with U = T(β V) and
W = T(β K ⊙ e^G), T = (I + L)⁻¹; then o_t = (q_t ⊙ e^{G_t})ᵀ S_0 + Σ_{j≤t} A_tj δ_j with
A_tj = Σ_d q_td k_jd e^{G_td − G_jd}, and the chunk's last state is
Diag(e^{G_C}) S_0 + Σ_j (k_j ⊙ e^{G_C − G_j}) δ_jᵀ. Every exponent is ≤ 0; the per-channel
matrices A and L are formed by :func:`attnkit.linear_family.decay.weights` (in log space inside
sub-chunks, split at sub-chunk ends between them). The parallel form is one chunk from S_0 = 0.

As a per-head part (:class:`KimiDeltaAttention`), q and k are L2-normalised and q scaled by
d_k^−1/2 (as the Kimi Linear layer does), and the decay and strength read the head's raw key,
as a per-head part does not see the layer input: g_t = −exp(A_log) softplus(k_t W_f + b_f) with
W_f (d_k × d_k) per head, and β_t = σ(w_β · k_t + b_β). The layer of the paper reads both from
the layer input x_t (g_t through a rank-d_k projection W_f^b W_f^a x_t); that layer, with its
short convolution and gated output norm, is :class:`attnkit.mixers.KimiDeltaAttentionMixer`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.linear_family import decay
from attnkit.linear_family.base import Inputs
from attnkit.linear_family.decay import causal_matmul, split_chunks, tril
from attnkit.linear_family.deltanet import DeltaNet, delta_recurrent

__all__ = [
    "KimiDeltaAttention",
    "kda_chunkwise",
    "kda_parallel",
    "kda_recurrent",
    "kda_weights",
]


def kda_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """KDA one position at a time: (o (…, N, d_v), the last state (…, d_k, d_v)).

    Args:
        q, k: (…, N, d_k); v: (…, N, d_v); beta: (…, N, 1); g: the log-decays (…, N, d_k), ≤ 0
            (row d of the state decays by exp(g_td)).
        state: S (…, d_k, d_v) before the first position, zero if None.
    """
    # the delta rule's step decays the state by exp(g_t) broadcast over its rows: one number
    # per row (key channel) is KDA's fine-grained decay
    return delta_recurrent(q, k, v, beta, g, state)


def _within(q: Tensor, k: Tensor, beta: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Inside blocks of L positions: the WY system I + L (…, L, L) and the decayed causal q·k
    weights A (…, L, L), with per-channel decays."""
    n = q.shape[-2]
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    both = decay.weights(torch.stack(torch.broadcast_tensors(q, k)), k, g)  # one pass for q, k
    scores, keys = both.unbind(0)
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    system = eye + torch.where(tril(n, q.device, strict=True), beta * keys, zero)
    return system, scores


def _solve(system: Tensor, rhs: Tensor) -> Tensor:
    """(I + L)⁻¹ rhs by forward substitution (row t reads rows < t only)."""
    lead = broadcast_shapes(system.shape[:-2], rhs.shape[:-2])
    return torch.linalg.solve_triangular(
        system.broadcast_to(*lead, *system.shape[-2:]),
        rhs.broadcast_to(*lead, *rhs.shape[-2:]),
        upper=False,
        unitriangular=True,
    )


def kda_weights(q: Tensor, k: Tensor, beta: Tensor, g: Tensor) -> Tensor:
    """The parallel form's weights W (…, N, N), o = W v from a zero state: W = A (I + L)⁻¹
    diag(β)."""
    system, scores = _within(q, k, beta, g)
    eye = torch.eye(q.shape[-2], dtype=q.dtype, device=q.device)
    return causal_matmul(scores, _solve(system, beta * eye))


def kda_parallel(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> Tensor:
    """The parallel form from a zero state: o = A (I + L)⁻¹ (β ⊙ V) (…, N, d_v), one
    triangular solve against the values."""
    system, scores = _within(q, k, beta, g)
    return causal_matmul(scores, _solve(system, beta * v))


def kda_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    chunk_size: int,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The chunkwise form with the WY representation and per-channel decays: (o (…, N, d_v),
    the last state (…, d_k, d_v)). Arguments as :func:`kda_recurrent`; chunks need not divide
    N (the last is padded with positions that neither decay nor write)."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], beta.shape[:-2], g.shape[:-2])
    n = q.shape[-2]
    c = max(1, min(chunk_size, n))
    q, k, v, beta, g = (split_chunks(x, lead, n, c) for x in (q, k, v, beta, g))
    system, scores = _within(q, k, beta, g)
    cum = g.cumsum(-2)  # G_t from the chunk's start, ≤ 0 per channel
    u = _solve(system, beta * v)
    w = _solve(system, beta * cum.exp() * k)
    q_start = q * cum.exp()
    k_end = k * (cum[..., -1:, :] - cum).exp()
    through = cum[..., -1, :].exp().unsqueeze(-1)  # (…, chunks, d_k, 1): a row's decay
    s = q.new_zeros(*lead, k.shape[-1], v.shape[-1]) if state is None else state
    outs = []
    # one unbind per tensor, not an index per chunk (an index's backward is a zero tensor of
    # the whole input, which would make the loop's backward O(N²/C))
    per_chunk = (x.unbind(-3) for x in (u, w, q_start, scores, k_end, through))
    for u_i, w_i, q_i, scores_i, k_i, decay_i in zip(*per_chunk, strict=True):
        delta = u_i - w_i @ s
        outs.append(q_i @ s + causal_matmul(scores_i, delta))
        s = decay_i * s + k_i.transpose(-1, -2) @ delta
    out = torch.stack(outs, -3).flatten(-3, -2)[..., :n, :]
    return out, s


@REGISTRY.register("kda")
class KimiDeltaAttention(DeltaNet):
    """Kimi Delta Attention as a per-head part (see :class:`LinearFamilyPart` for the call and
    the module docstring for the rule).

    Args:
        head_dim: d_k (q and k are L2-normalised, q then scaled by d_k^−1/2).
        num_heads: H, each with its own β = σ(w_β · k + b_β) and per-channel decay
            g = −exp(A_log) softplus(k W_f + b_f) (A_log and b_f initialised as Mamba-2's A
            and Δ).
        form, chunk_size: as :class:`LinearFamilyPart`; the parallel form solves one N × N
            triangular system.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        *,
        form: str = "chunkwise",
        chunk_size: int = 64,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(
            head_dim, num_heads, form=form, chunk_size=chunk_size, device=device, dtype=dtype
        )
        kw = {"device": device, "dtype": dtype}
        self.A_log, self.dt_bias = decay.mamba2_decay_parameters(num_heads, head_dim, **kw)
        self.dt_weight = nn.Parameter(torch.randn(num_heads, head_dim, head_dim, **kw) / head_dim)

    def log_decays(self, k: Tensor) -> Tensor:
        """g_t = −exp(A_log) softplus(k_t W_f + b_f) (…, H, N, d_k), < 0."""
        dt = F.softplus(k @ self.dt_weight.to(k.dtype) + self.dt_bias.to(k.dtype))
        return -torch.exp(self.A_log.to(k.dtype)) * dt

    def run(self, x: Inputs, form: str, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        if form == "parallel":
            return kda_parallel(x.q, x.k, x.v, x.beta, x.g), None
        if form == "recurrent":
            return kda_recurrent(x.q, x.k, x.v, x.beta, x.g, state)
        return kda_chunkwise(x.q, x.k, x.v, x.beta, x.g, self.chunk_size, state)

    def dense_weights(self, x: Inputs) -> Tensor:
        return kda_weights(x.q, x.k, x.beta, x.g)
