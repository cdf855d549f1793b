"""The delta rule: DeltaNet (Schlag, Irie and Schmidhuber 2021, "Linear Transformers Are Secretly
Fast Weight Programmers"; Yang, Wang, Zhang, Shen and Kim 2024, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length") and Gated DeltaNet (Yang, Kautz and
Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule").

Per head, with the state S (d_k × d_v, read as o_t = Sᵀ q_t) the rule writes the value v_t at
the key k_t by correcting what S already returns there, with strength β_t ∈ (0, 1):

    S_t = S_{t−1} − β_t k_t (S_{t−1}ᵀ k_t − v_t)ᵀ = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,

and the gated rule first decays the state by α_t = exp(g_t) ∈ (0, 1):
S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ (Yang et al. 2024b, eq. 10).

Chunkwise (Yang et al. 2024a §3, the WY representation): inside a chunk starting from S_0,
the corrections δ_t = β_t (v_t − α_t S_{t−1}ᵀ k_t) solve a unit lower-triangular system
(I + L) δ = β ⊙ (V − diag(e^G) K S_0) with L_tj = β_t e^{G_t − G_j} k_t·k_j (j < t), so
δ = U − W S_0 with U = T(β V), W = T(β e^G K), T = (I + L)⁻¹; then
o_t = e^{G_t} S_0ᵀ q_t + Σ_{j≤t} e^{G_t − G_j} (q_t·k_j) δ_j and the chunk's last state is
e^{G_C} S_0 + Σ_j e^{G_C − G_j} k_j δ_jᵀ. The parallel form is the same with one chunk and
S_0 = 0: o = (QKᵀ ⊙ Γ) T diag(β) V — quadratic weights, one triangular solve.

Keys and queries are L2-normalised per head (Yang et al. 2024a §3.3: the rule is stable for
‖k‖ = 1 and β ∈ (0, 1)) and the query scaled by d_k^−1/2. β_t = σ(w_β · k_t + b_β) and, for the
gated rule, g_t = −exp(A_log) softplus(w_g · k_t + b_g) (Mamba-2's decay) read the head's raw
key, as a per-head part does not see the layer input. The SiLU feature map and the short
convolutions of the papers' layers act on the layer's projections and are left to the layer.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.linear_family.base import Inputs, LinearFamilyPart
from attnkit.linear_family.decay import (
    causal_matmul,
    log_decay_matrix,
    mamba2_decay_parameters,
    split_chunks,
    tril,
)

__all__ = [
    "DeltaNet",
    "GatedDeltaNet",
    "delta_chunkwise",
    "delta_parallel",
    "delta_recurrent",
    "delta_weights",
    "l2_normalize",
]


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(‖x‖² + eps) over the last dim (0 stays 0)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The (gated) delta rule one position at a time: (o (…, N, d_v), the last state).

    Args:
        q, k: (…, N, d_k); v: (…, N, d_v); beta, g: (…, N, 1) (g = 0 for the plain rule).
        state: S (…, d_k, d_v) before the first position, zero if None.
    """
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], g.shape[:-2])
    s = q.new_zeros(*lead, k.shape[-1], v.shape[-1]) if state is None else state
    outs = []
    # unbind, not index per position: the backward of x[..., t, :] is a zero tensor of all of x
    per_position = (x.unbind(-2) for x in (q, k, v, beta, g))
    for q_t, k_t, v_t, beta_t, g_t in zip(*per_position, strict=True):
        kt = k_t[..., :, None]
        s = g_t[..., :, None].exp() * s
        delta = beta_t * (v_t - (s * kt).sum(-2))
        s = s + kt * delta.unsqueeze(-2)
        outs.append((q_t[..., :, None] * s).sum(-2))
    return torch.stack(outs, -2), s


def _within(q: Tensor, k: Tensor, beta: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Inside blocks of L positions: (I + L) (…, L, L) of the WY system and the causal
    q·k weights (QKᵀ ⊙ Γ) (…, L, L)."""
    n = q.shape[-2]
    below, strict = tril(n, q.device), tril(n, q.device, strict=True)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    decay = torch.where(below, log_decay_matrix(g).squeeze(-1), zero).exp()  # Γ_tj = e^{G_t − G_j}
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    system = eye + torch.where(strict, beta * (k @ k.transpose(-1, -2)) * decay, zero)
    scores = torch.where(below, (q @ k.transpose(-1, -2)) * decay, zero)
    return system, scores


def _solve(system: Tensor, rhs: Tensor) -> Tensor:
    """T rhs = (I + L)⁻¹ rhs by forward substitution (row t reads rows < t only)."""
    return torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)


def delta_weights(q: Tensor, k: Tensor, beta: Tensor, g: Tensor) -> Tensor:
    """The parallel form's weights W (…, N, N), o = W v from a zero state:
    W = (QKᵀ ⊙ Γ) (I + L)⁻¹ diag(β)."""
    system, scores = _within(q, k, beta, g)
    eye = torch.eye(q.shape[-2], dtype=q.dtype, device=q.device)
    lead = broadcast_shapes(system.shape[:-2], beta.shape[:-2])
    return causal_matmul(scores, _solve(system.broadcast_to(*lead, *system.shape[-2:]), beta * eye))


def delta_parallel(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> Tensor:
    """The parallel form from a zero state: o = (QKᵀ ⊙ Γ) (I + L)⁻¹ (β ⊙ V) (…, N, d_v), one
    triangular solve against the values (O(N² d_v), the weights never formed)."""
    system, scores = _within(q, k, beta, g)
    lead = broadcast_shapes(system.shape[:-2], beta.shape[:-2], v.shape[:-2])
    rhs = (beta * v).broadcast_to(*lead, *v.shape[-2:])
    return causal_matmul(scores, _solve(system.broadcast_to(*lead, *system.shape[-2:]), rhs))


def delta_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
    chunk_size: int,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The chunkwise form with the WY representation: (o (…, N, d_v), the last state). Chunks
    need not divide N (the last is padded with positions that neither decay nor write)."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], beta.shape[:-2], g.shape[:-2])
    n = q.shape[-2]
    c = max(1, min(chunk_size, n))
    q, k, v, beta, g = (split_chunks(x, lead, n, c) for x in (q, k, v, beta, g))
    system, scores = _within(q, k, beta, g)
    cum = g.cumsum(-2)  # G_t from the chunk's start, ≤ 0
    u = _solve(system, beta * v)
    w = _solve(system, beta * cum.exp() * k)
    q_start = q * cum.exp()
    k_end = k * (cum[..., -1:, :] - cum).exp()
    through = cum[..., -1:, :].exp()  # (…, chunks, 1, 1)
    s = q.new_zeros(*lead, k.shape[-1], v.shape[-1]) if state is None else state
    outs = []
    # One unbind per tensor, not an index per chunk: the backward of x[..., i, :, :] is a
    # zero tensor of x's whole size, which would make the loop's backward O(N²/C).
    per_chunk = (x.unbind(-3) for x in (u, w, q_start, scores, k_end, through))
    for u_i, w_i, q_i, scores_i, k_i, decay_i in zip(*per_chunk, strict=True):
        delta = u_i - w_i @ s
        outs.append(q_i @ s + causal_matmul(scores_i, delta))
        s = decay_i * s + k_i.transpose(-1, -2) @ delta
    out = torch.stack(outs, -3).flatten(-3, -2)[..., :n, :]
    return out, s


@REGISTRY.register("deltanet")
class DeltaNet(LinearFamilyPart):
    """DeltaNet as a per-head part (see :class:`LinearFamilyPart` for the call).

    Args:
        head_dim: d_k (q and k are L2-normalised, q then scaled by d_k^−1/2).
        num_heads: H, each with its own β = σ(w_β · k + b_β).
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
        super().__init__(head_dim, num_heads, form=form, chunk_size=chunk_size)
        kw = {"device": device, "dtype": dtype}
        self.beta_weight = nn.Parameter(torch.randn(num_heads, head_dim, 1, **kw) / head_dim)
        self.beta_bias = nn.Parameter(torch.zeros(num_heads, 1, 1, **kw))

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.AlignmentKind.SOFT]

    def strengths(self, k: Tensor) -> Tensor:
        """β_t = σ(w_β · k_t + b_β) (…, H, N, 1)."""
        return torch.sigmoid(k @ self.beta_weight.to(k.dtype) + self.beta_bias.to(k.dtype))

    def log_decays(self, k: Tensor) -> Tensor:
        """g_t (…, H, N, 1): 0, the plain rule does not decay."""
        return torch.zeros_like(k[..., :1])

    def prepare(self, q: Tensor, k: Tensor, v: Tensor) -> Inputs:
        q = l2_normalize(q) / math.sqrt(self.head_dim)
        return Inputs(q, l2_normalize(k), v, self.log_decays(k), self.strengths(k))

    def run(self, x: Inputs, form: str, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        beta = x.beta
        if form == "parallel":
            return delta_parallel(x.q, x.k, x.v, beta, x.g), None
        if form == "recurrent":
            return delta_recurrent(x.q, x.k, x.v, beta, x.g, state)
        return delta_chunkwise(x.q, x.k, x.v, beta, x.g, self.chunk_size, state)

    def dense_weights(self, x: Inputs) -> Tensor:
        return delta_weights(x.q, x.k, x.beta, x.g)


@REGISTRY.register("gated_deltanet")
class GatedDeltaNet(DeltaNet):
    """Gated DeltaNet as a per-head part: DeltaNet whose state first decays by
    α_t = exp(−exp(A_log) softplus(w_g · k_t + b_g)) (initialised as Mamba-2's Δ and A)."""

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
        self.A_log, self.dt_bias = mamba2_decay_parameters(num_heads, **kw)
        self.dt_weight = nn.Parameter(torch.randn(num_heads, head_dim, 1, **kw) / head_dim)

    def log_decays(self, k: Tensor) -> Tensor:
        """g_t = −exp(A_log) softplus(w_g · k_t + b_g) (…, H, N, 1), < 0."""
        dt = F.softplus(k @ self.dt_weight.to(k.dtype) + self.dt_bias.to(k.dtype))
        return -torch.exp(self.A_log.to(k.dtype)) * dt
