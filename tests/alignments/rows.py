"""Apply a per-row reference (written from the equations) to every row of (B, M, N) scores."""

import torch


def per_row(fn, scores, mask=None):
    """fn(e: list of floats-as-tensors (N,), allowed: list[bool], m: row index) -> (N,) weights."""
    b, m, n = scores.shape
    if mask is None:
        mask = torch.ones(b, m, n, dtype=torch.bool)
    mask = mask.expand(b, m, n)
    return torch.stack(
        [
            torch.stack([fn(scores[i, r], mask[i, r].tolist(), r) for r in range(m)])
            for i in range(b)
        ]
    )
