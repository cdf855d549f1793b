"""Builders for every registered part at test sizes, so contract tests cover all of them.

``test_factories_cover_registries`` fails when a part is registered without an entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import attnkit as ak
from attnkit import alignments as al
from attnkit import scores as sc


@dataclass(frozen=True)
class Dims:
    d_q: int = 4
    d_k: int = 4
    d_v: int = 3
    max_len: int = 16


ScoreFactory = Callable[[Dims], sc.Score]
AlignFactory = Callable[[Dims], al.Alignment]

# name -> factory; the part before "[" is the registered name.
SCORES: dict[str, ScoreFactory] = {
    "additive": lambda d: sc.Additive(d.d_q, d.d_k, 6),
    "additive[query-free]": lambda d: sc.Additive(None, d.d_k, 6),
    "additive[multi-dim]": lambda d: sc.Additive(d.d_q, d.d_k, 6, d_out=d.d_v),
    "concat": lambda d: sc.Concat(d.d_q, d.d_k, 6, activation="relu"),
    "deep": lambda d: sc.Deep(d.d_q, d.d_k, 5, depth=3),
    "deep[multi-dim]": lambda d: sc.Deep(d.d_q, d.d_k, 5, depth=2, d_out=d.d_v),
    "dot": lambda d: sc.Dot(),
    "scaled_dot": lambda d: sc.ScaledDot(),
    "general": lambda d: sc.General(d.d_q, d.d_k),
    "biased_general": lambda d: sc.BiasedGeneral(d.d_q, d.d_k),
    "activated_general": lambda d: sc.ActivatedGeneral(d.d_q, d.d_k),
    "hermitian": lambda d: sc.Hermitian(d.d_k, 5),
    "directed_hermitian": lambda d: sc.DirectedHermitian(d.d_k, 5),
    "decomposable": lambda d: sc.Decomposable(d.d_q, d.d_k, 5, activation="tanh"),
    "decomposable_shared": lambda d: sc.SharedDecomposable(d.d_k, 5, activation="tanh"),
    "cosine": lambda d: sc.Cosine(),
    "euclidean": lambda d: sc.Euclidean(),
    "location": lambda d: sc.Location(d.d_q, d.max_len),
    "convolutional": lambda d: sc.Convolutional(d.d_k, width=3),
    "learned_query": lambda d: sc.LearnedQuery(d.d_k, scaled=True),
}

ALIGNMENTS: dict[str, AlignFactory] = {
    "softmax": lambda d: al.Softmax(),
    "softmax[learned-temperature]": lambda d: al.Softmax(0.7, learnable=True),
    "sparsemax": lambda d: al.Sparsemax(),
    "entmax15": lambda d: al.Entmax15(),
    "entmax": lambda d: al.Entmax(1.3),
    "entmax[learned-alpha]": lambda d: al.Entmax(1.8, learnable=True),
    "sigmoid": lambda d: al.Sigmoid(),
    "hard": lambda d: al.Hard(),
    "hard[straight-through]": lambda d: al.Hard(straight_through=True, tau=0.5),
    "local": lambda d: al.Local(1),
    "local[gaussian]": lambda d: al.Local(1, gaussian=True),
    "local[predictive]": lambda d: al.Local(1, "predictive", d_q=d.d_q, d_p=3),
    "reinforced": lambda d: al.Reinforced(),
    "uniform": lambda d: al.Uniform(),
    "constrained_softmax": lambda d: al.ConstrainedSoftmax(1.0),
    "constrained_sparsemax": lambda d: al.ConstrainedSparsemax(),
    "structured": lambda d: al.Structured(torch.tensor([[0.3, -0.5], [-0.2, 0.6]])),
    "structured[normalized]": lambda d: al.Structured(normalize=True),
    "query_temperature": lambda d: al.QueryTemperature(d.d_q, base=3.0),
    "predicted_window": lambda d: al.PredictedWindow(d.d_q, 3),
    "graph_local": lambda d: al.GraphLocal(1.5),
    "graph_local[window]": lambda d: al.GraphLocal(None, window=1.0),
}


def registered(name: str) -> str:
    return name.split("[")[0]


def build_attention(
    score: str, align: str, dims: Dims = Dims(), dtype: torch.dtype = torch.float64, seed: int = 0
) -> ak.Attention:
    """An Attention module with deterministic parameters, in eval mode, in ``dtype``."""
    torch.manual_seed(seed)
    module = ak.Attention(SCORES[score](dims), ALIGNMENTS[align](dims))
    return module.to(dtype).eval()


def inputs(
    dims: Dims = Dims(),
    *,
    b: int = 2,
    m: int = 3,
    n: int = 5,
    dtype: torch.dtype = torch.float64,
    seed: int = 1,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, dims.d_q, generator=g, dtype=dtype)
    k = torch.randn(b, n, dims.d_k, generator=g, dtype=dtype)
    v = torch.randn(b, n, dims.d_v, generator=g, dtype=dtype)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))  # type: ignore[return-value]
