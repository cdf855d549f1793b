"""Mixture of Block Attention, MoBA (Lu et al. 2025, "MoBA: Mixture of Block Attention for
Long-Context LLMs", Moonshot AI, sec. 2.2-2.3): the keys are cut into blocks, each query routes
itself to a few of them as a mixture of experts routes a token, and attends at token level over
the blocks it chose.

For query t at position p_t, with keys cut into blocks I_b = [bB, (b + 1)B) of size B:

    s_{t,b} = ⟨q_t, mean_{j ∈ I_b} k_j⟩                          (the gate: mean pooling)
    g_{t,b} = 1 if s_{t,b} ∈ Top-(k−1)({s_{t,c} | c < ⌊p_t/B⌋}) or b = ⌊p_t/B⌋, else 0
    o_t = softmax(q_t K_S^⊤ / √d) V_S,   S = ∪_{b: g_{t,b} = 1} I_b ∩ [0, p_t]

The query's own block ⌊p_t/B⌋ is always chosen and read causally (keys j ≤ p_t); later blocks
are never candidates (causality, sec. 2.3); ``top_k`` counts the own block, so k − 1 earlier
blocks are chosen by their gate s (ties in block order). The gate is parameter-free and not
differentiable: gradients reach q, k and v through the attention over the chosen keys only.
When ``top_k`` is at least the number of blocks, every earlier block is chosen and MoBA is full
causal attention.

Masks: a key no row may attend is left out of its block's mean (a block without one is never
chosen); an earlier block is a candidate for a row when the row may attend one of its keys, and
inside the chosen blocks the row's mask applies key by key. With key padding and causal masks —
what the layers pass — the mean is over the keys the row itself may attend.

Cost (per head): the gate O(M·N/B·d) (one product with the N/B block means);
the own block a (B × B) causal product per block of queries, O(M·B·d); the chosen earlier blocks
one product per key block with the queries that chose it, gathered (no (M, N) mask or score is
formed), O(M·(k − 1)·B·d). Kept for the backward: the (…, M, k·B) scores of the chosen keys
and the gathered queries. Only a mask of M rows, a bias (both (…, M, N) as given) and the weights
when requested are of the size of dense attention.
Against causal attention's O(M·N·d/2) that is a share ≈ 2kB/N of the scores (at the paper's
B = 512, k = 3: 0.19 at N = 16384).

The paper routes per head on the head's own q and K, as a per-head part does here; its
defaults B = 512 and k = 3 are the constructor's.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.inputs import broadcast_shapes
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput
from attnkit.sizing import Sizes, build
from attnkit.sparse_trainable._select import all_finite, top_indices

__all__ = ["MixtureOfBlockAttention", "moba_selection"]


def moba_selection(
    q: Tensor,
    k: Tensor,
    block_size: int,
    top_k: int,
    q_offset: int = 0,
    rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The earlier blocks each query chooses by its gate (module docstring), without gradient.

    Args:
        q: (*lead, M, d) queries at positions ``q_offset`` + i; k: (*lead, N, d).
        block_size, top_k: B and k (the own block counts towards k).
        rows: the mask (*lead, M', N), M' ∈ {1, M}, True = may attend, or None.

    Returns:
        blocks (*lead, M, T) int64 block numbers, T = min(k − 1, ⌈N/B⌉), and whether each is
        chosen (a row with fewer candidates than T chooses fewer).
    """
    lead, m, n = q.shape[:-2], q.shape[-2], k.shape[-2]
    nb = -(-n // block_size)
    count = min(top_k - 1, nb)
    if count == 0:
        empty = torch.zeros(*lead, m, 0, dtype=torch.long, device=q.device)
        return empty, empty.bool()
    with torch.no_grad():
        pad = nb * block_size - n
        kb = torch.nn.functional.pad(k, (0, 0, 0, pad)).unflatten(-2, (nb, block_size))
        own = (torch.arange(m, device=q.device) + q_offset) // block_size  # (M,)
        candidate = torch.arange(nb, device=q.device) < own[:, None]  # (M, nb) earlier blocks
        if rows is None:
            means = kb.sum(-2) / torch.full((nb, 1), block_size, dtype=k.dtype, device=k.device)
            if pad:
                means[..., -1, :] = kb[..., -1, :, :].sum(-2) / (block_size - pad)
        else:
            present = torch.nn.functional.pad(rows.any(-2), (0, pad)).unflatten(-1, (nb, -1))
            sums = (kb * present[..., None].to(k.dtype)).sum(-2)
            means = sums / present.sum(-1, keepdim=True).clamp_min(1).to(k.dtype)
            row_blocks = torch.nn.functional.pad(rows, (0, pad)).unflatten(-1, (nb, -1)).any(-1)
            candidate = candidate & row_blocks  # (*lead, M', nb): a key the row may attend
        gate = q @ means.transpose(-1, -2)  # (*lead, M, nb)
        gate = gate.masked_fill(~candidate, float("-inf"))
        return top_indices(gate, count)


def _choosers(chosen: Tensor, b: int) -> Tensor | None:
    """The queries (L, P) of each item that chose earlier block b (``chosen`` (L, M, nb)),
    left-aligned and padded with the spare row M; None when none did."""
    sel = chosen[:, :, b]  # (L, M)
    counts = sel.sum(-1)
    p = int(counts.max())
    if p == 0:
        return None
    m = sel.shape[1]
    slot = torch.where(sel, sel.cumsum(-1) - 1, p)  # the others write to a spare column
    index = torch.full((sel.shape[0], p + 1), m, dtype=torch.long, device=sel.device)
    index.scatter_(1, slot, torch.arange(m, device=sel.device).expand_as(slot))
    return index[:, :p]


def _own_blocks(x: Tensor, shift: int, m: int, nq: int, bs: int, first: int) -> Tensor:
    """Row i of x (L, M, K·B) at its own key block: (L, nq, B, B) in the aligned layout (row
    a = shift + i of query block a // B reads key block first + a // B); padding rows 0."""
    a = torch.nn.functional.pad(x, (0, 0, shift, nq * bs - shift - m))
    a = a.view(x.shape[0], nq, bs, -1, bs)[:, :, :, first : first + nq]  # (L, nq, B, nq, B)
    return torch.diagonal(a, dim1=1, dim2=3).permute(0, 3, 1, 2)


def _scores(qx: Tensor, keys: Tensor, allowed: Tensor, finite: bool) -> Tensor:
    """qx (…, R, d) · keys (…, B, d) -> (…, R, B). Where some key or value is not finite, the
    keys a row may not read are left out by selection before the product, so that nothing of
    them reaches the result or the gradients (0 · NaN would be NaN)."""
    if finite:
        return qx @ keys.transpose(-1, -2)
    picked = torch.where(allowed[..., None], keys[..., None, :, :], 0.0)
    return (qx[..., None, :] * picked).sum(-1)


def _weighted(p: Tensor, values: Tensor, allowed: Tensor, finite: bool) -> Tensor:
    """p (…, R, B) @ values (…, B, d_v), leaving out by selection what a row may not read when
    something is not finite (:func:`_scores`)."""
    if finite:
        return p @ values
    picked = torch.where(allowed[..., None], values[..., None, :, :], 0.0)
    return (p[..., None] * picked).sum(-2)


@REGISTRY.register("moba")
class MixtureOfBlockAttention(HeadAttention):
    """MoBA (module docstring), a causal per-head part ``part(q, k, v, *, mask, bias,
    need_weights, q_offset)`` with q (B, …, H, M, d), k (B, …, H, N, d), v (B, …, H, N, d_v):
    query i sits at position ``q_offset + i``, reads its own block causally and the k − 1
    earlier blocks its gate chooses. No parameters. With ``top_k`` ≥ ⌈N/B⌉ it is full causal
    attention.

    Args:
        block_size: B, keys per block (512 in the paper).
        top_k: blocks per query, its own included (3 in the paper).

    ``for_heads(..., max_len=L)`` takes B = min(512, max(1, L // 8)) unless given (the paper's
    512 from L = 4096 on; eight blocks over shorter sequences, so that the choice is sparse).
    """

    # capabilities (attnkit.head.HeadAttention)
    causal: ClassVar[bool] = True  # causal by construction, whatever the mask
    causal_form: ClassVar[bool] = True
    decodes_with_cache: ClassVar[bool] = True  # a step is its row of the causal pass
    takes_q_offset: ClassVar[bool] = True
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})
    normalized_weights: ClassVar[bool] = True  # each row a distribution over the keys
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    takes_facts: ClassVar[bool] = True  # keys known finite are not scanned before the tiles

    def __init__(self, block_size: int = 512, top_k: int = 3) -> None:
        super().__init__()
        self.block_size = arguments.positive_int(block_size, "block_size")
        self.top_k = arguments.positive_int(top_k, "top_k")

    @classmethod
    def for_heads(
        cls, *, embed_dim: int, num_heads: int, head_dim: int, max_len: int, **overrides: Any
    ) -> MixtureOfBlockAttention:
        """MoBA for sequences of at most ``max_len`` keys (class docstring: the block size)."""
        if "block_size" not in overrides and isinstance(max_len, int) and max_len > 0:
            overrides["block_size"] = min(512, max(1, max_len // 8))
        sizes = Sizes(embed_dim=embed_dim, num_heads=num_heads, head_dim=head_dim, max_len=max_len)
        return build(cls, sizes, overrides)

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 11, 4, seed=s) for s in (60, 61, 62))
        mask = torch.arange(11)[None, :] < torch.tensor([11, 8])[:, None]
        module = cls(block_size=3, top_k=2)
        return module, (q, k, v), {"mask": mask[:, None, None, :].expand(2, 2, 1, 11)}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.SPARSE]

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
        need_weights: bool, q_offset: int = 0, checked: bool = False, finite: bool = False,
    ) -> AttentionOutput:  # fmt: skip
        arguments.nonnegative_int(q_offset, "q_offset")
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        m, n_all, bs, dv = q.shape[-2], k.shape[-2], self.block_size, v.shape[-1]
        n = min(n_all, q_offset + m)  # keys after the last query are never read
        if m == 0 or lead.numel() == 0:
            weights = q.new_zeros(*lead, m, n_all) if need_weights else None
            return AttentionOutput(q.new_zeros(*lead, m, dv), weights)
        count = lead.numel()
        q3 = q.broadcast_to(*lead, m, q.shape[-1]).reshape(count, m, -1)
        k3 = k[..., :n, :].broadcast_to(*lead, n, k.shape[-1]).reshape(count, n, -1)
        v3 = v[..., :n, :].broadcast_to(*lead, n, dv).reshape(count, n, dv)
        rows = None
        if mask is not None:
            r = mask.shape[-2] if mask.dim() >= 2 else 1
            rows = mask[..., :n].broadcast_to(*lead, r, n).reshape(count, r, n)
        blocks, available = moba_selection(q3, k3, bs, self.top_k, q_offset, rows)

        first = q_offset // bs  # the first query's block
        shift = q_offset - first * bs  # aligned rows before the first query
        nq = -(-(shift + m) // bs)  # blocks of queries
        nb = -(-n // bs)
        nbp = max(nb, first + nq)
        pad = nbp * bs - n
        kb = (torch.nn.functional.pad(k3, (0, 0, 0, pad)) if pad else k3).unflatten(1, (nbp, bs))
        vb = (torch.nn.functional.pad(v3, (0, 0, 0, pad)) if pad else v3).unflatten(1, (nbp, bs))
        keypos = torch.arange(nbp * bs, device=q.device).view(nbp, bs)
        qs = q3 * (1.0 / math.sqrt(q.shape[-1]))  # scaled once, not every score
        rp = None if rows is None else torch.nn.functional.pad(rows, (0, pad))
        bp = None
        if bias is not None:
            bp = bias[..., :n].broadcast_to(*lead, m, n).reshape(count, m, n)
            bp = torch.nn.functional.pad(bp, (0, pad))
        finite = finite or all_finite(k3, v3)

        # the own block: one (B × B) product per block of queries, causal inside
        qa = torch.nn.functional.pad(qs, (0, 0, shift, nq * bs - shift - m)).unflatten(1, (nq, bs))
        apos = (first * bs + torch.arange(nq * bs, device=q.device)).view(nq, bs, 1)
        arow = torch.arange(nq * bs, device=q.device).view(nq, bs, 1)
        okeys = keypos[first : first + nq, None, :]  # (nq, 1, B)
        own_ok = (okeys <= apos) & (okeys < n) & (arow >= shift) & (arow < shift + m)
        if rp is not None:
            if rp.shape[1] == 1:
                own_ok = own_ok & rp.view(count, nbp, bs)[:, first : first + nq, None, :]
            else:
                own_ok = own_ok & _own_blocks(rp, shift, m, nq, bs, first)
        e_own = _scores(qa, kb[:, first : first + nq], own_ok, finite)  # (L, nq, B, B)
        if bp is not None:
            e_own = e_own + _own_blocks(bp, shift, m, nq, bs, first)
        e_own = e_own.masked_fill(~own_ok, float("-inf"))

        # the chosen earlier blocks: per key block, the scores of the queries that chose it;
        # the padding of each item's list reads and writes a spare row M, dropped at the end
        tiles = []
        if blocks.shape[-1]:
            chosen = torch.zeros(count, m, nbp, dtype=torch.bool, device=q.device)
            chosen.scatter_(2, blocks, available)
            qx = torch.cat([qs, qs.new_zeros(count, 1, qs.shape[-1])], 1)  # (L, M + 1, d)
            for b in range(nb):
                index = _choosers(chosen, b)
                if index is None:
                    continue
                qg = torch.gather(qx, 1, index[..., None].expand(*index.shape, qx.shape[-1]))
                span = slice(b * bs, (b + 1) * bs)
                ok = None
                if rp is not None or not finite or (b + 1) * bs > n:
                    ok = (keypos[b] < n).expand(*index.shape, bs)
                    if rp is not None:
                        at = index.clamp_max(m - 1)[..., None].expand(*index.shape, bs)
                        ok = ok & (
                            rp[:, :, span] if rp.shape[1] == 1 else rp[:, :, span].gather(1, at)
                        )
                e = _scores(qg, kb[:, b], ok, finite)  # (L, P, B)
                if bp is not None:
                    at = index.clamp_max(m - 1)[..., None].expand(*index.shape, bs)
                    e = e + bp[:, :, span].gather(1, at)
                if ok is not None:
                    e = e.masked_fill(~ok, float("-inf"))
                tiles.append((b, index, ok, e))

        # one softmax over the own block and the chosen blocks, by a shared row maximum
        with torch.no_grad():
            top = e_own.amax(-1).flatten(1)[:, shift : shift + m]  # (L, M)
            top = torch.cat([top, top.new_zeros(count, 1)], 1)  # and the spare row
            for _, index, _, e in tiles:
                top.scatter_reduce_(1, index, e.amax(-1), "amax")
            top = torch.where(torch.isfinite(top), top, 0.0)
        top_a = torch.nn.functional.pad(top[:, :m], (shift, nq * bs - shift - m))
        p_own = torch.sub(e_own, top_a.view(count, nq, bs, 1)).exp_()
        num = _weighted(p_own, vb[:, first : first + nq], own_ok, finite)
        num = torch.nn.functional.pad(num.flatten(1, 2)[:, shift : shift + m], (0, 0, 0, 1))
        z = torch.nn.functional.pad(p_own.sum(-1).flatten(1)[:, shift : shift + m], (0, 1))
        parts = []
        for b, index, ok, e in tiles:
            p = torch.sub(e, top.gather(1, index)[..., None]).exp_()
            o = _weighted(p, vb[:, b], ok, finite)
            num.scatter_add_(1, index[..., None].expand(*index.shape, dv), o)  # in place: no
            z.scatter_add_(1, index, p.sum(-1))  # copy of the (L, M, d_v) sum per key block
            parts.append((b, index, p))
        z = z[:, :m, None]
        context = torch.where(z > 0, num[:, :m] / z.clamp_min(torch.finfo(z.dtype).tiny), 0.0)

        weights = None
        if need_weights:
            dense = torch.zeros(count, nq * bs, nbp * bs, dtype=q.dtype, device=q.device)
            for j in range(nq):
                keys = slice((first + j) * bs, (first + j + 1) * bs)
                dense[:, j * bs : (j + 1) * bs, keys] = p_own[:, j]
            dense = torch.nn.functional.pad(dense[:, shift : shift + m], (0, 0, 0, 1))
            for b, index, p in parts:
                at = index[..., None].expand(*index.shape, bs)
                span = slice(b * bs, (b + 1) * bs)
                dense[:, :, span] = dense[:, :, span].scatter_add(1, at, p)
            dense = dense[:, :m]
            weights = dense[..., :n] / z.clamp_min(torch.finfo(z.dtype).tiny)
            weights = torch.nn.functional.pad(weights, (0, n_all - n)).view(*lead, m, n_all)
        return AttentionOutput(context.view(*lead, m, dv), weights)

    def extra_repr(self) -> str:
        return f"block_size={self.block_size}, top_k={self.top_k}"
