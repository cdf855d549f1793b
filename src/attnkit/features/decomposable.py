"""Decomposable attention (Parikh et al. 2016; Galassi IV-D2, eq. 13): attend, compare, aggregate.

Two sentences a = (a_1 … a_la) and b = (b_1 … b_lb), batch first: a (B, la, d), b (B, lb, d).

- Attend: e_ij = F(a_i)ᵀ F(b_j) with one feed-forward network F (ReLU) for both sentences, so
  that the products come after F (Galassi: "delaying the product ... reduces the computational
  footprint"); β_i = Σ_j softmax_j(e_ij) b_j (the part of b aligned to a_i) and
  α_j = Σ_i softmax_i(e_ij) a_i.
- Compare: v_1,i = G([a_i; β_i]), v_2,j = G([b_j; α_j]) with one feed-forward network G.
- Aggregate: v_1 = Σ_i v_1,i, v_2 = Σ_j v_2,j, ŷ = H([v_1; v_2]).

The optional intra-sentence attention of the paper is not included.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.features.coattention import co_inputs
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Dot

__all__ = ["DecomposableAttention", "DecomposableOutput"]


def _mlp(d_in: int, d_hidden: int, d_out: int, *, last_relu: bool, **kw) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Linear(d_in, d_hidden, **kw),
        nn.ReLU(),
        nn.Linear(d_hidden, d_out, **kw),
    ]
    if last_relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DecomposableOutput(NamedTuple):
    """logits ŷ (B, d_out); weights1 (B, la, lb): each a_i over b (softmax_j e_ij); weights2
    (B, lb, la): each b_j over a (softmax_i e_ij); the aggregated comparisons v1, v2 (B, h)."""

    logits: Tensor
    weights1: Tensor
    weights2: Tensor
    v1: Tensor
    v2: Tensor

    @property
    def representation(self) -> Tensor:
        return self.logits

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights1": self.weights1, "weights2": self.weights2}


@REGISTRY.register("decomposable_attention")
class DecomposableAttention(nn.Module):
    """Decomposable attention model (Parikh et al. 2016): attend, compare, aggregate.

    Args:
        d: feature size of both sentences.
        d_hidden: width of the feed-forward networks F, G and H.
        d_out: size of ŷ (the number of classes).
        align: the alignment of the attend step (softmax in the paper).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask1": ("a",), "mask2": ("b",)}

    def __init__(
        self,
        d: int,
        d_hidden: int,
        d_out: int,
        *,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d=d, d_hidden=d_hidden, d_out=d_out)
        self.d = d
        kw = {"device": device, "dtype": dtype}
        self.F = _mlp(d, d_hidden, d_hidden, last_relu=True, **kw)
        self.G = _mlp(2 * d, d_hidden, d_hidden, last_relu=True, **kw)
        self.H = _mlp(2 * d_hidden, d_hidden, d_out, last_relu=False, **kw)
        self.attend_a = Attention(Dot(), align)  # each a_i over b: β
        self.attend_b = Attention(Dot(), align)  # each b_j over a: α

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        a, b = example_tensor(2, 4, 3, seed=1), example_tensor(2, 3, 3, seed=2)
        mask1 = masks.from_lengths(torch.tensor([4, 2]), 4)
        mask2 = masks.from_lengths(torch.tensor([1, 3]), 3)
        return cls(3, 6, 2), (a, b), {"mask1": mask1, "mask2": mask2}

    def taxonomy_tags(self) -> list:
        return [tx.FeatureMultiplicity.PARALLEL_CO_ATTENTION, tx.QueryType.SPECIALIZED]

    def forward(
        self, a: Tensor, b: Tensor, mask1: Tensor | None = None, mask2: Tensor | None = None
    ) -> DecomposableOutput:
        """a (B, la, d), b (B, lb, d); mask1 (B, la) or (B, 1, la), mask2 (B, lb) or (B, 1, lb)
        boolean, True = a real token (None: all real)."""
        a, b, mask1, mask2 = co_inputs(self, a, b, mask1, mask2, self.d, self.d)
        fa, fb = self.F(a), self.F(b)
        pair = None
        if mask1 is not None or mask2 is not None:
            m1 = (
                torch.ones(a.shape[:-1], dtype=torch.bool, device=a.device)
                if mask1 is None
                else mask1
            )
            m2 = (
                torch.ones(b.shape[:-1], dtype=torch.bool, device=b.device)
                if mask2 is None
                else mask2
            )
            pair = m1.unsqueeze(-1) & m2.unsqueeze(-2)  # (B, la, lb)
        attended_a = self.attend_a(fa, fb, b, mask=pair, need_weights=True)  # β
        attended_b = self.attend_b(
            fb, fa, a, mask=None if pair is None else pair.transpose(-1, -2), need_weights=True
        )  # α
        v1_i = self.G(torch.cat([a, attended_a.context], -1))  # compare
        v2_j = self.G(torch.cat([b, attended_b.context], -1))
        if mask1 is not None:
            v1_i = v1_i * mask1.unsqueeze(-1)
        if mask2 is not None:
            v2_j = v2_j * mask2.unsqueeze(-1)
        v1, v2 = v1_i.sum(-2), v2_j.sum(-2)  # aggregate
        logits = self.H(torch.cat([v1, v2], -1))
        return DecomposableOutput(logits, attended_a.weights, attended_b.weights, v1, v2)
