"""Co-attention over two feature matrices (Brauwers 3.1.1, eqs. 6-16; Galassi IV-D2).

Inputs are batch first: F1 (B, n1, d1), F2 (B, n2, d2), with optional boolean masks (True = a
real feature) of shape (B, n1) or (B, 1, n1) — the latter is what :func:`attnkit.masks.from_lengths`
gives — and likewise for F2. As in Lu et al., the features serve as keys and values.
"""

from __future__ import annotations

from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import checks, hooks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.features._pooling import attend_one, key_mask, masked_mean
from attnkit.layers import HeadwiseLinear
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive, Score

__all__ = [
    "AlternatingCoAttention",
    "CoAttentionOutput",
    "InteractiveCoAttention",
    "MultiGrainedCoAttention",
    "MultiGrainedOutput",
    "NestedCoAttention",
    "ParallelCoAttention",
]


def co_inputs(
    part: nn.Module,
    f1: object,
    f2: object,
    mask1: object,
    mask2: object,
    d1: int | None = None,
    d2: int | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Validate co-attention inputs and the part's dtype and device; masks come back as
    (B, n) and padded features as 0."""
    f1 = checks.features(f1, "f1", d1, what="d1")
    f2 = checks.features(f2, "f2", d2, what="d2")
    checks.same_batch(("f1", f1), ("f2", f2))
    checks.part_matches(part, type(part).__name__, "f1", f1)
    m1 = checks.feature_mask(mask1, f1, "mask1", "f1")
    m2 = checks.feature_mask(mask2, f2, "mask2", "f2")
    return checks.without_padding(f1, m1), checks.without_padding(f2, m2), m1, m2


class CoAttentionOutput(NamedTuple):
    """Context vectors c⁽¹⁾ (B, d1), c⁽²⁾ (B, d2), weights a⁽¹⁾ (B, n1), a⁽²⁾ (B, n2), and for
    stochastic alignments the log-probabilities of the sampled choices (B,)."""

    context1: Tensor
    context2: Tensor
    weights1: Tensor
    weights2: Tensor
    log_prob1: Tensor | None = None
    log_prob2: Tensor | None = None

    def concat(self) -> Tensor:
        """concat(c⁽¹⁾, c⁽²⁾), the usual input of the output model."""
        return torch.cat([self.context1, self.context2], dim=-1)

    @property
    def representation(self) -> Tensor:
        """concat(c⁽¹⁾, c⁽²⁾) (B, d1 + d2)."""
        return self.concat()

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights1": self.weights1, "weights2": self.weights2}


class MultiGrainedOutput(NamedTuple):
    """The coarse-grained (interactive) and fine-grained (parallel) co-attention outputs."""

    coarse: CoAttentionOutput
    fine: CoAttentionOutput

    @property
    def representation(self) -> Tensor:
        """The four context vectors concatenated (B, 2·(d1 + d2))."""
        return torch.cat([self.coarse.concat(), self.fine.concat()], dim=-1)

    def named_weights(self) -> dict[str, Tensor]:
        coarse = {f"coarse.{k}": w for k, w in self.coarse.named_weights().items()}
        return coarse | {f"fine.{k}": w for k, w in self.fine.named_weights().items()}


class _CoAttention(nn.Module):
    """What the co-attention mechanisms share: their masks and a small example (B = 2)."""

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask1": ("f1",), "mask2": ("f2",)}
    _example_kwargs: ClassVar[dict[str, int]] = {"d1": 6, "d2": 3, "d_w": 5}
    _example_sizes: ClassVar[tuple[int, int]] = (6, 3)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(module, (f1 (2, 5, d1), f2 (2, 4, d2)), masks from ``masks.from_lengths``)."""
        d1, d2 = cls._example_sizes
        f1, f2 = example_tensor(2, 5, d1, seed=1), example_tensor(2, 4, d2, seed=2)
        mask1 = masks.from_lengths(torch.tensor([5, 3]), 5)
        mask2 = masks.from_lengths(torch.tensor([2, 4]), 4)
        return cls(**cls._example_kwargs), (f1, f2), {"mask1": mask1, "mask2": mask2}


@REGISTRY.register("alternating_co_attention")
class AlternatingCoAttention(_CoAttention):
    """Alternating co-attention (Lu et al.; Brauwers Fig. 4, eqs. 6-9).

    c⁽⁰⁾ = self-attentive attention over F1 (eq. 7); c⁽²⁾ = attention over F2 with query c⁽⁰⁾
    (eq. 8); c⁽¹⁾ = attention over F1 with query c⁽²⁾ (eq. 9), reusing eq. 7's W, b and w with an
    added query term, as in Lu et al.
    """

    def __init__(
        self,
        d1: int,
        d2: int,
        d_w: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d1=d1, d2=d2, d_w=d_w)
        self.d1, self.d2 = d1, d2
        kw = {"device": device, "dtype": dtype}
        first = Additive(None, d1, d_w, **kw)  # eq. 7
        self.att0 = Attention(first)
        self.att2 = Attention(Additive(d1, d2, d_w, **kw))  # eq. 8
        third = Additive(d2, d1, d_w, **kw)  # eq. 9: eq. 7 plus a query term
        third.W2, third.w = first.W2, first.w
        self.att1 = Attention(third)

    def taxonomy_tags(self) -> list:
        return [tx.FeatureMultiplicity.ALTERNATING_CO_ATTENTION, tx.QueryType.SPECIALIZED]

    def forward(
        self, f1: Tensor, f2: Tensor, mask1: Tensor | None = None, mask2: Tensor | None = None
    ) -> CoAttentionOutput:
        """f1 (B, n1, d1), f2 (B, n2, d2); mask1 (B, n1) or (B, 1, n1) and mask2 (B, n2) or
        (B, 1, n2) boolean, True = a real feature (None: all real)."""
        f1, f2, mask1, mask2 = co_inputs(self, f1, f2, mask1, mask2, self.d1, self.d2)
        c0, _ = attend_one(self.att0, None, f1, mask1)
        c2, a2 = attend_one(self.att2, c0, f2, mask2)
        c1, a1 = attend_one(self.att1, c2, f1, mask1)
        return CoAttentionOutput(c1, c2, a1, a2)


@REGISTRY.register("interactive_co_attention")
class InteractiveCoAttention(_CoAttention):
    """Interactive co-attention (Ma et al.; Brauwers Fig. 5, eqs. 10-11): each input's average
    key (eq. 10) is the query for the other input (eq. 11), in parallel.

    ``score1`` scores F1's keys with F2's average as query (d_q = d2, d_k = d1); ``score2`` the
    reverse. Both default to additive scores with hidden size ``d_w``.
    """

    def __init__(
        self,
        d1: int,
        d2: int,
        d_w: int = 64,
        *,
        score1: Score | None = None,
        score2: Score | None = None,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d1=d1, d2=d2, d_w=d_w)
        self.d1, self.d2 = d1, d2
        kw = {"device": device, "dtype": dtype}
        self.att1 = Attention(
            checks.optional_score(score1, "score1") or Additive(d2, d1, d_w, **kw), align
        )
        self.att2 = Attention(
            checks.optional_score(score2, "score2") or Additive(d1, d2, d_w, **kw), align
        )

    def taxonomy_tags(self) -> list:
        return [tx.FeatureMultiplicity.INTERACTIVE_CO_ATTENTION, tx.QueryType.SPECIALIZED]

    def forward(
        self, f1: Tensor, f2: Tensor, mask1: Tensor | None = None, mask2: Tensor | None = None
    ) -> CoAttentionOutput:
        """f1 (B, n1, d1), f2 (B, n2, d2); mask1 (B, n1) or (B, 1, n1) and mask2 (B, n2) or
        (B, 1, n2) boolean, True = a real feature (None: all real)."""
        f1, f2, mask1, mask2 = co_inputs(self, f1, f2, mask1, mask2, self.d1, self.d2)
        k1, k2 = masked_mean(f1, mask1), masked_mean(f2, mask2)  # eq. 10
        c1, a1 = attend_one(self.att1, k2, f1, mask1)  # eq. 11
        c2, a2 = attend_one(self.att2, k1, f2, mask2)
        return CoAttentionOutput(c1, c2, a1, a2)


@REGISTRY.register("parallel_co_attention")
class ParallelCoAttention(_CoAttention):
    """Parallel co-attention (Lu et al.; Brauwers Fig. 6, eqs. 12-16).

    Args:
        d1, d2: feature sizes of F1 and F2.
        affinity: the co-compatibility function. ``"bilinear"`` — A = act(F1 W_A F2ᵀ) (eq. 12,
            tanh); ``"concat"`` — A_ij = w_Aᵀ[k_i; k_j; k_i ∘ k_j] (eq. 13, needs d1 = d2); or
            any score module (Galassi IV-D2: "straightforward adaptations of any of the
            compatibility functions"), A = score(F1, F2) with F1's rows as queries and F2's
            as keys, e.g. ``ak.scores.build("scaled_dot")`` or ``Hermitian(d, d_w)``.
        score: the aggregation of A into e⁽¹⁾, e⁽²⁾. ``"additive"`` — e⁽¹⁾ = w_1ᵀ tanh(W_2 K⁽²⁾
            Aᵀ + W_1 K⁽¹⁾) and e⁽²⁾ alike (eqs. 14-15); ``"max"`` — e⁽¹⁾_i = max_j A_ij,
            e⁽²⁾_j = max_i A_ij (eq. 16); or an aggregation module from
            :mod:`attnkit.features.aggregation`, called as ``(A, f1, f2, mask1, mask2)``.
        d_w: hidden size of the additive scores.

    Masked positions take no part: their affinities are excluded from the sums and maxima.
    Returns :class:`CoAttentionOutput` plus the affinity matrix via ``affinity_matrix()``.
    """

    def __init__(
        self,
        d1: int,
        d2: int,
        *,
        affinity: Literal["bilinear", "concat"] | Score = "bilinear",
        score: Literal["additive", "max"] | nn.Module = "additive",
        d_w: int = 64,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d1=d1, d2=d2, d_w=d_w)
        kw = {"device": device, "dtype": dtype}
        if isinstance(affinity, Score):
            if affinity.multi_dimensional or affinity.query_free:
                raise ValueError(
                    "affinity must give one score per (F1, F2) pair: a query-free or "
                    f"multi-dimensional {type(affinity).__name__} score does not"
                )
        elif affinity not in ("bilinear", "concat"):
            raise ValueError(
                f"affinity must be 'bilinear', 'concat' or a Score module, got {affinity!r}"
            )
        if not isinstance(score, nn.Module) and score not in ("additive", "max"):
            raise ValueError(
                f"score must be 'additive', 'max' or an aggregation module, got {score!r}"
            )
        if affinity == "concat" and d1 != d2:
            raise ValueError(f"affinity='concat' (eq. 13) needs d1 == d2, got {d1} and {d2}")
        self.affinity, self.score = affinity, score
        self.d1, self.d2 = d1, d2
        if affinity == "bilinear":
            self.W_A = nn.Parameter(torch.randn(d1, d2, **kw) / (d1 * d2) ** 0.25)
        elif affinity == "concat":
            self.w_A = HeadwiseLinear(3 * d1, 1, bias=False, **kw)
        if score == "additive":
            self.W1 = HeadwiseLinear(d1, d_w, bias=False, **kw)
            self.W2 = HeadwiseLinear(d2, d_w, bias=False, **kw)
            self.w1 = HeadwiseLinear(d_w, 1, bias=False, **kw)
            self.w2 = HeadwiseLinear(d_w, 1, bias=False, **kw)
        self.align = checks.resolve_alignment(align, device=device, dtype=dtype)

    def taxonomy_tags(self) -> list:
        tags: list = [tx.FeatureMultiplicity.PARALLEL_CO_ATTENTION, tx.QueryType.SPECIALIZED]
        if self.score == "additive":
            tags.append(tx.Scoring.ADDITIVE)
        return tags

    def affinity_matrix(self, f1: Tensor, f2: Tensor) -> Tensor:
        """A (B, n1, n2): eq. 12, eq. 13 or the given score with F1 as queries, F2 as keys."""
        if isinstance(self.affinity, Score):
            return self.affinity(f1, f2)
        if self.affinity == "bilinear":
            return torch.tanh(f1 @ self.W_A @ f2.transpose(-1, -2))
        n1, n2 = f1.shape[-2], f2.shape[-2]
        a = f1.unsqueeze(-2).expand(*f1.shape[:-2], n1, n2, f1.shape[-1])
        b = f2.unsqueeze(-3).expand(*f2.shape[:-2], n1, n2, f2.shape[-1])
        return self.w_A(torch.cat([a, b, a * b], dim=-1)).squeeze(-1)

    def forward(
        self, f1: Tensor, f2: Tensor, mask1: Tensor | None = None, mask2: Tensor | None = None
    ) -> CoAttentionOutput:
        """f1 (B, n1, d1), f2 (B, n2, d2); mask1 (B, n1) or (B, 1, n1) and mask2 (B, n2) or
        (B, 1, n2) boolean, True = a real feature (None: all real)."""
        f1, f2, mask1, mask2 = co_inputs(self, f1, f2, mask1, mask2, self.d1, self.d2)
        A = self.affinity_matrix(f1, f2)
        pair = None
        if mask1 is not None or mask2 is not None:
            m1 = (
                torch.ones(f1.shape[:-1], dtype=torch.bool, device=f1.device)
                if mask1 is None
                else mask1
            )
            m2 = (
                torch.ones(f2.shape[:-1], dtype=torch.bool, device=f2.device)
                if mask2 is None
                else mask2
            )
            pair = m1.unsqueeze(-1) & m2.unsqueeze(-2)
        if isinstance(self.score, nn.Module):
            e1, e2 = self.score(A, f1, f2, mask1, mask2)
        elif self.score == "additive":
            if pair is not None:
                A = A * pair  # a padded position translates nothing
            h1 = self.W1(f1)
            h2 = self.W2(f2)
            e1 = self.w1(torch.tanh(A @ h2 + h1)).squeeze(-1)  # eq. 14
            e2 = self.w2(torch.tanh(A.transpose(-1, -2) @ h1 + h2)).squeeze(-1)  # eq. 15
        else:
            masked = A if pair is None else A.masked_fill(~pair, float("-inf"))
            e1 = masked.amax(dim=-1)  # eq. 16
            e2 = masked.amax(dim=-2)
            e1 = torch.where(torch.isinf(e1), torch.zeros((), dtype=e1.dtype), e1)
            e2 = torch.where(torch.isinf(e2), torch.zeros((), dtype=e2.dtype), e2)
        out1 = self.align(e1.unsqueeze(-2), key_mask(mask1))
        out2 = self.align(e2.unsqueeze(-2), key_mask(mask2))
        a1, a2 = out1.weights.squeeze(-2), out2.weights.squeeze(-2)
        c1 = (a1.unsqueeze(-1) * f1).sum(-2)
        c2 = (a2.unsqueeze(-1) * f2).sum(-2)
        lp1 = None if out1.log_prob is None else out1.log_prob.squeeze(-1)
        lp2 = None if out2.log_prob is None else out2.log_prob.squeeze(-1)
        hooks.report(self, a1, "weights1")
        hooks.report(self, a2, "weights2")
        return CoAttentionOutput(c1, c2, a1, a2, lp1, lp2)


@REGISTRY.register("nested_co_attention")
class NestedCoAttention(_CoAttention):
    """Attention-over-attention (Cui et al.; Galassi IV-D2, nested aggregation).

    With E = Q Kᵀ (B, n_q, n_k): M1 = softmax of E's rows (over keys), M2 = softmax of E's
    columns (over queries); a_Q = mean over keys of M2 (B, n_q); a_K = M1ᵀ a_Q (B, n_k).
    Parameter-free. F1 plays the keys (document), F2 the queries (question); d1 = d2.
    ``align`` (softmax by default, as Cui et al.) normalises the rows and the columns.
    """

    _example_kwargs: ClassVar[dict[str, int]] = {}
    _example_sizes: ClassVar[tuple[int, int]] = (6, 6)

    def __init__(self, *, align: str | nn.Module = "softmax") -> None:
        super().__init__()
        self.align = checks.resolve_alignment(align)

    def taxonomy_tags(self) -> list:
        return [
            tx.FeatureMultiplicity.NESTED_CO_ATTENTION,
            tx.Scoring.MULTIPLICATIVE,
            tx.QueryType.SPECIALIZED,
        ]

    def forward(
        self, f1: Tensor, f2: Tensor, mask1: Tensor | None = None, mask2: Tensor | None = None
    ) -> CoAttentionOutput:
        """f1 (B, n1, d1), f2 (B, n2, d2); mask1 (B, n1) or (B, 1, n1) and mask2 (B, n2) or
        (B, 1, n2) boolean, True = a real feature (None: all real)."""
        f1, f2, mask1, mask2 = co_inputs(self, f1, f2, mask1, mask2)
        if f1.shape[-1] != f2.shape[-1]:
            raise ValueError(
                f"NestedCoAttention needs d1 == d2: f1 has {f1.shape[-1]} features (shape "
                f"{tuple(f1.shape)}), f2 has {f2.shape[-1]} (shape {tuple(f2.shape)})"
            )
        E = f2 @ f1.transpose(-1, -2)  # (B, n_q, n_k)
        mk = None if mask1 is None else mask1.unsqueeze(-2)
        mq = None if mask2 is None else mask2.unsqueeze(-2)
        m1 = self.align(E, mk).weights  # over keys
        m2 = self.align(E.transpose(-1, -2), mq).weights.transpose(-1, -2)  # over queries
        a_q = masked_mean(m2.transpose(-1, -2), mask1)  # mean over (valid) keys: (B, n_q)
        a_k = (m1 * a_q.unsqueeze(-1)).sum(-2)  # M1ᵀ a_Q
        c1 = (a_k.unsqueeze(-1) * f1).sum(-2)
        c2 = (a_q.unsqueeze(-1) * f2).sum(-2)
        hooks.report(self, a_k, "weights1")
        hooks.report(self, a_q, "weights2")
        return CoAttentionOutput(c1, c2, a_k, a_q)


@REGISTRY.register("multi_grained_co_attention")
class MultiGrainedCoAttention(_CoAttention):
    """Multi-grained co-attention (Fan et al.; Brauwers 3.1.1): coarse-grained (interactive)
    and fine-grained (parallel) co-attention together; the four context vectors are returned
    and concatenated."""

    def __init__(
        self,
        d1: int,
        d2: int,
        d_w: int = 64,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d1=d1, d2=d2, d_w=d_w)
        kw = {"device": device, "dtype": dtype}
        self.coarse = InteractiveCoAttention(d1, d2, d_w, **kw)
        self.fine = ParallelCoAttention(d1, d2, score="max", d_w=d_w, **kw)

    def taxonomy_tags(self) -> list:
        return [tx.FeatureMultiplicity.MULTI_GRAINED_CO_ATTENTION]

    taxonomy_final = (tx.FeatureMultiplicity,)

    def forward(
        self, f1: Tensor, f2: Tensor, mask1: Tensor | None = None, mask2: Tensor | None = None
    ) -> MultiGrainedOutput:
        """(coarse, fine) outputs; inputs and mask shapes as :class:`InteractiveCoAttention`."""
        return MultiGrainedOutput(
            self.coarse(f1, f2, mask1, mask2), self.fine(f1, f2, mask1, mask2)
        )

    @staticmethod
    def concat(outputs: MultiGrainedOutput | tuple[CoAttentionOutput, CoAttentionOutput]) -> Tensor:
        coarse, fine = outputs
        return torch.cat([coarse.context1, coarse.context2, fine.context1, fine.context2], -1)
