"""Attention flow (Abnar & Zuidema 2020): the maximum flow from each input token to each
position of the last layer, through the layers' attention graph.

The graph has a node per token and layer (layer 0 the input), and an edge from token j of layer
l − 1 to token i of layer l whose capacity is Ã_l[i, j], the layer's head-averaged weights with
the residual connection (:func:`attnkit.evaluation.rollout.residual_weights`). The flow from
input j to output i is the value of a maximum flow between the two nodes; unlike rollout, which
multiplies the weights along every path, a flow is bounded by the narrowest edges it must
cross. Rows are normalised to sum to 1 by default, as in the authors' code.

The maximum flow is computed by Edmonds–Karp (shortest augmenting paths), written here:
the package does not depend on a graph library.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from attnkit.evaluation.rollout import residual_weights

__all__ = ["attention_flow", "max_flow"]


def max_flow(capacity: np.ndarray | Tensor, source: int, sink: int) -> float:
    """The value of a maximum flow from ``source`` to ``sink`` (Edmonds & Karp 1972).

    Args:
        capacity: (V, V) non-negative capacities, ``capacity[u, v]`` on the edge u → v
            (0 where there is none).
        source, sink: distinct nodes in [0, V).

    Each round finds a shortest path with room left (breadth-first) and sends what its
    narrowest edge allows, until no path is left.
    """
    cap = np.array(capacity.detach().cpu().numpy() if isinstance(capacity, Tensor) else capacity)
    if cap.ndim != 2 or cap.shape[0] != cap.shape[1]:
        raise ValueError(f"capacity must be a square (V, V) matrix, got shape {cap.shape}")
    if not np.issubdtype(cap.dtype, np.number) or np.issubdtype(cap.dtype, np.complexfloating):
        raise TypeError(f"capacity must hold real numbers, got dtype {cap.dtype}")
    cap = cap.astype(np.float64)
    if not np.isfinite(cap).all() or (cap < 0).any():
        raise ValueError("capacity must be finite and non-negative")
    v = cap.shape[0]
    for name, node in (("source", source), ("sink", sink)):
        if isinstance(node, bool) or not isinstance(node, (int, np.integer)) or not 0 <= node < v:
            raise ValueError(f"{name} must be a node in [0, {v}), got {node!r}")
    if source == sink:
        raise ValueError(f"source and sink must differ, both are {source}")
    return _edmonds_karp(cap, int(source), int(sink))


def _edmonds_karp(residual: np.ndarray, source: int, sink: int) -> float:
    """Edmonds–Karp on a float64 capacity matrix, changed in place into the residual graph.
    The breadth-first search runs a level at a time over the whole frontier."""
    eps = 1e-12 * max(float(residual.max()), 1e-300)
    total = 0.0
    while True:
        parent = np.full(residual.shape[0], -1)
        parent[source] = source
        frontier = np.array([source])
        while frontier.size and parent[sink] < 0:
            room = (residual[frontier] > eps) & (parent < 0)  # (F, V): unseen nodes with room
            found = np.flatnonzero(room.any(0))
            parent[found] = frontier[room[:, found].argmax(0)]  # the first frontier node
            frontier = found
        if parent[sink] < 0:
            return total
        path, w = [], sink
        while w != source:
            path.append((int(parent[w]), w))
            w = int(parent[w])
        push = min(residual[u, w] for u, w in path)
        for u, w in path:
            residual[u, w] -= push
            residual[w, u] += push
        total += push


def _layer_graph(layers: list[np.ndarray]) -> np.ndarray:
    """The (V, V) capacities of the layered graph: node l·N + t is token t of layer l, and
    the edge (l − 1, j) → (l, i) carries Ã_l[i, j]."""
    n = layers[0].shape[-1]
    cap = np.zeros(((len(layers) + 1) * n,) * 2)
    for lay, a in enumerate(layers, start=1):
        cap[(lay - 1) * n : lay * n, lay * n : (lay + 1) * n] = a.T
    return cap


def attention_flow(
    weights: Sequence[Tensor],
    *,
    residual: float = 0.5,
    head_dim: int | None = -3,
    normalize: bool = True,
) -> Tensor:
    """Attention flow (Abnar & Zuidema 2020) from every input token to every position of the
    last layer.

    Args:
        weights, residual, head_dim: as :func:`attnkit.evaluation.rollout.residual_weights`:
            one self-attention weight tensor per layer, the input's first, (B, …, H, N, N).
        normalize: divide each row by its sum (the authors' code); False gives the raw flow
            values.

    Returns:
        (B, …, N, N): entry [i, j] the maximum flow from input token j to position i of the
        last layer (in float64 on the CPU arithmetic, returned in the weights' dtype and device).
        It costs N² maximum flows of a graph of (L + 1)·N nodes per batch entry (about 4 s
        for N = 16 tokens and L = 6 layers on one CPU core): meant for sentences, not long
        documents.
    """
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {normalize!r}")
    layers = residual_weights(weights, residual=residual, head_dim=head_dim)
    like = layers[0]
    n, lead = like.shape[-1], like.shape[:-2]
    stacked = torch.stack(layers).detach().to("cpu", torch.float64).numpy()
    stacked = stacked.reshape(len(layers), -1, n, n)
    last = len(layers) * n
    out = np.zeros((stacked.shape[1], n, n))
    for b in range(stacked.shape[1]):
        graph = _layer_graph(list(stacked[:, b]))
        for i in range(n):
            for j in range(n):
                out[b, i, j] = _edmonds_karp(graph.copy(), j, last + i)
    if normalize:
        total = out.sum(-1, keepdims=True)
        out = np.divide(out, total, out=np.zeros_like(out), where=total > 0)
    return torch.from_numpy(out).reshape(*lead, n, n).to(like.device, like.dtype)
