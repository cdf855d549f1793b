"""Attention weights as the input features of a probe (Galassi VI-A): does a model's attention
encode a relation between tokens it was never trained on?

Clark et al. (2019, "What Does BERT Look At?", Sec. 5) probe a model for dependency relations
with an *attention-only probe*: for a token i, the probability that token j is its head is a
softmax over the candidates j of a linear function of the attention weights between the two
tokens, in both directions, of every layer and head k:

    p(j | i) ∝ exp(Σ_k w_k a^k_ij + u_k a^k_ji).

Only the 2K coefficients (w, u) are learned, so a high accuracy means the relation is already
in the attention.

- :func:`stack_heads` stacks captured weights (:func:`attnkit.evaluation.capture`) of every
  layer into (B, K, N, N).
- :func:`pair_features` builds the (B, N, N, 2K) features [a^k_ij, a^k_ji].
- :class:`AttentionProbe` is the probe; :func:`fit_probe` trains it by cross-entropy;
  :func:`probe_accuracy` scores it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from attnkit import arguments, checks
from attnkit.alignments.base import masked_log_softmax

__all__ = ["AttentionProbe", "fit_probe", "pair_features", "probe_accuracy", "stack_heads"]


def stack_heads(records: Mapping[str, Sequence[Tensor]]) -> Tensor:
    """The weights of every captured self-attention call, heads side by side: from
    ``records[name] = [(B, H, N, N), …]`` (as :func:`attnkit.evaluation.capture` fills it) to
    (B, K, N, N) with K the total number of heads, in record order."""
    if not isinstance(records, Mapping) or not records:
        raise ValueError("records must be a non-empty mapping of name -> list of weights")
    parts = []
    for name, calls in records.items():
        for w in calls:
            if not isinstance(w, Tensor) or w.dim() != 4 or w.shape[-1] != w.shape[-2]:
                raise ValueError(
                    f"records[{name!r}] must hold self-attention weights (B, H, N, N), got "
                    f"{getattr(w, 'shape', type(w).__name__)}"
                )
            parts.append(w)
    return torch.cat(parts, dim=1)


def pair_features(weights: Tensor) -> Tensor:
    """Features of every token pair from self-attention weights (B, K, N, N): (B, N, N, 2K),
    where features[b, i, j] = [a^1_ij … a^K_ij, a^1_ji … a^K_ji]."""
    weights = checks.floating(weights, "weights", "(B, K, N, N)", min_dim=4)
    if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must be (B, K, N, N), got shape {tuple(weights.shape)}")
    forward = weights.permute(0, 2, 3, 1)  # (B, i, j, K): a_ij
    backward = weights.transpose(-1, -2).permute(0, 2, 3, 1)  # a_ji
    return torch.cat([forward, backward], dim=-1)


class AttentionProbe(nn.Module):
    """Clark et al.'s attention-only probe: log p(j | i) = log softmax_j(Σ_f c_f x_ijf) over
    the candidates j, with x the pair features (:func:`pair_features`) and c one coefficient
    per feature (no bias: a constant cannot rank candidates).

    Args:
        features: the number of features per pair, 2K.
        device, dtype: the coefficients'.
    """

    def __init__(
        self,
        features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(features, "features")
        self.coefficients = nn.Linear(features, 1, bias=False, device=device, dtype=dtype)
        nn.init.zeros_(self.coefficients.weight)

    def forward(self, features: Tensor, mask: Tensor | None = None) -> Tensor:
        """log p(j | i), (B, N, N), from features (B, N, N, F); ``mask`` (broadcastable to
        (B, N, N), True = j is a candidate for i) rules candidates out (log p = −inf; a row
        without candidates is all −inf)."""
        features = checks.floating(features, "features", "(B, N, N, F)", min_dim=3)
        logits = self.coefficients(features).squeeze(-1)
        if mask is not None:
            mask = checks.boolean_mask(mask, "mask", tuple(logits.shape), meaning="a candidate")
            mask = mask.expand(logits.shape)
        return masked_log_softmax(logits, mask)


def _targets(targets: object, shape: tuple[int, ...], n: int) -> Tensor:
    if not isinstance(targets, Tensor) or targets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"targets must be an integer tensor (B, N) (−1 = none), got {targets!r}")
    if tuple(targets.shape) != shape:
        raise ValueError(f"targets must have shape {shape}, got {tuple(targets.shape)}")
    if bool(((targets < -1) | (targets >= n)).any()):
        raise ValueError(f"targets must be token indices in [0, {n}) or −1")
    return targets.long()


def fit_probe(
    features: Tensor,
    targets: Tensor,
    *,
    mask: Tensor | None = None,
    steps: int = 200,
    lr: float = 0.1,
) -> AttentionProbe:
    """Train an :class:`AttentionProbe` on ``features`` (B, N, N, F) to predict ``targets``
    (B, N) — for each token i the index of its related token j, −1 where it has none — by
    full-batch Adam on the cross-entropy. ``mask`` as :meth:`AttentionProbe.forward`."""
    features = checks.floating(features, "features", "(B, N, N, F)", min_dim=4)
    targets = _targets(targets, tuple(features.shape[:2]), features.shape[2])
    arguments.positive_int(steps, "steps")
    lr = arguments.finite_float(lr, "lr", positive=True)
    features = features.detach()
    probe = AttentionProbe(features.shape[-1], device=features.device, dtype=features.dtype)
    rows = targets >= 0
    if not bool(rows.any()):
        raise ValueError("targets name no related token (all −1): nothing to fit")
    optimiser = torch.optim.Adam(probe.parameters(), lr=lr)
    for _ in range(steps):
        log_p = probe(features, mask)[rows]
        loss = nn.functional.nll_loss(log_p, targets[rows])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return probe


def probe_accuracy(
    probe: AttentionProbe, features: Tensor, targets: Tensor, *, mask: Tensor | None = None
) -> float:
    """The share of tokens with a target (≥ 0) for which the probe's most likely j is it."""
    features = checks.floating(features, "features", "(B, N, N, F)", min_dim=4)
    targets = _targets(targets, tuple(features.shape[:2]), features.shape[2])
    rows = targets >= 0
    if not bool(rows.any()):
        raise ValueError("targets name no related token (all −1): nothing to score")
    with torch.no_grad():
        guess = probe(features, mask).argmax(-1)
    return float((guess == targets)[rows].float().mean())
