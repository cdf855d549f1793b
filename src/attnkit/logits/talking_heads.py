"""Talking-heads attention (Shazeer, Lan, Cheng, Ding and Hou 2020, "Talking-Heads Attention",
sec. 4): the heads' logits are mixed by a learned H × H matrix before the softmax, and the
heads' weights by another after it,

    e_h   = q_h k_hᵀ / √d (+ bias_h)                                   (B, H, M, N)
    e'_h  = Σ_{h'} P_l[h', h] e_{h'}                                   (logits projection)
    a_h   = softmax(e'_h)                                              (per head, masked)
    a'_h  = Σ_{h'} P_w[h', h] a_{h'}                                   (weights projection)
    o_h   = a'_h v_h

(the paper's ``einsum("BNMh,hH->BNMH")`` pair, with as many heads before and after each
projection). P_l = P_w = I is multi-head attention. The mixed weights a' need not be positive
or sum to 1; the output's ``weights`` are the softmax weights a. A key masked for head h gets no
weight in a'_h either.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["TalkingHeadsAttention"]


@REGISTRY.register("talking_heads")
class TalkingHeadsAttention(HeadAttention):
    """Talking-heads attention (module docstring), a per-head part
    ``part(q, k, v, *, mask, bias, need_weights)`` with q (B, …, H, M, d), k (B, …, H, N, d),
    v (B, …, H, N, d_v), H = ``num_heads`` at dim −3.

    Args:
        num_heads: H.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"num_heads": "num_heads"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    decodes_with_cache: ClassVar[bool] = True  # every query row is computed alone
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(self, num_heads: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        eye = torch.eye(num_heads, device=device, dtype=dtype)
        self.logits_proj = nn.Parameter(eye.clone())  # P_l, (H, H), starts as plain MHA
        self.weights_proj = nn.Parameter(eye.clone())  # P_w
        self.align = Softmax()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 3, 5, 4, seed=s) for s in (70, 71, 72))
        mask = (torch.arange(5)[None, :] < torch.tensor([5, 2])[:, None])[:, None, None, :]
        module = cls(3)
        g = torch.Generator().manual_seed(73)
        with torch.no_grad():
            module.logits_proj += 0.3 * torch.randn(3, 3, generator=g)
            module.weights_proj += 0.3 * torch.randn(3, 3, generator=g)
        return module, (q, k, v), {"mask": mask.expand(2, 3, 1, 5)}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.QueryMultiplicity.MULTI_HEAD]

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
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if len(lead) < 1 or lead[-1] != self.num_heads:
            raise ValueError(
                f"TalkingHeadsAttention(num_heads={self.num_heads}) needs the heads at dim -3: "
                f"q (…, {self.num_heads}, M, d), got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        m, n = q.shape[-2], k.shape[-2]
        # keys no row of a head may attend hold zeros (the template), so NaN there stays out
        keep = None if mask is None else mask.broadcast_to(*lead, m, n)
        e = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        if bias is not None:
            e = e + bias
        if keep is not None:
            e = e.masked_fill(~keep, 0.0)  # a masked logit reaches no other head
        mixed = torch.einsum("...hmn,hg->...gmn", e, self.logits_proj.to(e.dtype))
        a = self.align(mixed, keep).weights
        a_mixed = torch.einsum("...hmn,hg->...gmn", a, self.weights_proj.to(a.dtype))
        if keep is not None:
            a_mixed = a_mixed.masked_fill(~keep, 0.0)
        context = torch.matmul(a_mixed, v)
        return AttentionOutput(context, a if need_weights else None)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}"
