"""A small generated task that only a role-dependent score can learn: direction.

Tokens 0 … V−1 on a cycle, one-hot. A pair (query x, key y) with y = x ± 1 (mod V) is positive
when y = x + 1 and negative when y = x − 1. The pairs (x, x + 1) and (x + 1, x) hold the same two
tokens in swapped roles with opposite labels, so a symmetric score (e(x, y) = e(y, x)) gets
exactly one of each such pair right: at most 1/2 of the 2V pairs. A score that depends on the
roles can get all of them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

V = 8


def pairs() -> tuple[Tensor, Tensor, Tensor]:
    """All 2V pairs: queries (2V, 1, V), keys (2V, 1, V) one-hot, labels (2V,) in {0, 1}."""
    x = torch.arange(V).repeat(2)
    step = torch.cat([torch.ones(V, dtype=torch.long), -torch.ones(V, dtype=torch.long)])
    y = (x + step) % V
    eye = torch.eye(V)
    return eye[x][:, None], eye[y][:, None], (step > 0).float()


def direction_accuracy(score: nn.Module, steps: int = 150, lr: float = 0.05) -> float:
    """Accuracy on all 2V pairs of sigmoid(score(x, y) + c) after ``steps`` Adam steps on the
    logistic loss (c a learned offset)."""
    torch.manual_seed(0)
    offset = nn.Parameter(torch.zeros(()))
    opt = torch.optim.Adam([*score.parameters(), offset], lr)
    q, k, label = pairs()
    for _ in range(steps):
        logit = score(q, k)[:, 0, 0] + offset
        loss = nn.functional.binary_cross_entropy_with_logits(logit, label)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        logit = score(q, k)[:, 0, 0] + offset
    return float(((logit > 0).float() == label).float().mean())
