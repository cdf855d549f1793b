"""Locality over a graph distance against a loop, and tree distances against a BFS."""

from collections import deque

import pytest
import torch
from helpers import assert_same_forward_backward, rand

from attnkit import alignments as al


def bfs_distances(parents):
    """Path lengths by breadth-first search over the undirected tree edges (inf: unreachable)."""
    n = len(parents)
    nbrs = [[] for _ in range(n)]
    for c, p in enumerate(parents):
        if p >= 0:
            nbrs[c].append(p)
            nbrs[p].append(c)
    out = torch.full((n, n), float("inf"), dtype=torch.float64)
    for s in range(n):
        out[s, s] = 0
        todo = deque([s])
        while todo:
            u = todo.popleft()
            for v in nbrs[u]:
                if out[s, v] == float("inf"):
                    out[s, v] = out[s, u] + 1
                    todo.append(v)
    return out


def row(e, allowed, d, sigma, window):
    """a_l ∝ exp(e_l − d_l²/(2σ²)) over allowed keys with d_l ≤ D (and d_l finite)."""
    keep = [
        allowed[j] and d[j] != float("inf") and (window is None or d[j] <= window)
        for j in range(len(e))
    ]
    if not any(keep):
        return e * 0
    g = [e[j] - (d[j] ** 2 / (2 * sigma**2) if sigma is not None else 0) for j in range(len(e))]
    z = sum(torch.exp(g[j]) for j in range(len(e)) if keep[j])
    return torch.stack([torch.exp(g[j]) / z if keep[j] else e[j] * 0 for j in range(len(e))])


def test_tree_distance_equals_bfs():
    parents = torch.tensor([[1, -1, 1, 2, 2, 0], [-1, 0, 0, -1, 3, 3]])  # a tree; a forest
    dist = al.tree_distance(parents)
    for i in range(2):
        torch.testing.assert_close(dist[i], bfs_distances(parents[i].tolist()))


@pytest.mark.parametrize(("sigma", "window"), [(1.5, None), (None, 1.0), (0.8, 2.0)])
def test_equals_the_loop_over_a_dependency_tree(sigma, window):
    parents = torch.tensor([[1, -1, 1, 2, 2, 0], [-1, 0, 0, -1, 3, 3]])
    dist = al.tree_distance(parents)  # (2, 6, 6): self-attention over the words
    e = rand(2, 6, 6)
    mask = torch.ones(2, 1, 6, dtype=torch.bool)
    mask[1, :, 5] = False
    align = al.GraphLocal(sigma, window=window)

    def loop():
        return torch.stack(
            [
                torch.stack(
                    [row(e[i, m], mask[i, 0].tolist(), dist[i, m], sigma, window) for m in range(6)]
                )
                for i in range(2)
            ]
        )

    assert_same_forward_backward(
        lambda: align(e, mask, distance=dist).weights, loop, [e], atol=1e-12, rtol=1e-10
    )
    # Words of another tree of the forest are out of reach.
    assert (align(e, mask, distance=dist).weights[1, :3, 3:] == 0).all()


def test_default_distance_is_between_positions_and_sigma_learns():
    e = rand(2, 4, 5, seed=1)
    align = al.GraphLocal(1.2, learnable=True, dtype=torch.float64)
    d = (torch.arange(4)[:, None] - torch.arange(5)).abs().double()
    torch.testing.assert_close(align(e).weights, al.GraphLocal(1.2)(e, distance=d).weights)
    align(e).weights[..., 0].sum().backward()
    assert align.log_sigma.grad is not None and align.log_sigma.grad != 0
    fixed = al.GraphLocal(1.2, distance=d)
    torch.testing.assert_close(fixed(e).weights, align(e).weights)


def test_bad_arguments():
    with pytest.raises(ValueError, match="sigma"):
        al.GraphLocal(0.0)
    with pytest.raises(ValueError, match="give sigma"):
        al.GraphLocal(None)
    with pytest.raises(ValueError, match="broadcast"):
        al.GraphLocal()(torch.randn(1, 2, 3), distance=torch.ones(2, 4))
    with pytest.raises(ValueError, match=">= 0"):
        al.GraphLocal()(torch.randn(1, 2, 3), distance=-torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"\[-1, 2\]"):
        al.tree_distance(torch.tensor([0, 5, -1]))
    with pytest.raises(TypeError, match="integer"):
        al.tree_distance(torch.tensor([0.0, -1.0]))
