"""Logical rules constraining attention (Galassi VI-E; Li & Srikumar 2019, "Augmenting Neural
Networks with First-order Logic", where rules governing attention enforce word alignment).

A rule over alignment links A(i, j) — target position i is aligned with source position j — is
made differentiable by reading the weight a_ij as the truth value of A(i, j) and a conjunction
as a product (the product t-norm). A rule that forbids a conjunction, ¬(A(i, j) ∧ A(i', j')),
is violated to the degree a_ij·a_i'j'; the sum over its groundings is a penalty added to the
loss with a factor λ (as Hu et al. 2016 distil rules into a network through its training
loss). Two word-alignment priors:

- monotone alignment, ∀ i, j' < j: ¬(A(i, j) ∧ A(i+1, j')) — consecutive target words do not
  cross: :func:`monotonicity_violation`;
- one-to-one alignment, ∀ j, i ≠ i': ¬(A(i, j) ∧ A(i', j)) — a source word is aligned at most
  once: :func:`one_to_one_violation`.

Li & Srikumar instead add a rule's antecedent to the scores before the softmax
(:func:`rule_bias`): "if i and j are linked in a lexicon, attend". :func:`monotone_rate` and
:func:`one_to_one_rate` measure how often the hard alignments (row argmax) keep a rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import arguments, checks

__all__ = [
    "monotone_rate",
    "monotonicity_violation",
    "one_to_one_rate",
    "one_to_one_violation",
    "rule_bias",
]


def _weights(weights: object) -> Tensor:
    return checks.floating(weights, "weights", "(…, M, N)", min_dim=2)


def _rows(rows: Tensor | None, weights: Tensor) -> Tensor:
    shape = tuple(weights.shape[:-1])
    if rows is None:
        return torch.ones(shape, dtype=torch.bool, device=weights.device)
    rows = checks.boolean_mask(rows, "rows", shape, meaning="True = a real target position")
    return rows.expand(shape)


def monotonicity_violation(weights: Tensor, rows: Tensor | None = None) -> Tensor:
    """Σ_i Σ_j Σ_{j'<j} a_{i,j}·a_{i+1,j'} per item, divided by the number of consecutive row
    pairs: the expected number of crossings between consecutive target positions (0 for a
    monotone alignment).

    Args:
        weights: (…, M, N), target positions × source positions.
        rows: (…, M) boolean, True = a real target position (pairs with a padded row do not
            count).

    Returns:
        (…,) one value per item.
    """
    weights = _weights(weights)
    keep = _rows(rows, weights)
    # before[i, j] = Σ_{j' < j} a_{i, j'}
    before = weights.cumsum(-1) - weights
    crossing = (weights[..., :-1, :] * before[..., 1:, :]).sum(-1)  # (…, M − 1)
    pair = (keep[..., :-1] & keep[..., 1:]).to(weights.dtype)
    return (crossing * pair).sum(-1) / pair.sum(-1).clamp_min(1)


def one_to_one_violation(weights: Tensor, rows: Tensor | None = None) -> Tensor:
    """Σ_j Σ_{i<i'} a_{i,j}·a_{i',j} = ½ Σ_j [(Σ_i a_ij)² − Σ_i a_ij²] per item, divided by the
    number of rows: the expected number of source positions shared by two target positions,
    per target position (0 when no two rows share a column). Arguments as
    :func:`monotonicity_violation`."""
    weights = _weights(weights)
    keep = _rows(rows, weights).to(weights.dtype).unsqueeze(-1)
    a = weights * keep
    shared = 0.5 * (a.sum(-2).pow(2) - a.pow(2).sum(-2)).sum(-1)
    return shared / keep.sum((-2, -1)).clamp_min(1)


def rule_bias(antecedent: Tensor, strength: float = 1.0) -> Tensor:
    """Li & Srikumar's rule-augmented scores: the bias ρ·z_ij to add to the scores (the
    ``bias`` argument of :func:`attnkit.attention`), z_ij ∈ [0, 1] the truth of the rule's
    antecedent for the pair (e.g. 1 where i and j are linked in a lexicon), ρ = ``strength``."""
    if not isinstance(antecedent, Tensor):
        raise TypeError(f"antecedent must be a tensor (…, M, N), got {type(antecedent).__name__}")
    z = antecedent.float() if antecedent.dtype == torch.bool else antecedent
    z = checks.floating(z, "antecedent", "(…, M, N)", min_dim=2)
    if bool(((z < 0) | (z > 1)).any()):
        raise ValueError("antecedent must hold truth values in [0, 1]")
    return arguments.finite_float(strength, "strength") * z


def _hard(weights: Tensor, rows: Tensor | None) -> tuple[Tensor, Tensor]:
    weights = _weights(weights)
    return weights.argmax(-1), _rows(rows, weights)


def monotone_rate(weights: Tensor, rows: Tensor | None = None) -> float:
    """The share of consecutive real row pairs (i, i+1) whose hard alignments do not cross,
    argmax_j a_{i+1,j} ≥ argmax_j a_{i,j} (NaN when there is none)."""
    hard, keep = _hard(weights, rows)
    pair = keep[..., :-1] & keep[..., 1:]
    ok = (hard[..., 1:] >= hard[..., :-1]) & pair
    return float(ok.sum()) / int(pair.sum()) if bool(pair.any()) else float("nan")


def one_to_one_rate(weights: Tensor, rows: Tensor | None = None) -> float:
    """The share of real rows whose hard alignment (argmax) no other real row of the item
    shares (NaN when there is none)."""
    hard, keep = _hard(weights, rows)
    n = weights.shape[-1]
    onehot = torch.nn.functional.one_hot(hard, n) * keep.unsqueeze(-1)
    uses = onehot.sum(-2, keepdim=True)  # (…, 1, N): rows aligned with each column
    alone = (onehot * uses).sum(-1) == 1
    return float((alone & keep).sum()) / int(keep.sum()) if bool(keep.any()) else float("nan")
