"""Coverage: attention that remembers where it has already attended (Tu et al. 2016, "Modeling
Coverage for Neural Machine Translation"; See et al. 2017, "Get To The Point", Sec. 2.3;
Galassi V-B on attention tracking), and the doubly stochastic regulariser of show, attend and
tell (Xu et al. 2015, eq. 14).

At decoder step t the coverage vector is the sum of the earlier attention distributions,
c^t = Σ_{t' < t} a^{t'} (See eq. 10); it enters the additive score as one more feature per key,
e_i^t = vᵀ tanh(W_h h_i + W_s s_t + w_c c_i^t + b) (See eq. 11), and the coverage loss
Σ_i min(a_i^t, c_i^t) (See eq. 12) penalises attending again to what is already covered.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, hooks
from attnkit import taxonomy as tx
from attnkit.checks import resolve_alignment
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["CoverageAttention", "CoverageOutput", "coverage_loss", "doubly_stochastic_penalty"]


def coverage_loss(weights: Tensor, coverage: Tensor) -> Tensor:
    """See et al. eq. 12 summed over steps: Σ_t Σ_i min(a_i^t, c_i^t), per item (B,).

    Args:
        weights: a^t (B, T, n); coverage: c^t (B, T, n), the coverage before each step; one
            shape (no broadcasting) and one dtype.
    """
    _steps(weights, "weights")
    _steps(coverage, "coverage")
    checks.same_shape(("weights", weights), ("coverage", coverage))
    checks.same_kind(("weights", weights), ("coverage", coverage))
    return torch.minimum(weights, coverage).sum((-1, -2))


def _steps(x: object, name: str) -> Tensor:
    """A floating (B, T, n) tensor of per-step weights."""
    x = checks.floating(x, name, "(B, T, n)")
    if x.dim() != 3:
        raise ValueError(f"{name} must be (B, T, n), got shape {tuple(x.shape)}")
    return x


def doubly_stochastic_penalty(weights: Tensor, mask: Tensor | None = None) -> Tensor:
    """Xu et al. (2015) eq. 14: Σ_i (1 − Σ_t α_ti)², per item (B,), pushing every location to
    receive about as much attention in total as the others (for T steps over n locations the
    paper's target is 1; τ = T/n is the natural one when T ≠ n — scale the weights first).

    Args:
        weights: α (B, T, n); mask: (B, n) or (B, 1, n), True = a real location (padded
            locations add nothing).
    """
    _steps(weights, "weights")
    gap = (1 - weights.sum(-2)) ** 2  # (B, n)
    if mask is not None:
        b, n = gap.shape
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(
                f"mask must be a boolean tensor (True = a real location), got {got}; convert a "
                "0/1 tensor with mask.bool()"
            )
        if tuple(mask.shape) not in ((b, n), (b, 1, n)):
            raise ValueError(
                f"mask must be ({b}, {n}) or ({b}, 1, {n}) (B, n) for weights of shape "
                f"{tuple(weights.shape)}, got shape {tuple(mask.shape)}"
            )
        gap = gap * mask.reshape(gap.shape).to(gap.dtype)
    return gap.sum(-1)


class CoverageOutput(NamedTuple):
    """contexts (B, T, d_v), weights a^t (B, T, n), coverage c^t before each step (B, T, n),
    coverage loss per item (B,)."""

    contexts: Tensor
    weights: Tensor
    coverage: Tensor
    loss: Tensor

    @property
    def representation(self) -> Tensor:
        """The context at every step (B, T, d_v)."""
        return self.contexts

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("coverage")
class CoverageAttention(nn.Module):
    """Additive attention with a coverage feature, over T decoder states attending n encoder
    states one step at a time (See et al. eqs. 10-12; Tu et al.'s linguistic coverage with
    the accumulated weights as the coverage).

    Args:
        d_q: decoder state size (s_t); d_k: encoder state size (h_i); d_w: hidden size.
        align: the alignment (default softmax).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("keys", "values")}

    def __init__(
        self,
        d_q: int,
        d_k: int,
        d_w: int,
        *,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(d_q=d_q, d_k=d_k, d_w=d_w)
        kw = {"device": device, "dtype": dtype}
        self.d_q, self.d_k = d_q, d_k
        self.W_h = nn.Linear(d_k, d_w, bias=False, **kw)
        self.W_s = nn.Linear(d_q, d_w, **kw)  # its bias is b
        self.w_c = nn.Parameter(torch.randn(d_w, **kw) * 0.5)
        self.v = nn.Linear(d_w, 1, bias=False, **kw)
        self.align = resolve_alignment(align, device=device, dtype=dtype)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(queries (2, 3, 4), keys (2, 5, 6), values (2, 5, 2)), a mask."""
        from attnkit import masks

        args = (example_tensor(2, 3, 4, seed=0), example_tensor(2, 5, 6, seed=1))
        values = example_tensor(2, 5, 2, seed=2)
        mask = masks.from_lengths(torch.tensor([5, 3]), 5)
        return cls(4, 6, 7), args, {"values": values, "mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.ADDITIVE]

    def step(
        self, query: Tensor, projected_keys: Tensor, coverage: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """One decoder step: the weights a^t (B, n) of See eq. 11 and the alignment, from the
        decoder state s_t (B, d_q), the projected keys W_h h_i (B, n, d_w), the coverage c^t
        (B, n) and the mask (B, n), True = a real key. For decoders that run step by step
        (e.g. the ``dates`` task's ``attention=coverage``)."""
        hidden = projected_keys + self.W_s(query).unsqueeze(-2)
        hidden = hidden + coverage.unsqueeze(-1) * self.w_c  # w_c c_i^t (eq. 11)
        scores = self.v(torch.tanh(hidden)).squeeze(-1)  # (B, n)
        a = self.align(scores.unsqueeze(-2), None if mask is None else mask.unsqueeze(-2))
        a = a.weights.squeeze(-2)
        hooks.report(self, a)
        return a

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> CoverageOutput:
        """queries: decoder states (B, T, d_q), in order; keys: (B, n, d_k); values (B, n, d_v)
        (default keys); mask (B, n) or (B, 1, n), True = a real key."""
        queries = checks.features(queries, "queries", self.d_q, what="d_q")
        keys = checks.features(keys, "keys", self.d_k, what="d_k")
        values = keys if values is None else checks.features(values, "values")
        checks.same_batch(("queries", queries), ("keys", keys), ("values", values))
        if values.shape[-2] != keys.shape[-2]:
            raise ValueError(
                f"values has {values.shape[-2]} rows (shape {tuple(values.shape)}) but keys has "
                f"{keys.shape[-2]} (shape {tuple(keys.shape)}); they must match"
            )
        mask = checks.feature_mask(mask, keys, "mask", "keys")
        keys = checks.without_padding(keys, mask)
        values = checks.without_padding(values, mask)
        projected_keys = self.W_h(keys)  # (B, n, d_w), once for every step
        coverage = keys.new_zeros(keys.shape[:-1])  # c^0 = 0
        contexts, weights, coverages = [], [], []
        for t in range(queries.shape[1]):
            a = self.step(queries[:, t], projected_keys, coverage, mask)
            contexts.append((a.unsqueeze(-1) * values).sum(-2))
            weights.append(a)
            coverages.append(coverage)
            coverage = coverage + a  # eq. 10
        w, c = torch.stack(weights, 1), torch.stack(coverages, 1)
        return CoverageOutput(torch.stack(contexts, 1), w, c, coverage_loss(w, c))
