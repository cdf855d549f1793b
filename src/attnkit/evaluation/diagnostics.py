"""Wiegreffe & Pinter's diagnostics (2019, "Attention is not not Explanation", Sec. 3-4;
Galassi VI; Brauwers 4.2.2): is the model's attention more than one of many equally good
distributions?

- :func:`seed_variance` (W&P 3.2): how far the attention of models trained from other random
  seeds lies from a base model's (Jensen-Shannon divergence per example), beside how much their
  outputs differ (total variation). It is the yardstick for an adversary: divergence that
  retraining alone produces says nothing.
- :class:`PooledMLP` and :func:`frozen_weights_probe` (W&P 3.3): a classifier that sees each
  item alone (an MLP per item, no context) and pools the items with given weights. With the
  base model's attention frozen as the pooling weights it should beat uniform pooling if the
  attention marks what matters for the task; ``"learned"`` trains the MLP's own attention.
- :func:`train_adversary` (W&P 4, eq. 1): retrain the model so that its predictions stay those
  of the base model while its attention moves away from the base attention:
  L = Σ TVD(ŷ_adv, ŷ_base) − λ KL(α_adv ‖ α_base), summed over the training examples.

The base model and its examples come as an :class:`attnkit.evaluation.suite.Probe`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from attnkit import arguments, checks
from attnkit.evaluation.counterfactual import (
    _jensen_shannon,
    _total_variation,
    edit_weights,
)

if TYPE_CHECKING:
    from attnkit.evaluation.probe import Probe

__all__ = [
    "AdversaryResult",
    "PooledMLP",
    "SeedVariance",
    "frozen_weights_probe",
    "seed_variance",
    "train_adversary",
    "uniform_pooling",
]

_TINY = 1e-12


def _per_example(x: Tensor) -> Tensor:
    return x.flatten(1).mean(-1) if x.dim() > 1 else x


@dataclass
class SeedVariance:
    """Per other seed s and example b: ``divergence[s, b]`` the JSD of seed s+1's attention from
    the base (seed 0) attention (mean over rows), ``output_change[s, b]`` the TVD of their
    predicted distributions."""

    divergence: Tensor
    output_change: Tensor


def seed_variance(weights: Sequence[Tensor], probabilities: Sequence[Tensor]) -> SeedVariance:
    """Compare models trained from different seeds on the same examples (W&P 3.2).

    Args:
        weights: per seed, attention weights (B, …, N) on the same examples; the first is the
            base model.
        probabilities: per seed, predicted class distributions (B, C).
    """
    if len(weights) < 2 or len(weights) != len(probabilities):
        raise ValueError(
            "seed_variance needs the weights and probabilities of at least two seeds, as many "
            f"of each; got {len(weights)} weights and {len(probabilities)} probabilities"
        )
    base_w, base_p = weights[0], probabilities[0]
    for i, (w, p) in enumerate(zip(weights, probabilities, strict=True)):
        checks.floating(w, f"weights[{i}]", "(B, …, N)")
        checks.floating(p, f"probabilities[{i}]", "(B, C)")
        if w.shape != base_w.shape or p.shape != base_p.shape:
            raise ValueError(
                f"every seed's weights must be {tuple(base_w.shape)} and probabilities "
                f"{tuple(base_p.shape)}; got {tuple(w.shape)} and {tuple(p.shape)}"
            )
        checks.distributions(w, f"weights[{i}]")
        checks.distributions(p, f"probabilities[{i}]")
    divergence = torch.stack([_per_example(_jensen_shannon(w, base_w)) for w in weights[1:]])
    change = torch.stack([_total_variation(p, base_p) for p in probabilities[1:]])
    return SeedVariance(divergence, change)


class PooledMLP(nn.Module):
    """W&P 3.3's diagnostic classifier: h_t = ReLU(W x_t + b) for each item alone, pooled as
    c = Σ_t α_t h_t, logits = U c + u. With ``learned=True`` it has its own attention,
    α = softmax_t(w · tanh(h_t)) over the kept items; otherwise α is given to ``forward``.

    Shapes: x (B, N, d), keep (B, N) bool, weights (B, N).
    """

    def __init__(self, d: int, hidden: int, n_classes: int, *, learned: bool = False) -> None:
        super().__init__()
        d = arguments.positive_int(d, "d")
        hidden = arguments.positive_int(hidden, "hidden")
        n_classes = arguments.positive_int(n_classes, "n_classes")
        self.item = nn.Linear(d, hidden)
        self.out = nn.Linear(hidden, n_classes)
        self.score = nn.Linear(hidden, 1, bias=False) if learned else None

    def forward(self, x: Tensor, keep: Tensor, weights: Tensor | None = None) -> Tensor:
        h = torch.relu(self.item(x))
        if self.score is not None:
            if weights is not None:
                raise ValueError("PooledMLP(learned=True) computes its own weights; pass none")
            e = self.score(torch.tanh(h)).squeeze(-1).masked_fill(~keep, float("-inf"))
            weights = torch.softmax(e, -1).nan_to_num(0.0)
        elif weights is None:
            raise ValueError("PooledMLP(learned=False) needs weights (B, N)")
        if weights.shape != keep.shape:
            raise ValueError(
                f"weights must be (B, N) = {tuple(keep.shape)}, got {tuple(weights.shape)}"
            )
        pooled = torch.einsum("bn,bnh->bh", weights * keep, h)
        return self.out(pooled)


def uniform_pooling(keep: Tensor) -> Tensor:
    """Uniform weights over each example's kept items (B, N)."""
    k = keep.to(torch.get_default_dtype())
    return k / k.sum(-1, keepdim=True).clamp_min(1)


def frozen_weights_probe(
    inputs: Tensor,
    keep: Tensor,
    labels: Tensor,
    weights: Mapping[str, Tensor | str],
    *,
    train: Tensor,
    hidden: int = 64,
    steps: int = 300,
    lr: float = 1e-2,
    seed: int = 0,
) -> dict[str, float]:
    """Held-out accuracy of a :class:`PooledMLP` trained with each pooling (W&P 3.3).

    Args:
        inputs: item embeddings (B, N, d), held fixed (detached).
        keep: (B, N) True for real items.
        labels: (B,) classes the MLP is trained on (the task's labels, or the base model's
            predictions to ask what its attention carries about its own decisions).
        weights: name → (B, N) pooling weights held frozen (e.g. the base model's attention,
            :func:`uniform_pooling`), or ``"learned"`` for the MLP's own attention.
        train: (B,) bool, the examples to train on; accuracy is measured on the others.
        steps: full-batch Adam steps. Every condition starts from the same initial MLP.

    Returns:
        name → accuracy on the held-out examples.
    """
    if inputs.dim() != 3 or keep.shape != inputs.shape[:2] or labels.shape != inputs.shape[:1]:
        raise ValueError(
            f"inputs must be (B, N, d) with keep (B, N) and labels (B,); got {tuple(inputs.shape)}"
            f", {tuple(keep.shape)} and {tuple(labels.shape)}"
        )
    if train.dtype != torch.bool or train.shape != labels.shape:
        raise ValueError(f"train must be a bool tensor (B,) = {tuple(labels.shape)}")
    if bool(train.all()) or not bool(train.any()):
        raise ValueError("train must leave some examples to train on and some held out")
    x = inputs.detach()
    n_classes = int(labels.max()) + 1
    held_out = ~train
    out: dict[str, float] = {}
    for name, w in weights.items():
        learned = isinstance(w, str)
        if learned and w != "learned":
            raise ValueError(f"weights[{name!r}] must be a (B, N) tensor or 'learned', got {w!r}")
        torch.manual_seed(seed)
        mlp = PooledMLP(x.shape[-1], hidden, n_classes, learned=learned).to(x.dtype)
        given = None if learned else w.detach().to(x.dtype)
        optimizer = torch.optim.Adam(mlp.parameters(), lr=lr)
        for _ in range(steps):
            optimizer.zero_grad()
            logits = mlp(x[train], keep[train], None if given is None else given[train])
            nn.functional.cross_entropy(logits, labels[train]).backward()
            optimizer.step()
        with torch.no_grad():
            logits = mlp(x[held_out], keep[held_out], None if given is None else given[held_out])
        out[name] = float((logits.argmax(-1) == labels[held_out]).double().mean())
    return out


@dataclass
class AdversaryResult:
    """The adversary trained by :func:`train_adversary`, on every probe example.

    Attributes:
        divergence: (B,) JSD of the adversary's attention from the base attention.
        output_change: (B,) TVD of the adversary's predictions from the base model's.
        agreement: share of held-out examples (not in ``train``) with the same predicted class.
        weights: the adversary's attention (B, …, N).
    """

    divergence: Tensor
    output_change: Tensor
    agreement: float
    weights: Tensor


def _run(probe: Probe) -> tuple[Tensor, Tensor]:
    """The probe's logits and its attention part's weights (differentiable)."""
    seen: list[Tensor] = []

    def record(w: Tensor, m: Tensor | None) -> Tensor:
        seen.append(w)
        return w

    with edit_weights(probe.model, record, only=probe.attention_part):
        logits = probe.logits(probe.inputs.detach(), probe.keep)
    if len(seen) != 1:
        raise ValueError(
            f"train_adversary: the probe made {len(seen)} alignment calls; name the attention "
            "part called once per run (Probe.attention_part)"
        )
    return logits, seen[0]


def train_adversary(
    probe: Probe,
    *,
    train: Tensor,
    lam: float = 1.0,
    steps: int = 200,
    lr: float = 1e-3,
) -> AdversaryResult:
    """W&P 4's adversarial model: fine-tune the probe's model from its own parameters on the
    ``train`` examples with L = mean TVD(ŷ_adv, ŷ_base) − λ mean KL(α_adv ‖ α_base) (W&P eq. 1;
    the base attention is clamped at 1e-12 inside the log so that sparse weights give a finite
    KL), then measure it on every example. The model's parameters are restored afterwards,
    also when training fails.

    W&P train the adversary from scratch on the training set; here it starts from the base
    model and sees only the probe's examples, so ``agreement`` on the held-out ones says
    whether the predictions it keeps generalise beyond the examples it was fitted to.
    """
    if not (isinstance(lam, (int, float)) and lam >= 0):
        raise ValueError(f"lam must be a number ≥ 0, got {lam!r}")
    steps = arguments.nonnegative_int(steps, "steps")
    if train.dtype != torch.bool or train.shape != probe.keep.shape[:1]:
        raise ValueError(f"train must be a bool tensor (B,) = {tuple(probe.keep.shape[:1])}")
    model = probe.model
    saved = copy.deepcopy(model.state_dict())
    try:
        with torch.no_grad():
            logits, base_w = _run(probe)
        base_p = logits.softmax(-1)
        log_base = base_w.clamp_min(_TINY).log()
        rows = train.to(logits.dtype)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
        for _ in range(steps):
            optimizer.zero_grad()
            logits, w = _run(probe)
            tvd = _total_variation(logits.softmax(-1), base_p)
            kl = _per_example((w * (w.clamp_min(_TINY).log() - log_base)).sum(-1))
            loss = ((tvd - lam * kl) * rows).sum() / rows.sum()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            logits, w = _run(probe)
            held_out = ~train
            same = logits.argmax(-1) == base_p.argmax(-1)
            agreement = float(same[held_out].double().mean()) if bool(held_out.any()) else 1.0
            return AdversaryResult(
                _per_example(_jensen_shannon(w, base_w)),
                _total_variation(logits.softmax(-1), base_p),
                agreement,
                w.detach(),
            )
    finally:
        model.load_state_dict(saved)
