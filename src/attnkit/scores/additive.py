"""The additive family of score functions: additive (Bahdanau), concat (Luong), deep (Galassi),
with their self-attentive (query-free, Brauwers eq. 33) and multi-dimensional (eq. 31) forms."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.layers import HeadwiseLinear, resolve_activation
from attnkit.scores.base import REGISTRY, Score, expect_features
from attnkit.sizing import example_sizes

__all__ = ["Additive", "Concat", "Deep"]


@REGISTRY.register("additive")
@arguments.renamed(heads="num_heads")
class Additive(Score):
    """Additive (Bahdanau) score: e_l = wᵀ act(W_1 q + W_2 k_l + b) (Brauwers Table II, eq. 6).

    Args:
        d_q: query size; ``None`` makes the score self-attentive, e_l = wᵀ act(W k_l + b)
            (Brauwers eq. 33), and the query may then be omitted.
        d_k: key size.
        d_w: size of the hidden layer (w ∈ R^{d_w}).
        d_out: when set, the score is multi-dimensional (Brauwers eq. 31): w becomes
            W_d ∈ R^{d_w×d_out} and e_l ∈ R^{d_out}, one score per value feature (d_out = d_v).
        activation: name from :data:`attnkit.layers.ACTIVATIONS` or a callable.
        num_heads: one independent parameter set per head (inputs then carry a head dim at
            -3).

    The query and key projections are computed once per query and once per key; only the
    activation and the product with w are evaluated per (query, key) pair.
    """

    scoring = tx.Scoring.ADDITIVE
    compile_tile: ClassVar[bool] = True  # tanh over (M_b, N_b, d_w): fusing it pays

    def __init__(
        self,
        d_q: int | None,
        d_k: int,
        d_w: int,
        *,
        d_out: int | None = None,
        activation: str | Callable[[Tensor], Tensor] = "tanh",
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.optional_positive_int(d_q, "d_q")
        arguments.positive_int(d_k, "d_k")
        arguments.positive_int(d_w, "d_w")
        arguments.optional_positive_int(d_out, "d_out")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        kw = {"num_heads": num_heads, "device": device, "dtype": dtype}
        self.d_q, self.d_k, self.d_w, self.d_out = d_q, d_k, d_w, d_out
        self.query_free = d_q is None
        self.act = resolve_activation(activation)
        self._build_projections(kw)
        self.hidden = nn.ModuleList()
        self.w = HeadwiseLinear(d_w, 1 if d_out is None else d_out, bias=False, **kw)

    # for_heads: d_q = d_k = d_w = head_dim, one parameter set per head.
    size_arguments: ClassVar[dict[str, str]] = {
        "d_q": "head_dim", "d_k": "head_dim", "d_w": "head_dim", "num_heads": "num_heads"
    }  # fmt: skip

    @classmethod
    def example(cls, **sizes: int | None) -> Score:
        """d_w = 6, unlike d = 4, so that a mix-up of the two shows."""
        return cls.for_heads(**example_sizes(cls.example_sizes, **sizes).for_heads(), d_w=6)

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Score]:
        """The example, and its self-attentive (query-free, eq. 33) and multi-dimensional
        (eq. 31, d_out = the values' size) forms."""
        s = example_sizes(cls.example_sizes, **sizes)
        return {
            "": cls.example(**sizes),
            "query-free": cls.for_heads(**s.for_heads(), d_q=None, d_w=6),
            "multi-dim": cls.for_heads(**s.for_heads(), d_w=6, d_out=s.value_dim),
        }

    def _build_projections(self, kw: dict) -> None:
        self.W1 = None if self.d_q is None else HeadwiseLinear(self.d_q, self.d_w, bias=False, **kw)
        self.W2 = HeadwiseLinear(self.d_k, self.d_w, bias=True, **kw)

    def check(self, q: Tensor | None, k: Tensor) -> None:
        if q is not None and self.d_q is not None:
            expect_features(q, self.d_q, "q", "d_q")
        expect_features(k, self.d_k, "k", "d_k")

    def project_query(self, q: Tensor | None) -> Tensor | None:
        return None if self.W1 is None or q is None else self.W1(q)

    def project_key(self, k: Tensor) -> Tensor:
        return self.W2(k)

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        return self.pairwise_with(qp, kp, self.act)

    def pairwise_with(
        self, qp: Tensor | None, kp: Tensor, act: Callable[[Tensor], Tensor]
    ) -> Tensor:
        """``pairwise`` with the activation ``act`` in place of ``self.act`` (the same function
        evaluated differently, e.g. a faster tanh in compiled tiles)."""
        h = kp.unsqueeze(-3)  # (…, 1, N, d_w)
        if qp is not None:
            h = h + qp.unsqueeze(-2)  # (…, M, N, d_w)
        h = act(h)
        for layer in self.hidden:
            h = act(layer(h, inner_dims=2))
        e = self.w(h, inner_dims=2)
        return e.squeeze(-1) if self.d_out is None else e


@REGISTRY.register("concat")
class Concat(Additive):
    """Concat (Luong) score: e_l = wᵀ act(W [q; k_l] + b) (Galassi Table IV).

    One matrix W ∈ R^{d_w×(d_q+d_k)} acting on the concatenation; equal to the additive score
    with W = [W_1 W_2], and evaluated that way (the concatenation is never built).
    """

    @classmethod
    def example(cls, **sizes: int | None) -> Score:
        """d_w = 6 and a ReLU hidden layer."""
        s = example_sizes(cls.example_sizes, **sizes)
        return cls.for_heads(**s.for_heads(), d_w=6, activation="relu")

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Score]:
        return {"": cls.example(**sizes)}

    def _build_projections(self, kw: dict) -> None:
        self.W = HeadwiseLinear((self.d_q or 0) + self.d_k, self.d_w, bias=True, **kw)

    def project_query(self, q: Tensor | None) -> Tensor | None:
        if self.d_q is None or q is None:
            return None
        return self.W(q, columns=slice(0, self.d_q))

    def project_key(self, k: Tensor) -> Tensor:
        d_q = self.d_q or 0
        kp = self.W(k, columns=slice(d_q, d_q + self.d_k))
        bias = self.W.bias
        assert bias is not None
        return kp + (bias if self.W.num_heads is None else bias[:, None, :])


@REGISTRY.register("deep")
@arguments.renamed(heads="num_heads")
class Deep(Additive):
    """Deep score (Galassi IV-B, Table IV): an L-layer network on (q, k_l) before the importance
    vector: h¹ = act(W_1 q + W_2 k_l + b¹), hˡ = act(Wˡ hˡ⁻¹ + bˡ), e_l = wᵀ h^L.

    ``depth`` = L ≥ 1; depth 1 is the additive score.
    """

    @classmethod
    def example(cls, **sizes: int | None) -> Score:
        """d_w = 5, three layers."""
        s = example_sizes(cls.example_sizes, **sizes)
        return cls.for_heads(**s.for_heads(), d_w=5, depth=3)

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Score]:
        """The example, and a two-layer multi-dimensional form (d_out = the values' size)."""
        s = example_sizes(cls.example_sizes, **sizes)
        multi = cls.for_heads(**s.for_heads(), d_w=5, depth=2, d_out=s.value_dim)
        return {"": cls.example(**sizes), "multi-dim": multi}

    def __init__(
        self,
        d_q: int | None,
        d_k: int,
        d_w: int,
        *,
        depth: int = 2,
        d_out: int | None = None,
        activation: str | Callable[[Tensor], Tensor] = "tanh",
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        arguments.positive_int(depth, "depth")
        super().__init__(
            d_q,
            d_k,
            d_w,
            d_out=d_out,
            activation=activation,
            num_heads=num_heads,
            device=device,
            dtype=dtype,
        )
        self.depth = depth
        for _ in range(depth - 1):
            self.hidden.append(
                HeadwiseLinear(d_w, d_w, bias=True, num_heads=num_heads, device=device, dtype=dtype)
            )
