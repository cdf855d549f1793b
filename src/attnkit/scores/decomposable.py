"""Decomposable compatibility (Parikh et al. 2016; Galassi IV-D2, eq. 13): queries and keys go
through feed-forward networks first and are multiplied after, so each network sees one input
(Galassi: "delaying the product to after the processing by the neural networks reduces the
number of inputs of such networks").

Two forms:

- separate networks, Galassi eq. 13: E_{j,i} = act(W_1 q_j + b_1)ᵀ act(W_2 k_i + b_2) —
  queries and keys are mapped differently, so the score depends on which input is the query;
- one shared network (Parikh et al.'s attend step, F(a_i)ᵀ F(b_j)): W_1 = W_2, b_1 = b_2 —
  symmetric, e(x, y) = e(y, x). :class:`attnkit.features.DecomposableAttention` attends with it
  (a two-layer F).

Both are in dot-product form (q' = act(W_1 q + b_1), k' = act(W_2 k + b_2), scale 1), so they
may dispatch to SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.layers import HeadwiseLinear, resolve_activation
from attnkit.scores.base import REGISTRY, Score, expect_features
from attnkit.sizing import example_sizes

__all__ = ["Decomposable", "SharedDecomposable"]


@REGISTRY.register("decomposable")
@arguments.renamed(heads="num_heads")
class Decomposable(Score):
    """Decomposable score with separate networks (Galassi eq. 13):
    e_l = act(W_1 q + b_1)ᵀ act(W_2 k_l + b_2).

    Args:
        d_q: query size. d_k: key size.
        d_w: output size of both networks (the product is over d_w features).
        activation: name from :data:`attnkit.layers.ACTIVATIONS` or a callable (ReLU in
            Parikh et al.).
        num_heads: one parameter set per head (inputs then carry a head dim at -3).
    """

    scoring = tx.Scoring.GENERAL
    dot_product_form: ClassVar[bool] = True

    def __init__(
        self,
        d_q: int,
        d_k: int,
        d_w: int,
        *,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_q = arguments.positive_int(d_q, "d_q")
        self.d_k = arguments.positive_int(d_k, "d_k")
        self.d_w = arguments.positive_int(d_w, "d_w")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        self.act = resolve_activation(activation)
        kw = {"num_heads": num_heads, "bias": True, "device": device, "dtype": dtype}
        self.W1 = HeadwiseLinear(d_q, d_w, **kw)  # W_1, b_1: the query network
        self.W2 = HeadwiseLinear(d_k, d_w, **kw)  # W_2, b_2: the key network

    # for_heads: d_q = d_k = d_w = head_dim, one parameter set per head.
    size_arguments: ClassVar[dict[str, str]] = {
        "d_q": "head_dim", "d_k": "head_dim", "d_w": "head_dim", "num_heads": "num_heads"
    }  # fmt: skip

    @classmethod
    def example(cls, **sizes: int | None) -> Score:
        """d_w = 5 and tanh."""
        s = example_sizes(cls.example_sizes, **sizes)
        return cls.for_heads(**s.for_heads(), d_w=5, activation="tanh")

    def check(self, q: Tensor | None, k: Tensor) -> None:
        assert q is not None  # guaranteed by Score.forward
        expect_features(q, self.d_q, "q", "d_q")
        expect_features(k, self.d_k, "k", "d_k")

    def project_query(self, q: Tensor | None) -> Tensor | None:
        assert q is not None
        return self.act(self.W1(q))

    def project_key(self, k: Tensor) -> Tensor:
        return self.act(self.W2(k))

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        assert qp is not None
        return torch.matmul(qp, kp.transpose(-1, -2))  # "...mw,...nw->...mn"

    def dot_form(self, q: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor, float]:
        assert q is not None
        self.check(q, k)
        return self.project_query(q), self.project_key(k), 1.0  # type: ignore[return-value]


@REGISTRY.register("decomposable_shared")
@arguments.renamed(heads="num_heads")
class SharedDecomposable(Decomposable):
    """Decomposable score with one shared network (Parikh et al.'s attend step):
    e_l = act(W q + b)ᵀ act(W k_l + b), symmetric in its two inputs.

    Args:
        d_k: feature size of the queries and of the keys (d_q = d_k: the network is shared).
        d_w: output size of the network.
        activation: as :class:`Decomposable`.
        num_heads: one network per head (inputs then carry a head dim at -3).
    """

    def __init__(
        self,
        d_k: int,
        d_w: int,
        *,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            d_k, d_k, d_w, activation=activation, num_heads=num_heads, device=device, dtype=dtype
        )
        self.W2 = None  # one network, W1, for both roles

    # for_heads: d_k = d_w = head_dim, one network per head.
    size_arguments: ClassVar[dict[str, str]] = {
        "d_k": "head_dim", "d_w": "head_dim", "num_heads": "num_heads"
    }  # fmt: skip

    def check(self, q: Tensor | None, k: Tensor) -> None:
        assert q is not None
        expect_features(q, self.d_k, "q", "d_k (queries and keys share the network)")
        expect_features(k, self.d_k, "k", "d_k")

    def project_key(self, k: Tensor) -> Tensor:
        return self.act(self.W1(k))
