"""Counterfactual attention: does the output change when the weights do? (Jain & Wallace 2019,
Sec. 4; Wiegreffe & Pinter 2019, Sec. 3-4; Brauwers 4.2.2; Galassi VI.)

- :func:`permuted_weights`: each attention row's weights shuffled among its attendable keys,
  many times; the distribution of the output change (Jain & Wallace 4.1).
- :func:`adversarial_weights`: per example, weights as far as possible from the learned ones
  (Jensen-Shannon divergence) while the output moves by less than ε (Jain & Wallace 4.2, eq. 1).
- :func:`uniform_baseline`: the output change when every alignment gives uniform weights
  (Wiegreffe & Pinter 3.1).

Each works on any model built from attnkit parts: the weights are edited where they are made,
in the alignment parts (:func:`edit_weights`), so the model's own code is untouched. ``run`` is
a function of no arguments returning the model's class logits (B, C) on fixed inputs (the
examples, eval mode); output change is the total variation distance between the softmax
distributions, TVD(p, q) = ½ Σ |p − q| (Jain & Wallace eq. 2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnkit import checks
from attnkit.alignments import Alignment, AlignOutput, masked_softmax
from attnkit.evaluation.ablation import uniform_weights

__all__ = [
    "AdversarialResult",
    "PermutationResult",
    "adversarial_weights",
    "edit_weights",
    "jensen_shannon",
    "permute_rows",
    "permuted_weights",
    "total_variation",
    "uniform_baseline",
]

Edit = Callable[[Tensor, Tensor | None], Tensor]
"""``edit(weights (…, M, N), mask broadcastable or None) -> new weights``."""


class _Edited(Alignment):
    """An alignment whose weights pass through ``edit`` (the original part stays inside)."""

    def __init__(self, inner: Alignment, edit: Edit) -> None:
        super().__init__()
        self.inner = inner
        self.edit = edit
        self.normalized = inner.normalized
        self.label = inner.label

    def taxonomy_tags(self) -> list:
        return self.inner.taxonomy_tags()

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        out = self.inner(scores, mask, query=query)
        return AlignOutput(self.edit(out.weights, mask), out.log_prob)


@contextmanager
def edit_weights(model: nn.Module, edit: Edit, *, only: str | None = None) -> Iterator[nn.Module]:
    """Inside the block, the weights made by every alignment part of ``model`` (each submodule
    registered as ``align``, as in :func:`attnkit.evaluation.uniform_weights`) are replaced by
    ``edit(weights, mask)``; with ``only``, just the parts inside the submodule of that name
    (as :func:`attnkit.evaluation.capture` names it). Restored afterwards, even on error."""
    root = model
    if only is not None:
        named = dict(model.named_modules())
        if only not in named:
            raise ValueError(
                f"only={only!r} is not a submodule of the model; attention parts: "
                f"{[n for n, m in named.items() if isinstance(m._modules.get('align'), Alignment)]}"
            )
        root = named[only]
    saved = []
    for module in root.modules():
        align = module._modules.get("align")
        if isinstance(align, Alignment) and not isinstance(align, _Edited):
            saved.append((module, align))
            module.align = _Edited(align, edit)
    if not saved:
        raise ValueError("edit_weights: the model has no alignment part to edit")
    try:
        yield model
    finally:
        for module, align in saved:
            module.align = align


def _pair(p: object, q: object) -> None:
    """p and q: floating tensors (…, N) of one shape, each row a probability distribution."""
    checks.floating(p, "p", "(…, N)")
    checks.floating(q, "q", "(…, N)")
    checks.same_shape(("p", p), ("q", q))
    checks.distributions(p, "p")
    checks.distributions(q, "q")


def total_variation(p: Tensor, q: Tensor) -> Tensor:
    """TVD(p, q) = ½ Σ |p − q| over the last dim (Jain & Wallace eq. 2); in [0, 1].

    Args:
        p, q: (…, N) probability distributions over the last dim, of one shape (rows summing
            to 0, e.g. a query with no key allowed, are accepted as empty).
    """
    _pair(p, q)
    return _total_variation(p, q)


def _total_variation(p: Tensor, q: Tensor) -> Tensor:
    return 0.5 * (p - q).abs().sum(-1)


def jensen_shannon(p: Tensor, q: Tensor) -> Tensor:
    """JSD(p, q) = ½ KL(p ‖ m) + ½ KL(q ‖ m), m = (p + q)/2, in nats over the last dim
    (Jain & Wallace eq. 3); in [0, ln 2].

    Args:
        p, q: (…, N) probability distributions over the last dim, of one shape (negative
            entries or rows not summing to 1 are refused: the bound ln 2 needs distributions).
    """
    _pair(p, q)
    return _jensen_shannon(p, q)


def _jensen_shannon(p: Tensor, q: Tensor) -> Tensor:
    m = 0.5 * (p + q)

    def kl(a: Tensor) -> Tensor:
        safe = torch.where(a > 0, a / m.clamp_min(torch.finfo(m.dtype).tiny), torch.ones_like(a))
        return (a * safe.log()).sum(-1)

    return (0.5 * kl(p) + 0.5 * kl(q)).clamp_min(0)


def _probabilities(run: Callable[[], Tensor]) -> Tensor:
    logits = run()
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        raise ValueError(
            "run() must return class logits (B, C), got "
            f"{tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__}"
        )
    return logits.softmax(-1)


def permute_rows(weights: Tensor, mask: Tensor | None, generator: torch.Generator) -> Tensor:
    """Each row's weights shuffled at random among the keys it may attend (masked keys keep
    weight 0)."""
    allowed = torch.ones_like(weights, dtype=torch.bool) if mask is None else mask
    allowed = allowed.expand_as(weights)
    n = weights.shape[-1]
    noise = torch.rand(weights.shape, generator=generator, dtype=torch.float64)
    noise = noise.to(weights.device)
    positions = torch.arange(n, device=weights.device, dtype=torch.float64).expand_as(noise)
    ascending = torch.where(allowed, positions, positions + n).argsort(-1)
    shuffled = torch.where(allowed, noise, noise + 2).argsort(-1)
    return torch.zeros_like(weights).scatter(-1, ascending, weights.gather(-1, shuffled))


@dataclass(frozen=True)
class PermutationResult:
    """``output_change`` (B, n_permutations): TVD between the outputs under learned and
    permuted weights; ``median`` (B,) its median per example (Jain & Wallace Fig. 3)."""

    output_change: Tensor

    @property
    def median(self) -> Tensor:
        return self.output_change.median(-1).values


@torch.no_grad()
def permuted_weights(
    model: nn.Module,
    run: Callable[[], Tensor],
    *,
    n_permutations: int = 100,
    seed: int = 0,
    only: str | None = None,
) -> PermutationResult:
    """Output change under randomly permuted weights (Jain & Wallace 2019, Sec. 4.1): each
    forward pass permutes every alignment row (of the part ``only``, else of all parts) anew."""
    if isinstance(n_permutations, bool) or not isinstance(n_permutations, int):
        raise TypeError(f"n_permutations must be an int, got {n_permutations!r}")
    if n_permutations < 1:
        raise ValueError(f"n_permutations must be ≥ 1, got {n_permutations}")
    generator = torch.Generator().manual_seed(seed)
    learned = _probabilities(run)
    changes = []
    with edit_weights(model, lambda w, m: permute_rows(w, m, generator), only=only):
        for _ in range(n_permutations):
            changes.append(_total_variation(learned, _probabilities(run)))
    return PermutationResult(torch.stack(changes, -1))


@torch.no_grad()
def uniform_baseline(model: nn.Module, run: Callable[[], Tensor]) -> Tensor:
    """TVD (B,) between the outputs with the learned weights and with uniform weights over the
    attendable keys (Wiegreffe & Pinter 2019, Sec. 3.1: when this is small, attention is not
    needed and says little)."""
    learned = _probabilities(run)
    with uniform_weights(model):
        return _total_variation(learned, _probabilities(run))


@dataclass(frozen=True)
class AdversarialResult:
    """Per example: the adversarial ``weights`` (the learned ones where no feasible change was
    found), their ``divergence`` (JSD from the learned weights, nats, mean over the rows of the
    example) and the ``output_change`` (TVD) they cause, always < ε."""

    weights: Tensor
    learned: Tensor
    divergence: Tensor
    output_change: Tensor
    epsilon: float


def _per_example(x: Tensor) -> Tensor:
    return x.flatten(1).mean(-1) if x.dim() > 1 else x


def adversarial_weights(
    model: nn.Module,
    run: Callable[[], Tensor],
    *,
    epsilon: float = 0.01,
    steps: int = 200,
    lr: float = 0.1,
    penalty: float = 100.0,
    only: str | None = None,
    seed: int = 0,
) -> AdversarialResult:
    """Jain & Wallace's adversarial attention (2019, Sec. 4.2): for each example, weights α̃
    that maximise JSD(α̃, α̂) from the learned α̂ subject to TVD(ŷ(α̃), ŷ(α̂)) < ε.

    α̃ = masked softmax(θ) over the keys each row may attend; θ starts at log α̂ plus noise and
    follows Adam on −JSD + ``penalty``·max(0, TVD − ε/2) per example. The result is the feasible
    iterate (TVD < ε, checked on a forward pass) with the largest JSD seen, so the constraint
    holds by construction; an example where none is feasible keeps α̂ (JSD 0).

    The attention part edited (``only``, else the model's single alignment part) must be called
    exactly once per ``run()``. The model's parameters are not changed.
    """
    if not (isinstance(epsilon, (int, float)) and epsilon > 0):
        raise ValueError(f"epsilon must be a positive number, got {epsilon!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int ≥ 1, got {steps!r}")
    seen: list[tuple[Tensor, Tensor | None]] = []

    def record(w: Tensor, m: Tensor | None) -> Tensor:
        seen.append((w.detach(), m))
        return w

    with torch.no_grad(), edit_weights(model, record, only=only):
        learned_p = _probabilities(run)
    if len(seen) != 1:
        raise ValueError(
            f"adversarial_weights: run() made {len(seen)} alignment calls; name the attention "
            "part called once per run with only="
        )
    learned, mask = seen[0]
    if learned.shape[0] != learned_p.shape[0]:
        raise ValueError("adversarial_weights: the weights' first dim must be the batch")
    allowed = None if mask is None else mask.expand_as(learned)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(learned.shape, generator=generator, dtype=learned.dtype)
    theta = (learned.clamp_min(1e-12).log() + noise.to(learned.device)).requires_grad_(True)
    optimizer = torch.optim.Adam([theta], lr=lr)
    best = learned.clone()
    best_jsd = torch.zeros(learned.shape[0], dtype=learned.dtype, device=learned.device)
    best_tvd = torch.zeros_like(best_jsd)

    def attempt() -> tuple[Tensor, Tensor, Tensor]:
        current = masked_softmax(theta, allowed)
        with edit_weights(model, lambda w, m: current, only=only):
            tvd = _total_variation(learned_p, _probabilities(run))
        return current, _per_example(_jensen_shannon(current, learned)), tvd

    for _ in range(steps + 1):
        with torch.enable_grad():
            current, jsd, tvd = attempt()
        with torch.no_grad():
            better = (tvd < epsilon) & (jsd > best_jsd)
            pick = better.view(-1, *[1] * (learned.dim() - 1))
            best = torch.where(pick, current.detach(), best)
            best_jsd = torch.where(better, jsd.detach(), best_jsd)
            best_tvd = torch.where(better, tvd.detach(), best_tvd)
        loss = (-jsd + penalty * (tvd - epsilon / 2).clamp_min(0)).sum()
        optimizer.zero_grad()
        (grad,) = torch.autograd.grad(loss, theta)
        theta.grad = grad
        optimizer.step()
    return AdversarialResult(best, learned, best_jsd, best_tvd, float(epsilon))
