"""Fast weight programmers (Schmidhuber 1992; Schlag, Irie and Schmidhuber, "Linear Transformers
Are Secretly Fast Weight Programmers", ICML 2021; Wikipedia "Attention (machine learning)",
Variants): a slow network programs the fast weights of another by outer products.

At each position t the slow net emits a key k_t, a value v_t and a query q_t; the fast weight
matrix W (d_v × m) is updated by the outer product of the value with the key's features and read
by the query's (Schlag et al. eqs. 1-3, with the normalisation of their eq. 4):

    W_t = W_{t−1} + v_t ⊗ φ(k_t),    z_t = z_{t−1} + φ(k_t),    y_t = W_t φ(q_t) / z_t·φ(q_t).

Unrolled, y_t = Σ_{j≤t} v_j φ(k_j)·φ(q_t) / Σ_{j≤t} φ(k_j)·φ(q_t): causal linear attention
(Katharopoulos eqs. 8-9), which the tests check. This module runs the update literally, one
position at a time: O(N) sequential steps of O(d_v·m) each, O(N·d_v·m) memory for the backward
(:class:`attnkit.efficient.LinearAttention` with ``causal=True`` computes the same by prefix
sums in parallel).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import masks
from attnkit import taxonomy as tx
from attnkit.efficient import kernelized as kz
from attnkit.efficient.feature_maps import causal_rows, check_causal, make_feature_map
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["FastWeightProgrammer"]


def _programme(fq: Tensor, fk: Tensor, v: Tensor) -> Tensor:
    """The update of the module docstring, one position at a time, for φ(q), φ(k) (…, N, m) and
    v (…, N, d_v) of one shape up to the last dim -> y (…, N, d_v).

    Each step costs O(d_v·m) whatever N is: the inputs are split into their N rows once
    (``unbind``, whose backward is one ``stack``; indexing row t in the loop would make the
    backward of every step write a zero-filled (…, N, ·) gradient, O(N) per step), and the
    outputs are joined once at the end. Autograd keeps each W_t for the backward of its read:
    O(N·d_v·m) memory.
    """
    lead, m = fk.shape[:-2], fk.shape[-1]
    if fk.shape[-2] == 0:
        return v.new_zeros(v.shape)
    wt = fk.new_zeros(*lead, m, v.shape[-1])  # Wᵀ (…, m, d_v)
    z = fk.new_zeros(*lead, m, 1)
    nums, dens = [], []
    for q_t, k_t, v_t in zip(fq.unbind(-2), fk.unbind(-2), v.unbind(-2), strict=True):
        k_col, q_row = k_t.unsqueeze(-1), q_t.unsqueeze(-2)
        wt = torch.addcmul(wt, k_col, v_t.unsqueeze(-2))  # W_t = W_{t−1} + v_t ⊗ φ(k_t)
        z = z + k_col  # z_t = z_{t−1} + φ(k_t)
        nums.append(q_row @ wt)  # (W_t φ(q_t))ᵀ   (…, 1, d_v)
        dens.append(q_row @ z)  # z_t · φ(q_t)   (…, 1, 1)
    num, den = torch.cat(nums, -2), torch.cat(dens, -2)  # (…, N, d_v), (…, N, 1)
    ok = den != 0
    return torch.where(ok, num / torch.where(ok, den, 1), 0)


@REGISTRY.register("fast_weight")
class FastWeightProgrammer(HeadAttention):
    """The outer-product fast-weight update as a causal per-head part ``part(q, k, v, *, mask,
    bias, need_weights)`` with q, k (B, …, N, d), v (B, …, N, d_v) → context (B, …, N, d_v).

    Args:
        feature_map: φ, ``"elu+1"``, ``"relu"`` or a module (as :class:`LinearAttention`).

    Masks: a key padding mask (…, 1, N) skips the update at padded positions; a mask varying
    over queries is refused (the programme is causal by construction). A bias is refused.
    """

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys

    decodes_with_cache: ClassVar[bool] = True  # a step equals its causal rows

    # causal self-attention: a padded position is padding as a query too
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("q", "k", "v")}
    # causal=True: queries after a KV cache are the last rows of the causal sequence
    takes_q_offset: ClassVar[bool] = True
    causal = True

    def __init__(self, feature_map: str | nn.Module = "elu+1") -> None:
        super().__init__()
        self.phi = make_feature_map(feature_map)
        self.align = kz.KernelNormalized()

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 6, 4, seed=s) for s in (7, 8, 9))
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)
        return cls(), (q, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.AlignmentKind.SOFT]

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        q_offset: int,
    ) -> AttentionOutput:
        who = type(self).__name__
        rows = causal_rows(self, q, k, v, q_offset, mask=mask, bias=bias, need_weights=need_weights)
        if rows is not None:  # queries after a KV cache: the last rows of the causal sequence
            return rows
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        check_causal(q, k, who)
        n = k.shape[-2]
        keep = kz.key_mask(mask, torch.Size((*lead, n, n)), who)
        fq, fk = self.phi(q), self.phi(k)
        if keep is not None:  # a padded position writes nothing into the fast weights
            fk = torch.where(keep, fk, torch.zeros((), dtype=fk.dtype))
            v = torch.where(keep, v, torch.zeros((), dtype=v.dtype))
        fq, fk, v = (x.broadcast_to(*lead, n, x.shape[-1]) for x in (fq, fk, v))
        context = _programme(fq, fk, v)
        weights = None
        if need_weights:
            weights = kz.dense_feature_weights(self.align, fq, fk, keep, causal=True)
        return AttentionOutput(context, weights)
