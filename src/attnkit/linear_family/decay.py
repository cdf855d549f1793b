"""Linear attention with a diagonal decay of the state, in its three equal forms (shared by
retention, gated linear attention and the Mamba-2 state-space duality).

Per head, with the query already scaled, a log-decay g_t ≤ 0 that is one number per position
(shape (…, N, 1): RetNet, Mamba-2) or one per key dimension ((…, N, d_k): GLA), and the state
S (…, d_k, d_v):

- **recurrent** (decoding): S_t = diag(exp g_t) S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t;
- **parallel** (training, O(N²)): o_i = Σ_{j≤i} Σ_d q_id k_jd exp(G_id − G_jd) v_j with
  G_t = Σ_{s≤t} g_s — for a scalar decay the masked attention (QKᵀ ⊙ L) V with the
  1-semiseparable mask L_ij = exp(G_i − G_j) (Dao and Gu 2024, "structured masked attention";
  Sun et al. 2023, retention's D);
- **chunkwise** (training, O(N·C)): the parallel form inside chunks of C positions and the
  recurrence across chunk boundaries (Sun et al. 2023 eq. 7; Yang et al. 2023 §4; Dao and Gu
  2024 §6), so that the state is formed once per chunk.

Every exponent is a sum of log-decays over a segment j < t ≤ i, so it is ≤ 0 and nothing
overflows: within a chunk a difference of the chunk's cumulative sums, over longer spans (the
parallel form) the stable segment sum (:func:`segment_sum`), which subtracts no long sums. The
per-dimension decays of GLA are applied in log space within sub-chunks of :data:`SUB`
positions, and split at sub-chunk ends between them (Yang et al.'s secondary level). A later
position — even NaN or infinite — never reaches an earlier row: masked entries are selected
away, never multiplied by zero.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.inputs import broadcast_shapes
from attnkit.kernels.base import guarded_sum

__all__ = [
    "causal_matmul",
    "chunkwise",
    "log_decay_matrix",
    "mamba2_decay_parameters",
    "parallel",
    "recurrent",
    "segment_sum",
    "split_chunks",
    "tril",
    "weights",
]


# Positions per sub-chunk of the per-dimension decays (GLA) inside a chunk.
SUB = 16


def mamba2_decay_parameters(
    num_heads: int, channels: int = 1, *, device=None, dtype=None
) -> tuple[nn.Parameter, nn.Parameter]:
    """Mamba-2's initial decay of every head, g = −exp(A_log) softplus(… + b_Δ): A_log
    (H, 1, 1) with A = exp(A_log) uniform in [1, 16], and the step bias b_Δ (H, 1, channels)
    = softplus⁻¹(Δ) with Δ log-uniform in [10⁻³, 10⁻¹] (one step per channel for KDA)."""
    kw = {"device": device, "dtype": dtype}
    a = torch.empty(num_heads, 1, 1, **kw).uniform_(1, 16)
    dt = torch.empty(num_heads, 1, channels, **kw).uniform_(math.log(1e-3), math.log(1e-1)).exp()
    return nn.Parameter(a.log()), nn.Parameter(dt + torch.log(-torch.expm1(-dt)))


def tril(n: int, device=None, *, strict: bool = False) -> Tensor:
    """(n, n) boolean, True where j ≤ i (j < i when ``strict``)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_(-1 if strict else 0)


def segment_sum(g: Tensor) -> Tensor:
    """Σ_{j<t≤i} g_t for g (…, L, e): (…, L, L, e), zero where j ≥ i.

    Formed by a cumulative sum over a masked copy (the stable segsum of the Mamba-2 reference)
    rather than G_i − G_j, so that long sequences lose no precision and a non-finite g_t at a
    later position reaches no earlier (i, j)."""
    n = g.shape[-2]
    x = g.unsqueeze(-2).expand(*g.shape[:-2], n, n, g.shape[-1])  # x[t, j] = g_t
    below = tril(n, g.device, strict=True)[..., None]  # t > j
    x = torch.where(below, x, torch.zeros((), dtype=g.dtype, device=g.device))
    return x.cumsum(-3)  # [i, j] = Σ_{j<t≤i} g_t


# Up to this many positions (a chunk) the exponents are differences of cumulative sums: short
# sums lose no precision, and a cumulative sum along the positions is much cheaper than the
# segment sum's along a strided dimension.
SHORT = 64


def log_decay_matrix(g: Tensor) -> Tensor:
    """Σ_{j<t≤i} g_t (…, L, L, e) on and below the diagonal (anything above it)."""
    if g.shape[-2] > SHORT:
        return segment_sum(g)
    cum = g.cumsum(-2)
    return cum.unsqueeze(-2) - cum.unsqueeze(-3)


def causal_matmul(a: Tensor, v: Tensor) -> Tensor:
    """a @ v for a weight matrix that is zero above the diagonal, such that a NaN or infinite
    value at a later position (weight 0) does not reach earlier rows."""
    if torch.compiler.is_compiling() or bool(torch.isfinite(v).all()):
        return a @ v
    return guarded_sum(torch.matmul, a, v)


def _decay_scores(q: Tensor, k: Tensor, g: Tensor) -> Tensor:
    """A_ij = Σ_d q_id k_jd exp(G_id − G_jd) for j ≤ i, 0 above the diagonal: (…, L, L)."""
    n = q.shape[-2]
    below = tril(n, q.device)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    seg = log_decay_matrix(g)
    if g.shape[-1] == 1:  # one decay per position: (QKᵀ) ⊙ L
        decay = torch.where(below, seg.squeeze(-1), zero).exp()
        return torch.where(below, (q @ k.transpose(-1, -2)) * decay, zero)
    if n > SUB:
        return _sub_chunked_scores(q, k, g)
    decay = torch.where(below[..., None], seg, zero).exp()  # (…, L, L, d_k), ≤ 1 below
    scores = (q.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(-1)
    return torch.where(below, scores, zero)


def _sub_chunked_scores(q: Tensor, k: Tensor, g: Tensor) -> Tensor:
    """:func:`_decay_scores` for per-dimension decays over L > :data:`SUB` positions, by
    sub-chunks of SUB (the secondary level of Yang et al. 2023 §4.2): blocks on the diagonal in
    log space (SUB × SUB × d_k), the others as one matrix product per query sub-chunk I with the
    decays split at the end e of sub-chunk I − 1, q_i e^{G_i − G_e} · k_j e^{G_e − G_j}: both
    exponents ≤ 0 for j ≤ e < i, so the split is as stable as the log-space form."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], g.shape[:-2])
    n, s = q.shape[-2], SUB
    q, k, g = (split_chunks(x, lead, n, s) for x in (q, k, g))  # (…, S, s, d)
    blocks = q.shape[-3]
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    diagonal = _decay_scores(q, k, g)  # (…, S, s, s)
    cum = g.flatten(-3, -2).cumsum(-2)  # (…, L, d)
    ends = cum[..., s - 1 :: s, :][..., :-1, :]  # G_e at the end of sub-chunks 0 … S − 2
    length = blocks * s
    earlier = (
        torch.arange(length, device=q.device)
        < torch.arange(1, blocks, device=q.device)[:, None] * s
    )  # (S − 1, L): key j before query sub-chunk I
    q_split = (
        q[..., 1:, :, :]
        * (cum.unflatten(-2, (blocks, s))[..., 1:, :, :] - ends.unsqueeze(-2)).exp()
    )
    k_split = (
        k.flatten(-3, -2).unsqueeze(-3)
        * torch.where(earlier[..., None], ends.unsqueeze(-2) - cum.unsqueeze(-3), zero).exp()
    )  # (…, S − 1, L, d)
    off = torch.where(earlier[:, None, :], q_split @ k_split.transpose(-1, -2), zero)
    off = torch.cat([off.new_zeros(*off.shape[:-3], 1, s, length), off], -3)
    same = torch.eye(blocks, dtype=torch.bool, device=q.device)[:, None, :, None]
    on = diagonal.unsqueeze(-2).expand(*diagonal.shape[:-1], blocks, s)  # (…, S, s, S, s)
    scores = torch.where(same, on, off.unflatten(-1, (blocks, s)))
    return scores.flatten(-4, -3).flatten(-2, -1)[..., :n, :n]


def weights(q: Tensor, k: Tensor, g: Tensor) -> Tensor:
    """The parallel form's weights (…, N, N): o = weights @ v."""
    return _decay_scores(q, k, g)


def parallel(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> Tensor:
    """The parallel (quadratic) form from a zero state: o (…, N, d_v)."""
    return causal_matmul(_decay_scores(q, k, g), v)


def recurrent(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The recurrent form, one position at a time: (o (…, N, d_v), the last state
    (…, d_k, d_v)); ``state`` is the state before the first position (zero if None)."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], g.shape[:-2])
    s = q.new_zeros(*lead, k.shape[-1], v.shape[-1]) if state is None else state
    outs = []
    # unbind, not index per position: the backward of x[..., t, :] is a zero tensor of all of x
    for q_t, k_t, v_t, g_t in zip(
        q.unbind(-2), k.unbind(-2), v.unbind(-2), g.unbind(-2), strict=True
    ):
        s = g_t.exp().unsqueeze(-1) * s + k_t[..., :, None] * v_t[..., None, :]
        outs.append((q_t[..., :, None] * s).sum(-2))
    return torch.stack(outs, -2), s


def split_chunks(x: Tensor, lead: torch.Size, n: int, c: int) -> Tensor:
    """(…, N, e) zero-padded to a multiple of c and split: (…, N/c, c, e)."""
    x = F.pad(x.broadcast_to(*lead, n, x.shape[-1]), (0, 0, 0, -n % c))
    return x.reshape(*lead, x.shape[-2] // c, c, x.shape[-1])


def chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    chunk_size: int,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The chunkwise form: (o (…, N, d_v), the last state (…, d_k, d_v)).

    Inside each chunk the parallel form; across chunks S ← diag(exp Γ) S + ΔS with Γ the
    chunk's summed log-decay and ΔS = Σ_j (k_j ⊙ exp(G_last − G_j)) v_jᵀ, read by the next
    chunk's queries as (q_i ⊙ exp G_i)ᵀ S. Chunks need not divide N (the last is padded with
    positions that neither decay nor write)."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], g.shape[:-2])
    n = q.shape[-2]
    c = max(1, min(chunk_size, n))
    q, k, v, g = (split_chunks(x, lead, n, c) for x in (q, k, v, g))
    intra = causal_matmul(_decay_scores(q, k, g), v)
    cum = g.cumsum(-2)  # within the chunk: G_i − G_start ≤ 0
    after = cum[..., -1:, :] - cum  # Σ_{j<t≤last} g_t within the chunk, ≤ 0
    k_end = k * after.exp()
    writes = k_end.transpose(-1, -2) @ v  # (…, chunks, d_k, d_v)
    through = cum[..., -1, :].exp().unsqueeze(-1)  # (…, chunks, e, 1): a whole chunk's decay
    s = q.new_zeros(*lead, k.shape[-1], v.shape[-1]) if state is None else state
    before = []
    # unbind once rather than index per chunk: the backward of writes[..., i, :, :] is a zero
    # tensor of the whole of writes, which would make the loop's backward O((N/C)²·d_k·d_v).
    for decay_i, write_i in zip(through.unbind(-3), writes.unbind(-3), strict=True):
        before.append(s)
        s = decay_i * s + write_i
    inter = (q * cum.exp()) @ torch.stack(before, -3)
    out = (intra + inter).flatten(-3, -2)[..., :n, :]
    return out, s
