"""Synthesizer (Tay, Bahri, Metzler, Juan, Zhao and Zheng, "Synthesizer: Rethinking Self-Attention
for Transformer Models", ICML 2021; Brauwers 3.3.2; SPEC 7): attention weights *synthesised*
without (or beside) the query-key dot product.

Each component maps the per-head queries q (…, M, d) and keys k (…, N, d) to logits (…, M, N):

- :class:`DenseSynthetic`: B_i = W₂ relu(W₁ q_i + b₁) + b₂ ∈ ℝ^ℓ, one logit per key position,
  from query i alone (Tay eq. 2); the first N entries are used.
- :class:`RandomSynthetic`: a matrix R ∈ ℝ^{ℓ×ℓ}, learned or fixed, that depends on no input:
  logits R[:M, :N] (Tay's random synthesizer).
- :class:`FactorizedDenseSynthetic`: two small dense nets give A_i ∈ ℝ^a and C_i ∈ ℝ^b, and the
  logit of key j (ℓ = a·b) is A_i[j mod a] · C_i[j // a] — the paper's repetitions H_a(A) ⊙ H_b(C),
  realised so that every pair of factor entries meets exactly once.
- :class:`FactorizedRandomSynthetic`: R = R₁R₂ᵀ with R₁, R₂ ∈ ℝ^{ℓ×r} (low rank).
- :class:`DotProductLogits`: the Transformer's q·k/√d.

:class:`Synthesizer` mixes components: logits = Σ_c α_c · logits_c with α = softmax(w) (learned
mixture weights, Tay's "mixture of synthesizers"), then softmax over the keys and a weighted sum
of the values (Tay eq. 3). With one component it is that synthesizer alone. It is a registered
mechanism and a per-head part for ``MultiHeadAttention(attention=...)``.

Synthetic logits index key *positions*, so masks are honoured by masking the logits (a causal
mask works, padding equals truncation); N (and M for the random forms) may not exceed ℓ.
The random forms index query rows by position: rows q_offset … q_offset + M − 1, where
``q_offset`` is the position of the first query (the number of cached positions in
incremental decoding with a KV cache, which :class:`attnkit.MultiHeadAttention` passes), so
decoding step by step equals the whole causal sequence at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = [
    "DenseSynthetic",
    "DotProductLogits",
    "FactorizedDenseSynthetic",
    "FactorizedRandomSynthetic",
    "RandomSynthetic",
    "Synthesizer",
]


def _heads_of(x: Tensor, num_heads: int, who: str) -> None:
    if num_heads > 1 and (x.dim() < 3 or x.shape[-3] != num_heads):
        raise ValueError(
            f"{who}(num_heads={num_heads}) needs per-head inputs (…, {num_heads}, L, d), got shape "
            f"{tuple(x.shape)}"
        )


def _linear(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """x (…, H, L, i) @ w (H, i, o) + b (H, o), one weight per head; H = 1 broadcasts."""
    if w.shape[0] == 1:
        return x @ w[0] + b[0]
    return torch.einsum("...hli,hio->...hlo", x, w) + b[:, None, :]


def _init(num_heads: int, fan_in: int, fan_out: int, kw: dict) -> tuple[nn.Parameter, nn.Parameter]:
    bound = 1 / math.sqrt(fan_in)
    w = nn.Parameter(torch.empty(num_heads, fan_in, fan_out, **kw).uniform_(-bound, bound))
    b = nn.Parameter(torch.empty(num_heads, fan_out, **kw).uniform_(-bound, bound))
    return w, b


def _check_len(n: int, max_len: int, what: str, who: str) -> None:
    if n > max_len:
        raise ValueError(f"{who}(max_len={max_len}) got {what} = {n} > max_len")


@arguments.deprecated_names(d="head_dim")
@arguments.renamed(heads="num_heads")
class DenseSynthetic(nn.Module):
    """Dense synthetic logits B_i = W₂ relu(W₁ q_i + b₁) + b₂ (Tay eq. 2), (…, M, N) with N ≤ ℓ.

    Args:
        head_dim: d, the query size; ``d=`` is its old name, accepted with a
            DeprecationWarning until the next release.
        max_len: ℓ, the longest key sequence.
        d_hidden: width of the hidden layer (default ``head_dim``).
        num_heads: H, one set of weights per head (inputs (…, H, L, d)); 1 shares them.
    """

    scoring: ClassVar[tx.Scoring] = tx.Scoring.LOCATION  # a logit per position, from q alone

    def __init__(
        self,
        head_dim: int,
        max_len: int,
        d_hidden: int | None = None,
        *,
        num_heads: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = d = arguments.positive_int(head_dim, "head_dim")
        self.max_len = arguments.positive_int(max_len, "max_len")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        hidden = d if d_hidden is None else arguments.positive_int(d_hidden, "d_hidden")
        kw = {"device": device, "dtype": dtype}
        self.w1, self.b1 = _init(num_heads, d, hidden, kw)
        self.w2, self.b2 = _init(num_heads, hidden, max_len, kw)

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        _heads_of(q, self.num_heads, "DenseSynthetic")
        _check_len(k.shape[-2], self.max_len, "N", "DenseSynthetic")
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"DenseSynthetic(head_dim={self.head_dim}) got q with {q.shape[-1]} features"
            )
        hidden = F.relu(_linear(q, self.w1, self.b1))
        return _linear(hidden, self.w2, self.b2)[..., : k.shape[-2]]


@arguments.deprecated_names(d="head_dim")
@arguments.renamed(heads="num_heads")
class FactorizedDenseSynthetic(nn.Module):
    """Factorized dense logits: A_i = W₂ᵃ relu(W₁ᵃ q_i) ∈ ℝ^a and C_i ∈ ℝ^b likewise; the logit
    of key j is A_i[j mod a] · C_i[j // a], for N ≤ ℓ = a·b (Tay's factorized dense form,
    a + b outputs per query instead of ℓ). Arguments as :class:`DenseSynthetic`, with ``a``
    and ``b`` the factor sizes."""

    scoring: ClassVar[tx.Scoring] = tx.Scoring.LOCATION

    def __init__(
        self,
        head_dim: int,
        a: int,
        b: int,
        d_hidden: int | None = None,
        *,
        num_heads: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = d = arguments.positive_int(head_dim, "head_dim")
        self.a, self.b = arguments.positive_int(a, "a"), arguments.positive_int(b, "b")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        hidden = d if d_hidden is None else arguments.positive_int(d_hidden, "d_hidden")
        kw = {"device": device, "dtype": dtype}
        self.w1a, self.b1a = _init(num_heads, d, hidden, kw)
        self.w2a, self.b2a = _init(num_heads, hidden, a, kw)
        self.w1b, self.b1b = _init(num_heads, d, hidden, kw)
        self.w2b, self.b2b = _init(num_heads, hidden, b, kw)

    @property
    def max_len(self) -> int:
        return self.a * self.b

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        _heads_of(q, self.num_heads, "FactorizedDenseSynthetic")
        _check_len(k.shape[-2], self.max_len, "N", "FactorizedDenseSynthetic")
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"FactorizedDenseSynthetic(head_dim={self.head_dim}) got q with "
                f"{q.shape[-1]} features"
            )
        fa = _linear(F.relu(_linear(q, self.w1a, self.b1a)), self.w2a, self.b2a)  # (…, M, a)
        fb = _linear(F.relu(_linear(q, self.w1b, self.b1b)), self.w2b, self.b2b)  # (…, M, b)
        # H_a repeats A b times, H_b repeats each entry of C a times: entry j = A[j % a] C[j // a]
        tiled = fa.repeat(*([1] * (fa.dim() - 1)), self.b)
        return (tiled * fb.repeat_interleave(self.a, -1))[..., : k.shape[-2]]


@arguments.renamed(heads="num_heads")
class RandomSynthetic(nn.Module):
    """Random synthetic logits R[:M, :N] with R ∈ ℝ^{ℓ×ℓ} per head, independent of the input
    (Tay's random synthesizer). ``learned=False`` keeps R fixed (a buffer, drawn at init).

    Args:
        max_len: ℓ, the longest query and key sequence.
        num_heads: H, one R per head (inputs (…, H, L, d)); 1 shares it.
        learned: learn R (True) or keep it fixed.
    """

    scoring: ClassVar[tx.Scoring] = tx.Scoring.LOCATION  # depends on positions only
    takes_q_offset: ClassVar[bool] = True

    def __init__(
        self,
        max_len: int,
        *,
        num_heads: int = 1,
        learned: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.max_len = arguments.positive_int(max_len, "max_len")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.learned = arguments.boolean(learned, "learned")
        r = torch.randn(num_heads, max_len, max_len, device=device, dtype=dtype)
        if learned:
            self.r = nn.Parameter(r)
        else:
            self.register_buffer("r", r)

    def matrix(self) -> Tensor:
        """R (H, ℓ, ℓ)."""
        return self.r

    def forward(self, q: Tensor, k: Tensor, q_offset: int = 0) -> Tensor:
        """R[q_offset : q_offset + M, :N]: the queries sit at positions q_offset … (keys at 0 …)."""
        _heads_of(q, self.num_heads, type(self).__name__)
        arguments.nonnegative_int(q_offset, "q_offset")
        m, n = q.shape[-2], k.shape[-2]
        _check_len(q_offset + m, self.max_len, "q_offset + M", type(self).__name__)
        _check_len(n, self.max_len, "N", type(self).__name__)
        r = self.matrix()[:, q_offset : q_offset + m, :n]
        return r[0] if self.num_heads == 1 else r


@arguments.renamed(heads="num_heads")
class FactorizedRandomSynthetic(RandomSynthetic):
    """Low-rank random logits R = R₁R₂ᵀ, R₁, R₂ ∈ ℝ^{ℓ×r} per head (Tay's factorized random
    synthesizer); arguments as :class:`RandomSynthetic` plus ``rank`` r."""

    def __init__(
        self,
        max_len: int,
        rank: int,
        *,
        num_heads: int = 1,
        learned: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.max_len = arguments.positive_int(max_len, "max_len")
        self.rank = arguments.positive_int(rank, "rank")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.learned = arguments.boolean(learned, "learned")
        kw = {"device": device, "dtype": dtype}
        r1 = torch.randn(num_heads, max_len, rank, **kw) / rank**0.25
        r2 = torch.randn(num_heads, max_len, rank, **kw) / rank**0.25
        if learned:
            self.r1, self.r2 = nn.Parameter(r1), nn.Parameter(r2)
        else:
            self.register_buffer("r1", r1)
            self.register_buffer("r2", r2)

    def matrix(self) -> Tensor:
        return self.r1 @ self.r2.transpose(-1, -2)


class DotProductLogits(nn.Module):
    """The Transformer's logits q·k/√d (Brauwers Table II, scaled multiplicative)."""

    scoring: ClassVar[tx.Scoring] = tx.Scoring.SCALED_MULTIPLICATIVE

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


@REGISTRY.register("synthesizer")
class Synthesizer(HeadAttention):
    """A mixture of synthetic (and dot-product) logits, softmax over the keys, weighted sum of
    the values (Tay eq. 3): a per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with
    q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v).

    Args:
        components: logit modules mapping (q, k) to (…, M, N), e.g. :class:`DenseSynthetic`,
            :class:`RandomSynthetic`, :class:`DotProductLogits`.
        mixture: initial α (non-negative, summing to 1), one per component; default uniform.
            α = softmax(w) with w = log α, learned with ``learn_mixture``; α_c = 0 switches a
            component off.
        learn_mixture: learn the mixture weights (only with two or more components).
    """

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    decodes_with_cache: ClassVar[bool] = True  # a step equals its causal rows

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    takes_q_offset: ClassVar[bool] = True  # passed on to the random forms

    def __init__(
        self,
        components: Sequence[nn.Module],
        mixture: Sequence[float] | None = None,
        *,
        learn_mixture: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(components, nn.Module) or not all(
            isinstance(c, nn.Module) for c in components
        ):
            raise TypeError("components must be a sequence of nn.Modules mapping (q, k) to logits")
        if len(components) == 0:
            raise ValueError("components must name at least one logit module")
        self.components = nn.ModuleList(components)
        arguments.boolean(learn_mixture, "learn_mixture")
        c = len(components)
        alpha = torch.full((c,), 1.0 / c) if mixture is None else torch.tensor(mixture).double()
        if alpha.shape != (c,) or (alpha < 0).any() or abs(alpha.sum().item() - 1) > 1e-6:
            raise ValueError(
                f"mixture must hold {c} non-negative weights summing to 1, got {mixture!r}"
            )
        log_alpha = alpha.log().float()
        if learn_mixture and c > 1:
            self.mixture_logits = nn.Parameter(log_alpha)
        else:
            self.register_buffer("mixture_logits", log_alpha)
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 6, 4, seed=s) for s in (31, 32, 33))
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)[:, None].expand(2, 2, 1, 6)
        parts = [
            DenseSynthetic(4, 8, num_heads=2),
            RandomSynthetic(8, num_heads=2),
            DotProductLogits(),
        ]
        return cls(parts), (q, k, v), {"mask": mask}

    @classmethod
    def for_heads(
        cls, *, embed_dim: int, num_heads: int, head_dim: int, max_len: int, **overrides
    ) -> Synthesizer:
        """Tay et al.'s dense synthesizer (eq. 2), one per head, over at most ``max_len`` keys,
        unless ``components=`` is given."""
        if "components" not in overrides:
            overrides["components"] = [DenseSynthetic(head_dim, max_len, num_heads=num_heads)]
        return cls(**overrides)

    def mixture(self) -> Tensor:
        """α = softmax(w), one weight per component."""
        return torch.softmax(self.mixture_logits, 0)

    def taxonomy_tags(self) -> list:
        return list(
            dict.fromkeys(getattr(c, "scoring", tx.Scoring.LOCATION) for c in self.components)
        )

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
        """``q_offset``: the position of the first query, passed to the components that index
        query positions (the random forms). Keys no query may attend hold zeros (the
        template): their content, even NaN, reaches nothing."""
        arguments.nonnegative_int(q_offset, "q_offset")
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        m, n = q.shape[-2], k.shape[-2]
        alpha = self.mixture().to(q.dtype)
        logits = None
        for a, component in zip(alpha, self.components, strict=True):
            where = {"q_offset": q_offset} if getattr(component, "takes_q_offset", False) else {}
            term = a * component(q, k, **where)  # α_c = 0 adds exactly 0 (the logits are finite)
            logits = term if logits is None else logits + term
        if bias is not None:
            logits = logits + bias
        logits = logits.broadcast_to(*lead, m, n)
        weights = self.align(logits, mask).weights
        return AttentionOutput(weights @ v, weights)
