"""Random feature attention (Peng, Pappas, Yogatama, Schwartz, Smith and Kong, "Random Feature
Attention", ICLR 2021; Soydaner 5.3): softmax attention over unit-length queries and keys,
estimated with random Fourier features, with an optional recency gate in the causal form.

Random Fourier features (Rahimi and Recht 2007; RFA eq. 2): for w_i ~ N(0, σ⁻² I_d),
φ(x) = D^{−1/2} [sin(w_1·x), …, sin(w_D·x), cos(w_1·x), …, cos(w_D·x)] gives

    E[φ(x)·φ(y)] = exp(−‖x − y‖² / 2σ²),

and for unit vectors x, y this is exp(x·y/σ²)·exp(−1/σ²): proportional to softmax's kernel at
temperature σ², the constant cancelling in the normalisation (RFA eqs. 3-5). So RFA with
q̂ = q/‖q‖, k̂ = k/‖k‖ estimates softmax(q̂·k̂/σ²) attention. σ is learned, one per dimension
(w_i = ω_i / σ with fixed ω_i ~ N(0, I_d), the paper's reparameterisation). Unlike FAVOR+'s
positive features, sin/cos estimates can be negative, so weights may be (rarely, with few
features) negative and a denominator can come close to 0.

Gating (RFA eq. 7, causal only): S_t = g_t S_{t−1} + (1 − g_t) φ(k_t) v_tᵀ and
z_t = g_t z_{t−1} + (1 − g_t) φ(k_t), y_t = φ(q_t)ᵀS_t / φ(q_t)ᵀz_t, with g_t = σ(w_g·k_t + b_g).
The paper computes g_t from the layer input x_t; a per-head part sees only the head's q, k, v,
so the gate reads k_t (a linear function of x_t).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.derived import DerivedBuffers
from attnkit.efficient import kernelized as kz
from attnkit.efficient.feature_maps import attend_inputs, causal_rows, check_causal
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.kernels.base import guarded_sum
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["RandomFeatureAttention"]


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


@REGISTRY.register("rfa")
@arguments.deprecated_names(d="head_dim")
class RandomFeatureAttention(DerivedBuffers, HeadAttention):
    """RFA, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with q (B, …, M, d),
    k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        head_dim: d, the query/key size; ``d=`` is its old name, accepted with a
            DeprecationWarning until the next release.
        n_features: D, the number of random frequencies (φ has 2D entries).
        sigma: initial σ (softmax temperature σ² over unit vectors); learned per dimension.
        causal: query i attends keys j ≤ i (needs M = N).
        gate: the recency gate of RFA eq. 7 (needs ``causal=True``).
        seed: seed of the fixed frequencies ω.
        chunk_size: block length of the causal prefix sums / gated scan.

    Masks and bias as :class:`attnkit.efficient.LinearAttention`.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    # the example is causal self-attention: a padded position is padding as a query too
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("q", "k", "v")}
    # causal=True: queries after a KV cache are the last rows of the causal sequence
    takes_q_offset: ClassVar[bool] = True

    def __init__(
        self,
        head_dim: int,
        n_features: int = 128,
        *,
        sigma: float = 1.0,
        causal: bool = False,
        gate: bool = False,
        seed: int = 0,
        chunk_size: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = d = arguments.positive_int(head_dim, "head_dim")
        self.n_features = arguments.positive_int(n_features, "n_features")
        sigma = arguments.finite_float(sigma, "sigma")
        if sigma <= 0:
            raise ValueError(f"sigma must be positive, got {sigma}")
        self.causal = arguments.boolean(causal, "causal")
        self.gated = arguments.boolean(gate, "gate")
        if self.gated and not self.causal:
            raise ValueError("gate=True needs causal=True (RFA's gate decays a causal history)")
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        g = torch.Generator().manual_seed(arguments.nonnegative_int(seed, "seed"))
        kw = {"device": device, "dtype": dtype or torch.get_default_dtype()}
        omega = torch.randn(n_features, d, generator=g, dtype=torch.float64)
        self.register_derived("omega", omega, **kw)
        self.log_sigma = nn.Parameter(torch.full((d,), math.log(sigma), **kw))
        if self.gated:
            self.gate_weight = nn.Parameter(torch.zeros(d, **kw))
            self.gate_bias = nn.Parameter(torch.zeros((), **kw))
        self.align = kz.KernelNormalized()

    @property
    def decodes_with_cache(self) -> bool:
        """Causal, a decoding step over the cached keys equals its rows of the causal pass."""
        return self.causal

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 7, 4, seed=s) for s in (21, 22, 23))
        mask = masks.from_lengths(torch.tensor([7, 3]), 7)
        part = cls(4, n_features=64, sigma=1.5, causal=True, gate=True)
        with torch.no_grad():
            part.gate_weight.copy_(example_tensor(4, seed=24) / 2)
        return part, (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.AlignmentKind.SOFT]

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, n_features={self.n_features}, causal={self.causal}, "
            f"gate={self.gated}"
        )

    def features(self, x: Tensor) -> Tensor:
        """φ(x̂) (…, L, 2D) of the unit vectors x̂ = x/‖x‖ (RFA eq. 2)."""
        return self._features(x, self.log_sigma)

    def _features(self, x: Tensor, log_sigma: Tensor) -> Tensor:
        w = self.omega.to(x.dtype) / log_sigma.exp()  # w_i = ω_i / σ, per dimension
        wx = _unit(x) @ w.T
        return torch.cat([torch.sin(wx), torch.cos(wx)], -1) / math.sqrt(self.n_features)

    def gates(self, k: Tensor) -> Tensor:
        """g_t = sigmoid(w_g·k_t + b_g) (…, N, 1)."""
        return torch.sigmoid(k @ self.gate_weight[:, None] + self.gate_bias)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        q_offset: int,
    ) -> AttentionOutput:
        who = type(self).__name__
        rows = causal_rows(self, q, k, v, q_offset, mask=mask, bias=bias, need_weights=need_weights)
        if rows is not None:  # queries after a KV cache: the last rows of the causal sequence
            return rows
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if q.shape[-1] != self.head_dim:
            raise ValueError(f"{who}(head_dim={self.head_dim}) got q with {q.shape[-1]} features")
        if self.causal:
            check_causal(q, k, who)
        keep = kz.key_mask(mask, torch.Size((*lead, q.shape[-2], k.shape[-2])), who)
        if not self.gated:
            phi, m = self._features, 2 * self.n_features
            params = (self.log_sigma,)
            return attend_inputs(self, phi, phi, q, k, v, keep, need_weights, params=params, m=m)
        fq, fk = self.features(q), self.features(k)
        g = self.gates(k)
        if keep is not None:  # a padded step leaves the state as it is: g = 1, no write
            g = torch.where(keep, g, torch.ones((), dtype=g.dtype))
        context = _gated_scan(fq, fk, v, g, keep, self.chunk_size)
        weights = _gated_weights(self.align, fq, fk, g, keep) if need_weights else None
        return AttentionOutput(context, weights)


def _decay(g: Tensor) -> tuple[Tensor, Tensor]:
    """log g (…, N) and its cumulative sum c_t = Σ_{l≤t} log g_l."""
    log_g = torch.log(g.squeeze(-1))
    return log_g, log_g.cumsum(-1)


def _gated_weights(
    align: kz.KernelNormalized, fq: Tensor, fk: Tensor, g: Tensor, keep: Tensor | None
) -> Tensor:
    """Dense weights of gated RFA: a_ij ∝ φ(q_i)·φ(k_j) (1 − g_j) Π_{j<l≤i} g_l, j ≤ i."""
    fk = fk if keep is None else torch.where(keep, fk, torch.zeros((), dtype=fk.dtype))
    _, c = _decay(g)
    n = fk.shape[-2]
    tri = masks.causal(n, device=fk.device)
    diff = torch.where(tri, c.unsqueeze(-1) - c.unsqueeze(-2), -torch.inf)  # c_i − c_j
    scores = (fq @ fk.transpose(-1, -2)) * diff.exp() * (1 - g.squeeze(-1)).unsqueeze(-2)
    mask = tri if keep is None else tri & keep.transpose(-1, -2)
    return align(scores, mask).weights


def _gated_scan(
    fq: Tensor, fk: Tensor, v: Tensor, g: Tensor, keep: Tensor | None, chunk: int
) -> Tensor:
    """RFA eq. 7 by blocks: within a block the decayed pairwise sums are formed densely, the
    state of earlier blocks is carried (decayed) from block to block."""
    zero = torch.zeros((), dtype=fk.dtype)
    if keep is not None:
        fk, v = torch.where(keep, fk, zero), torch.where(keep, v, zero)
    lead = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2], g.shape[:-2])
    n = fq.shape[-2]
    fq, fk, v, g = (x.broadcast_to(*lead, n, x.shape[-1]) for x in (fq, fk, v, g))
    wk = fk * (1 - g)  # the write (1 − g_j) φ(k_j)
    s = fk.new_zeros(*lead, fk.shape[-1], v.shape[-1])
    z = fk.new_zeros(*lead, fk.shape[-1])
    out = []
    for start in range(0, n, chunk):
        sl = slice(start, min(start + chunk, n))
        c = g[..., sl, 0].log().cumsum(-1)  # decay from the block start, c_i
        tri = masks.causal(c.shape[-1], device=c.device)
        decay = torch.where(tri, c.unsqueeze(-1) - c.unsqueeze(-2), -torch.inf).exp()
        # (where, not a product with the zero decay: a later key may be NaN or infinite)
        within = torch.where(tri, (fq[..., sl, :] @ wk[..., sl, :].transpose(-1, -2)) * decay, 0)
        carried = c.exp().unsqueeze(-1)  # Π of gates since the block start
        vs = v[..., sl, :]
        if torch.compiler.is_compiling() or bool(torch.isfinite(vs).all()):
            num = carried * (fq[..., sl, :] @ s) + within @ vs
        else:
            num = carried * (fq[..., sl, :] @ s) + guarded_sum(torch.matmul, within, vs)
        den = carried * (fq[..., sl, :] @ z.unsqueeze(-1)) + within.sum(-1, keepdim=True)
        ok = den != 0
        out.append(torch.where(ok, num / torch.where(ok, den, 1), 0))
        last = c[..., -1:]
        to_end = (last - c).exp().unsqueeze(-1)  # decay from each position to the block end
        s = (
            last.exp().unsqueeze(-1) * s
            + (wk[..., sl, :] * to_end).transpose(-1, -2) @ v[..., sl, :]
        )
        z = last.exp() * z + (wk[..., sl, :] * to_end).sum(-2)
    return torch.cat(out, -2)
