"""Area attention (Li, Kaiser, Bengio and Si, "Area Attention", ICML 2019): a query attends to
*areas* — runs of 1 … S adjacent keys — instead of single keys, so that the granularity of what
is attended is learned rather than fixed.

For a 1-D sequence the area of keys j … j+s−1 (1 ≤ s ≤ S) has the key and value (paper Sec. 3.1)

    k_area = (1/s) Σ_{t=j}^{j+s−1} k_t    (the mean of its keys),
    v_area = Σ_{t=j}^{j+s−1} v_t          (the sum of its values),

and attention is the usual score → softmax → weighted sum over all areas (scaled dot product
here). Areas are ordered by size, then by start. With S = 1 it is ordinary attention.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["AreaAttention", "areas"]


def areas(x: Tensor, max_area: int, reduce: str) -> Tensor:
    """All runs of 1 … max_area adjacent rows of x (…, N, d), each reduced to one row by
    ``reduce`` ("mean", "sum" or "all" for boolean x (…, N)): (…, A, d) with
    A = Σ_s (N − s + 1), ordered by run length, then by start."""
    out = []
    vector = reduce != "all"
    n = x.shape[-2] if vector else x.shape[-1]
    for s in range(1, min(max_area, n) + 1):
        if vector:
            runs = x.unfold(-2, s, 1)  # (…, N − s + 1, d, s)
            out.append(runs.mean(-1) if reduce == "mean" else runs.sum(-1))
        else:
            out.append(x.unfold(-1, s, 1).all(-1))
    return torch.cat(out, -2 if vector else -1)


@REGISTRY.register("area")
class AreaAttention(HeadAttention):
    """Area attention over runs of up to ``max_area`` adjacent keys, a per-head part
    ``part(q, k, v, *, mask, bias, need_weights)`` with q (B, …, M, d), k (B, …, N, d),
    v (B, …, N, d_v). The weights (B, …, M, A) are over the areas (see :func:`areas` for their
    order). An area is allowed to query i when all its keys are (so padding equals truncation).
    A bias per key pair has no meaning for areas and is refused.

    Args:
        max_area: S, the largest number of adjacent keys in one area.
    """

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})

    decodes_with_cache: ClassVar[bool] = True  # a step equals its causal rows

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(self, max_area: int = 3) -> None:
        super().__init__()
        self.max_area = arguments.positive_int(max_area, "max_area")
        self.attention = Attention("scaled_dot", "softmax")

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 6, 4, seed=s) for s in (10, 11, 12))
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)[:, None].expand(2, 2, 1, 6)
        return cls(3), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        # areas change what is attended (runs of keys), not how: one weight per area
        return [tx.Dimensionality.SINGLE]

    def extra_repr(self) -> str:
        return f"max_area={self.max_area}"

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:
        # keys no query may attend hold zeros (the template): their content, even NaN, cannot
        # reach an area (areas holding them are masked anyway)
        area_mask = None if mask is None else areas(mask, self.max_area, "all")
        out = self.attention(
            q,
            areas(k, self.max_area, "mean"),
            areas(v, self.max_area, "sum"),
            mask=area_mask,
            need_weights=need_weights,
        )
        return AttentionOutput(out.context, out.weights if need_weights else None)
