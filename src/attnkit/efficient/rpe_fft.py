"""Kernelized attention with relative positional encoding computed by FFT (Luo, Li, Cai, He,
Wang, Ke, Zheng and Liu, "Stable, Fast and Accurate: Kernelized Attention with Relative
Positional Encoding", NeurIPS 2021; Soydaner 5.3).

Softmax attention with a relative position bias b_{j−i} weighs value j for query i by
exp(q_i·k_j/√d + b_{j−i}) = exp(q_i·k_j/√d) · c_{j−i}, c_r = exp(b_r). With a kernel
φ(q)·φ(k) for the first factor (e.g. Performer's positive random features):

    y_i = Σ_j c_{j−i} φ(q_i)ᵀφ(k_j) v_j / Σ_j c_{j−i} φ(q_i)ᵀφ(k_j)
        = φ(q_i)ᵀ [C U]_i / φ(q_i)ᵀ [C Φ_K]_i,   U_j = φ(k_j) v_jᵀ,

where C (M × N, C_ij = c_{j−i}) is a Toeplitz matrix. A Toeplitz matrix times a sequence is a
convolution, computed by FFT in O((M + N) log(M + N)) per column (Luo et al. sec. 3.2), so the
cost is O(N log N · m · d_v) for m features instead of the O(N² · d) of the dense product.

``causal=True`` sets c_r = 0 for r > 0 (query i sees keys j ≤ i): the same FFT, exact up to
its rounding (an output's gradient w.r.t. a later input is ~1e-16 of the others in float64,
not exactly 0 as with prefix sums). Key
padding masks (…, 1, N) drop the padded keys from both sums; a mask that varies over queries is
refused (the sums are shared by all queries). Before exponentiating, max_r b_r is subtracted from
b (a common factor of numerator and denominator). The FFT runs in float32 for half-precision
inputs (``torch.fft`` has no bfloat16).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.efficient import kernelized as kz
from attnkit.efficient.feature_maps import make_feature_map
from attnkit.efficient.performer import Performer
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.kernels.base import guarded_sum
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["RelativeKernelAttention", "toeplitz_dense", "toeplitz_fft"]


def toeplitz_fft(c: Tensor, u: Tensor, m: int) -> Tensor:
    """[C U]_i = Σ_j c_{j−i} u_j for i < m, by FFT.

    Args:
        c: (…, m + N − 1) the coefficients c_r for r = −(m−1) … N−1, in that order.
        u: (…, N, F) the sequence.
        m: the number of output rows.

    Returns:
        (…, m, F). A NaN or infinite entry of ``u`` reaches only the rows that give it a
        non-zero coefficient (computed then by the direct product). With g_s = c_{s−(m−1)}
        and ũ the reversed sequence, [C U]_i is entry
        m + N − 2 − i of the linear convolution g * ũ; a circular convolution of length
        ≥ m + N − 1 has no wrap-around at those entries.
    """
    n = u.shape[-2]
    if c.shape[-1] != m + n - 1:
        raise ValueError(
            f"toeplitz_fft: c must have m + N − 1 = {m + n - 1} entries, got {c.shape}"
        )
    if c.numel() == 0 or u.numel() == 0:  # an empty batch: FFT backends reject empty input
        lead = torch.broadcast_shapes(c.shape[:-1], u.shape[:-2])
        return u.new_zeros(*lead, m, u.shape[-1])
    if not bool(torch.isfinite(u).all()):
        # the FFT spreads a NaN or inf to every row, also to rows whose coefficient for it is 0
        # (a later token under the causal form): the direct product keeps it where it belongs
        return guarded_sum(torch.matmul, toeplitz_dense(c, m, n).to(u.dtype), u)
    size = 1 << (m + n - 2).bit_length()  # a power of two ≥ m + N − 1
    work = u.dtype if u.dtype in (torch.float32, torch.float64) else torch.float32
    fg = torch.fft.rfft(c.to(work), size)  # (…, size/2 + 1)
    fu = torch.fft.rfft(u.flip(-2).to(work), size, dim=-2)  # (…, size/2 + 1, F)
    conv = torch.fft.irfft(fg.unsqueeze(-1) * fu, size, dim=-2)
    return conv[..., n - 1 : m + n - 1, :].flip(-2).to(u.dtype)


def toeplitz_dense(c: Tensor, m: int, n: int) -> Tensor:
    """The Toeplitz matrix (…, m, n) with entries c_{j−i} (``c`` as in :func:`toeplitz_fft`)."""
    offsets = torch.arange(n, device=c.device)[None, :] - torch.arange(m, device=c.device)[:, None]
    return c[..., offsets + m - 1]


@REGISTRY.register("kernel_rpe_fft")
@arguments.renamed(heads="num_heads")
class RelativeKernelAttention(HeadAttention):
    """Kernelized attention with a learned relative position bias, the Toeplitz product by FFT
    (Luo et al. 2021); a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with q
    (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        max_len: the largest M and N; biases b_r for r = −(max_len−1) … max_len−1.
        num_heads: one bias vector per head (inputs (B, H, L, d)); None: one shared vector.
        feature_map: ``"elu+1"``, ``"relu"``, a module giving non-negative features, or a
            :class:`attnkit.efficient.Performer` whose positive random features estimate
            the softmax kernel (the paper's choice).
        causal: query i attends keys j ≤ i (c_r = 0 for r > 0).

    The biases start at 0 (c = 1: plain kernelized attention).
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"max_len": "max_len"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    takes_q_offset: ClassVar[bool] = True  # the biases b_{j−i} need the queries' positions

    def __init__(
        self,
        max_len: int,
        *,
        num_heads: int | None = None,
        feature_map: str | nn.Module = "elu+1",
        causal: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.max_len = arguments.positive_int(max_len, "max_len")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        self.causal = arguments.boolean(causal, "causal")
        lead = () if num_heads is None else (num_heads,)
        self.rel_bias = nn.Parameter(
            torch.zeros(*lead, 2 * max_len - 1, device=device, dtype=dtype)
        )
        self.phi = feature_map if isinstance(feature_map, Performer) else None
        if self.phi is None:
            self.phi = make_feature_map(feature_map)
        self.align = kz.KernelNormalized()

    @property
    def decodes_with_cache(self) -> bool:
        """Causal, a decoding step over the cached keys equals its rows of the causal pass."""
        return self.causal

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (71, 72, 73))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        module = cls(8, num_heads=2)
        with torch.no_grad():
            module.rel_bias.copy_(example_tensor(2, 15, seed=74))
        return module, (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.AlignmentKind.SOFT]

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, num_heads={self.num_heads}, causal={self.causal}"

    def coefficients(self, m: int, n: int, q_offset: int = 0) -> Tensor:
        """c_r = exp(b_r − max b) for r = −(m−1) … n−1: ((H,) m + n − 1), 0 for r > 0 when
        causal. With the queries at positions q_offset … (keys at 0 …), entry r holds the
        coefficient of the offset r − q_offset."""
        start = self.max_len - m - q_offset
        b = self.rel_bias[..., start : start + m + n - 1]
        if self.causal:
            r = torch.arange(-(m - 1), n, device=b.device) - q_offset
            b = torch.where(r <= 0, b, -torch.inf)
        return torch.exp(b - b.amax(-1, keepdim=True).detach())

    def _features(self, x: Tensor, *, is_query: bool, keep: Tensor | None) -> Tensor:
        if isinstance(self.phi, Performer):
            return self.phi.features(x, is_query=is_query, keep=keep)
        return self.phi(x)

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
        """``q_offset``: the position of the first query (keys sit at 0 … N−1), e.g. the number
        of cached positions in incremental decoding."""
        who = type(self).__name__
        arguments.nonnegative_int(q_offset, "q_offset")
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        m, n = q.shape[-2], k.shape[-2]
        if max(m + q_offset, n) > self.max_len:
            raise ValueError(
                f"{who}(max_len={self.max_len}) got M = {m} queries from position {q_offset} and "
                f"N = {n} keys; the relative biases cover offsets up to max_len − 1"
            )
        if self.num_heads is not None and (len(lead) < 2 or lead[-1] != self.num_heads):
            raise ValueError(
                f"{who}(num_heads={self.num_heads}) needs inputs (B, {self.num_heads}, L, d), "
                f"got q of shape {tuple(q.shape)}"
            )
        keep = kz.key_mask(mask, torch.Size((*lead, m, n)), who)
        fq = self._features(q, is_query=True, keep=None)
        fk = self._features(k, is_query=False, keep=keep)
        fk, v = kz._drop(fk, keep), kz._drop(v, keep)
        c = self.coefficients(m, n, q_offset).to(q.dtype)
        fk = fk.broadcast_to(*lead, n, fk.shape[-1])
        v = v.broadcast_to(*lead, n, v.shape[-1])
        u = (fk.unsqueeze(-1) * v.unsqueeze(-2)).flatten(-2)  # U_j = φ(k_j) v_jᵀ: (…, N, m·d_v)
        cu = toeplitz_fft(c, torch.cat([u, fk], -1), m)  # one FFT for numerator and denominator
        cu, cz = cu.split([u.shape[-1], fk.shape[-1]], -1)
        num = (fq.unsqueeze(-1) * cu.unflatten(-1, (fk.shape[-1], v.shape[-1]))).sum(-2)
        den = (fq * cz).sum(-1, keepdim=True)
        context = kz._divide(num, den)
        weights = None
        if need_weights:
            scores = (fq @ fk.transpose(-1, -2)) * toeplitz_dense(c, m, n)
            weights = self.align(scores, None if keep is None else keep.transpose(-1, -2)).weights
        return AttentionOutput(context, weights)
