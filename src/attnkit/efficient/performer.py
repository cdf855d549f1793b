"""Performer / FAVOR+ (Choromanski et al., "Rethinking Attention with Performers", ICLR 2021;
Soydaner 5.3): softmax attention approximated without bias in O(N) by positive orthogonal random
features.

For ω ~ N(0, I_d) the softmax kernel has the positive random-feature form (Performer Lemma 1)

    exp(x·y) = E_ω[ exp(ω·x − ‖x‖²/2) · exp(ω·y − ‖y‖²/2) ],

so with x = q/d^{1/4}, y = k/d^{1/4} (softmax's 1/√d scaling) and m features ω_1 … ω_m,
φ(x) = exp(−‖x‖²/2)/√m · [exp(ω_1·x), …, exp(ω_m·x)] gives E[φ(q)·φ(k)] = exp(q·k/√d), and
kernelized attention (:mod:`attnkit.efficient.kernelized`) with φ estimates softmax attention.
The ω are drawn in blocks of d that are exactly orthogonal (QR of a Gaussian matrix), each row
rescaled by the norm of an independent Gaussian vector so that every ω_i stays N(0, I_d)
(Performer sec. 2.4: orthogonal features, still unbiased, lower variance). Positive features
keep the estimated weights ≥ 0 and the denominators > 0 (why FAVOR+ is stable where sin/cos
features are not).

``kernel="relu"`` is the paper's generalised attention with f = ReLU: φ(x) = ReLU(Wx)/√m, a
kernel in its own right (not an estimate of softmax).

Features are buffers (they follow ``.to()`` and are saved), redrawn by :meth:`Performer.redraw`
or every ``redraw_every`` training calls (the paper redraws periodically in training).

Numerics: exp(ω·x − ‖x‖²/2) is computed with a constant subtracted in the exponent — per query
row for queries, over all (real) keys and features per sequence for keys — which cancels in
the normalised weights (the paper's stabiliser).
"""

from __future__ import annotations

import math
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.derived import DerivedBuffers
from attnkit.efficient import kernelized as kz
from attnkit.efficient.feature_maps import (
    attend,
    attend_inputs,
    causal_rows,
    check_causal,
    whole_maps,
)
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["Performer", "gaussian_features", "orthogonal_gaussian_features"]

KERNELS = ("softmax", "relu")


def gaussian_features(m: int, d: int, generator: torch.Generator) -> Tensor:
    """(m, d) i.i.d. N(0, 1) rows (float64)."""
    return torch.randn(m, d, generator=generator, dtype=torch.float64)


def orthogonal_gaussian_features(m: int, d: int, generator: torch.Generator) -> Tensor:
    """(m, d) rows, orthogonal within each block of d, each marginally N(0, I_d) (float64):
    Performer sec. 2.4 (orthogonal random features, rows rescaled by chi-distributed norms)."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        g = torch.randn(d, d, generator=generator, dtype=torch.float64)
        qmat, r = torch.linalg.qr(g)
        qmat = qmat * torch.sign(torch.diagonal(r))  # Haar-distributed: fix the QR sign choice
        blocks.append(qmat.T)
    rows = torch.cat(blocks)[:m]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=-1)
    return rows * norms[:, None]


@REGISTRY.register("performer")
@arguments.deprecated_names(d="head_dim")
class Performer(DerivedBuffers, HeadAttention):
    """FAVOR+ attention, a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with q
    (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context (B, …, M, d_v).

    Args:
        head_dim: d, the query/key size; ``d=`` is its old name, accepted with a
            DeprecationWarning until the next release.
        n_features: m, the number of random features.
        kernel: ``"softmax"`` (positive random features, FAVOR+) or ``"relu"``.
        orthogonal: draw orthogonal blocks (True) or i.i.d. Gaussian features.
        causal: query i attends keys j ≤ i, by prefix sums (needs M = N).
        redraw_every: redraw the features every this many calls in training mode (None: never).
        seed: seed of the first draw; each redraw continues the same generator.
        chunk_size: block length of the causal prefix sums.

    Masks and bias as :class:`attnkit.efficient.LinearAttention`.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    # causal=True: queries after a KV cache are the last rows of the causal sequence
    takes_q_offset: ClassVar[bool] = True

    def __init__(
        self,
        head_dim: int,
        n_features: int = 256,
        *,
        kernel: str = "softmax",
        orthogonal: bool = True,
        causal: bool = False,
        redraw_every: int | None = None,
        seed: int = 0,
        chunk_size: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.n_features = arguments.positive_int(n_features, "n_features")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self.kernel = kernel
        self.orthogonal = arguments.boolean(orthogonal, "orthogonal")
        self.causal = arguments.boolean(causal, "causal")
        self.redraw_every = arguments.optional_positive_int(redraw_every, "redraw_every")
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        self._generator = torch.Generator().manual_seed(arguments.nonnegative_int(seed, "seed"))
        self._calls = 0
        self.register_derived("omega", self._draw(), device=device, dtype=dtype)
        self.align = kz.KernelNormalized()

    @property
    def decodes_with_cache(self) -> bool:
        """Causal, a decoding step over the cached keys equals its rows of the causal pass."""
        return self.causal

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (11, 12, 13))
        mask = masks.from_lengths(torch.tensor([7, 4]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(4, n_features=16), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.SOFT]

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, n_features={self.n_features}, kernel={self.kernel!r}, "
            f"orthogonal={self.orthogonal}, causal={self.causal}, redraw_every={self.redraw_every}"
        )

    def _draw(self) -> Tensor:
        draw = orthogonal_gaussian_features if self.orthogonal else gaussian_features
        return draw(self.n_features, self.head_dim, self._generator).double()

    @torch.no_grad()
    def redraw(self) -> None:
        """Draw new random features (the next draw of this module's generator)."""
        self.set_derived("omega", self._draw())

    def features(self, x: Tensor, *, is_query: bool, keep: Tensor | None = None) -> Tensor:
        """φ(x) (…, L, m) for x (…, L, d); ``keep`` (…, L, 1) marks the keys that count for the
        keys' stabiliser."""
        if self.kernel == "relu":
            return self._relu_features(x)
        if is_query:
            return self._query_features(x)
        return self._key_features(x, keep)

    def _relu_features(self, x: Tensor) -> Tensor:
        return torch.relu(x @ self.omega.to(x.dtype).T) / math.sqrt(self.n_features)

    def _logits(self, x: Tensor) -> Tensor:
        """ω_i·x − ‖x‖²/2 with x scaled by d^{−1/4} (Lemma 1's exponent), (…, L, m)."""
        x = x * self.head_dim**-0.25
        wx = x @ self.omega.to(x.dtype).T
        return wx - (x * x).sum(-1, keepdim=True) / 2

    def _query_features(self, x: Tensor) -> Tensor:
        # A per-row constant cancels in each query's normalisation: −‖x‖²/2 is one, so only
        # ω·x is formed, less its row maximum (and with 1/√m as log √m in the exponent).
        wx = (x * self.head_dim**-0.25) @ self.omega.to(x.dtype).T
        shift = wx.amax(-1, keepdim=True).detach() + 0.5 * math.log(self.n_features)
        return wx.sub_(shift).exp_()

    def _shifted(self, x: Tensor, shift: Tensor) -> Tensor:
        return self._logits(x).sub_(shift + 0.5 * math.log(self.n_features)).exp_()

    def _key_features(self, x: Tensor, keep: Tensor | None) -> Tensor:
        """φ(k) of all the keys at once, with the keys' stabiliser of :meth:`_key_shift` taken
        from the same logits (formed once)."""
        logits = self._logits(x)
        with torch.no_grad():
            real = logits if keep is None else torch.where(keep, logits, -torch.inf)
            shift = real.amax((-1, -2), keepdim=True)
            shift = torch.where(torch.isfinite(shift), shift, 0)
        return logits.sub_(shift + 0.5 * math.log(self.n_features)).exp_()

    @torch.no_grad()
    def _key_shift(self, k: Tensor, keep: Tensor | None, chunk: int) -> Tensor:
        """The keys' stabiliser: one constant per sequence, the maximum exponent over its real
        keys and all features (it cancels in every ratio), taken chunk by chunk (…, 1, 1)."""
        shift = None
        for s in range(0, k.shape[-2], chunk):
            logits = self._logits(k[..., s : s + chunk, :])
            if keep is not None:
                rows = keep if keep.shape[-2] == 1 else keep[..., s : s + chunk, :]
                logits = torch.where(rows, logits, -torch.inf)
            top = logits.amax((-1, -2), keepdim=True)
            shift = top if shift is None else torch.maximum(shift, top)
        return torch.where(torch.isfinite(shift), shift, 0)

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
        if self.training and self.redraw_every is not None:
            if self._calls and self._calls % self.redraw_every == 0:
                self.redraw()
            self._calls += 1
        keep = kz.key_mask(mask, torch.Size((*lead, q.shape[-2], k.shape[-2])), who)
        m = self.n_features
        if self.kernel == "relu":
            phi_q = phi_k = self._relu_features
        elif whole_maps(self, q, k, v, need_weights, m):  # logits of the keys formed once
            return attend(
                self, self._query_features(q), self._key_features(k, keep), v, keep, need_weights
            )
        else:
            phi_q = self._query_features
            shift = self._key_shift(k, keep, kz.chunk_rows(torch.Size(lead), m))
            phi_k = partial(self._shifted, shift=shift)
        return attend_inputs(self, phi_q, phi_k, q, k, v, keep, need_weights, m=m)
