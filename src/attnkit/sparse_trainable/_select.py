"""Shared helpers of the trainable sparse parts: causal positions, per-row masks, token gathers
and top-n selection with a fixed tie order.

Conventions: per-head tensors (*lead, M, d) / (*lead, N, d); query i sits at position
``q_offset + i`` and key j at position j, so query i may attend keys j ≤ q_offset + i (causal).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "all_finite",
    "gather_keys",
    "gather_mask",
    "group_sum",
    "query_positions",
    "row_mask",
    "sanitize",
    "top_indices",
    "top_mask",
    "top_set",
]


def all_finite(*xs: Tensor) -> bool:
    """Whether every entry of the tensors is finite, without a tensor of their size: a sum
    holding a NaN or an infinity is not finite, so a finite sum settles it in one pass; only a
    sum that overflowed (or a tensor that is not finite) is checked entry by entry, a slice of
    rows (dim −2) at a time."""
    for x in xs:
        if x.numel() == 0 or bool(torch.isfinite(x.sum())):
            continue
        if x.dim() < 2:
            if not bool(torch.isfinite(x).all()):
                return False
            continue
        step = max(1, (1 << 16) // max(1, x[..., :1, :].numel()))
        for a in range(0, x.shape[-2], step):
            if not bool(torch.isfinite(x.narrow(-2, a, min(step, x.shape[-2] - a))).all()):
                return False
    return True


def query_positions(m: int, q_offset: int, device) -> Tensor:
    """(M,) int64 positions of the queries."""
    return torch.arange(q_offset, q_offset + m, device=device)


def row_mask(mask: Tensor | None, lead: torch.Size, m: int, n: int) -> Tensor | None:
    """The mask as (*lead, M', N) with M' = M when it varies over queries and 1 otherwise."""
    if mask is None:
        return None
    rows = m if mask.dim() >= 2 and mask.shape[-2] == m else 1
    return mask.broadcast_to(*lead, rows, n)


def sanitize(
    k: Tensor, v: Tensor, rows: Tensor | None, last_position: int
) -> tuple[Tensor, Tensor]:
    """Zero the keys and values no query may attend (masked for every row, or after the last
    query), so that NaN or inf there reaches no result and no gradient."""
    n = k.shape[-2]
    if rows is None and last_position >= n - 1:  # every key is read by some query: no copy
        return k, v
    seen = torch.arange(n, device=k.device) <= last_position  # (N,)
    if rows is not None:
        seen = seen & rows.any(-2)  # (*lead, N)
    keep = seen[..., None]
    return k.where(keep, 0.0), v.where(keep, 0.0)


def gather_keys(x: Tensor, index: Tensor) -> Tensor:
    """Rows of x (*lead, N, d) at ``index`` (*lead, M, T) (values in [0, N)) -> (*lead, M, T, d);
    per query row, without materialising (M, N, d)."""
    lead = index.shape[:-2]
    m, t = index.shape[-2:]
    src = x.broadcast_to(*lead, *x.shape[-2:])
    flat = index.reshape(*lead, m * t)
    out = torch.gather(src, -2, flat[..., None].expand(*lead, m * t, x.shape[-1]))
    return out.reshape(*lead, m, t, x.shape[-1])


def gather_mask(rows: Tensor | None, index: Tensor) -> Tensor | None:
    """The mask (*lead, M', N) at ``index`` (*lead, M, T) -> (*lead, M, T)."""
    if rows is None:
        return None
    m = index.shape[-2]
    return torch.gather(rows.expand(*index.shape[:-2], m, rows.shape[-1]), -1, index)


def group_sum(x: Tensor, group_size: int) -> Tensor:
    """Sum (*lead, H, M, K) over consecutive groups of ``group_size`` heads (dim −3), each head
    receiving its group's sum (the GQA sharing of NSA eq. 10)."""
    if group_size == 1:
        return x
    h = x.shape[-3]
    grouped = x.unflatten(-3, (h // group_size, group_size))
    return grouped.sum(-3, keepdim=True).expand_as(grouped).flatten(-4, -3)


def _taken_at_bar(rows: Tensor, bar: Tensor, count: int) -> Tensor:
    """(R, K) bool: every entry of ``rows`` above its row's ``bar`` (R, 1) and the first ones
    equal to it, ``count`` in all: the choice of a stable descending sort where a tie at the
    count-th value crosses the border."""
    above = rows > bar
    tied = rows == bar
    need = count - above.sum(-1, keepdim=True, dtype=torch.int32)
    return above | (tied & (tied.cumsum(-1, dtype=torch.int32) <= need))


def top_indices(score: Tensor, count: int, *, ordered: bool = True) -> tuple[Tensor, Tensor]:
    """The ``count`` highest entries of ``score`` (…, K) per row, ties in index order (the set
    a stable descending sort puts first), in index order, and whether each is finite-or-+inf
    (entries at −inf are not available). NaN ranks as −inf.

    A partial selection, not a sort: ``torch.topk`` finds the count-th highest value v, and the
    row takes every entry above v and the first entries equal to v (O(K) per row, where a sort
    is O(K log K)).

    With ``ordered`` False the set comes in any order (no sort of the chosen indices).

    Returns:
        (index (…, count), available (…, count) bool).
    """
    count = min(count, score.shape[-1])
    lead, k = score.shape[:-1], score.shape[-1]
    if count == 0 or lead.numel() == 0:
        empty = score.new_zeros(*lead, count, dtype=torch.long)
        return empty, empty.bool()
    inf = float("inf")
    values, order = torch.topk(score, count, dim=-1, sorted=False)
    if bool(values.isnan().any()):  # topk ranks NaN highest: a row with one chose it
        score = score.nan_to_num(nan=-inf, posinf=inf, neginf=-inf)
        values, order = torch.topk(score, count, dim=-1, sorted=False)
    bar = values.amin(-1, keepdim=True)
    # the set is topk's where exactly ``count`` entries of a row reach the bar (no tie at it
    # outside the set); counted in int32 over the bytes of the comparison, several times
    # faster than a bool sum into int64
    reach = (score >= bar).view(torch.uint8).sum(-1, dtype=torch.int32)
    tied_rows = (reach != count).view(-1).nonzero()[:, 0]
    if len(tied_rows):  # those rows take every entry above the bar and the first ones at it
        rows = score.reshape(-1, k)[tied_rows]
        take = _taken_at_bar(rows, bar.reshape(-1, 1)[tied_rows], count)
        index = take.nonzero()[:, 1].view(len(tied_rows), count)  # exactly count per row
        order, values = order.reshape(-1, count), values.reshape(-1, count)  # (topk's own)
        order[tied_rows], values[tied_rows] = index, torch.gather(rows, -1, index)
        order, values = order.view(*lead, count), values.view(*lead, count)
    if not ordered:
        return order, values > -inf
    order, rank = order.sort(-1)
    return order, torch.gather(values, -1, rank) > -inf


def top_mask(score: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The entries :func:`top_indices` marks available, as an additive mask written over
    ``score`` (R, K) itself: 0 at the ``count`` highest entries of each row that are above −inf
    (ties in index order, NaN as −inf), −inf elsewhere; and whether each row has one (R,).

    One ``torch.topk`` of count + 1 entries: its lowest value v is the (count + 1)-th highest,
    so where v occurs once among them the set is every entry above v (no tie crosses the
    border, and no pass over the row is needed to find out); rows where v occurs more than
    once (and is above −inf) take every entry above it and the first ones at it. The mask is
    the row filled with −inf and the set scattered in.

    Returns:
        (the mask, ``score``'s own storage, has (R,) bool).
    """
    inf = float("inf")
    rows, k = score.shape
    if count >= k or rows == 0:  # every entry above −inf (NaN is not)
        keep = score > -inf
        return score.zero_().masked_fill_(~keep, -inf), keep.any(-1)
    values, order = torch.topk(score, count + 1, dim=-1, sorted=False)
    low = values.amin(-1, keepdim=True)
    if bool(low.isnan().any()):  # topk ranks NaN highest: a row with one chose it
        score.nan_to_num_(nan=-inf, posinf=inf, neginf=-inf)
        values, order = torch.topk(score, count + 1, dim=-1, sorted=False)
        low = values.amin(-1, keepdim=True)
    inside = values > low
    # fewer than count above the lowest: it occurs more than once (a tie crosses the border)
    reach = inside.sum(-1, dtype=torch.int32)
    tied_rows = ((reach < count) & (low[:, 0] > -inf)).nonzero()[:, 0]
    if len(tied_rows):  # every entry above the bar and the first ones at it
        x = score[tied_rows]
        take = _taken_at_bar(x, low[tied_rows], count)
    zero = torch.zeros((), dtype=score.dtype, device=score.device)
    src = torch.where(inside, zero, zero - inf)
    mask = score.fill_(-inf).scatter_(1, order, src)
    has = reach > 0
    if len(tied_rows):
        mask[tied_rows] = torch.zeros_like(x).masked_fill_(~take, -inf)
        has[tied_rows] = True
    return mask, has


def top_set(score: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The set of :func:`top_indices` with ``ordered`` False (the ``count`` highest entries of
    each row of ``score`` (…, K), ties in index order, NaN as −inf), with the scores there.

    One ``torch.topk`` of count + 1 entries, as :func:`top_mask`: where its lowest value v
    occurs once (or is −inf) the set is the others, where it occurs more than once (a tie
    crosses the border) the row takes every entry above v and the first ones at it. No pass
    over the row beyond topk's own.

    Returns:
        (index (…, count) int64 in any order, values (…, count): the scores there, NaN as
        −inf; an entry is available where its value is above −inf). Views, not contiguous.
    """
    lead, k = score.shape[:-1], score.shape[-1]
    count = min(count, k)
    if count == 0 or lead.numel() == 0:
        return score.new_zeros(*lead, count, dtype=torch.long), score.new_zeros(*lead, count)
    inf = float("inf")
    flat = score.reshape(-1, k)
    if count == k:
        index = torch.arange(k, device=score.device).expand(*lead, k)
        return index, score.nan_to_num(nan=-inf, posinf=inf, neginf=-inf)
    values, order = torch.topk(flat, count + 1, dim=-1, sorted=False)
    low = values.amin(-1, keepdim=True)
    if bool(low.isnan().any()):  # topk ranks NaN highest: a row with one chose it
        flat = flat.nan_to_num(nan=-inf, posinf=inf, neginf=-inf)
        values, order = torch.topk(flat, count + 1, dim=-1, sorted=False)
        low = values.amin(-1, keepdim=True)
    # one entry at the lowest value leaves: the last column, where topk puts it (its
    # partial sort ends at the (count + 1)-th); where not, swapped there first
    if not bool((values[:, count:] == low).all()):
        spare = values.argmin(-1, keepdim=True)
        last_order, last_value = order[:, count:].clone(), values[:, count:].clone()
        order[:, count:] = torch.gather(order, 1, spare)
        values[:, count:] = low
        order.scatter_(1, spare, last_order)
        values.scatter_(1, spare, last_value)
    order, values = order[:, :count], values[:, :count]
    # another entry at the lowest value left: a tie crosses the border
    reach = (values > low).sum(-1, dtype=torch.int32)
    tied_rows = ((reach < count) & (low[:, 0] > -inf)).nonzero()[:, 0]
    if len(tied_rows):  # every entry above the bar and the first ones at it
        rows = flat[tied_rows]
        take = _taken_at_bar(rows, low[tied_rows], count)
        index = take.nonzero()[:, 1].view(len(tied_rows), count)  # exactly count per row
        order[tied_rows], values[tied_rows] = index, torch.gather(rows, -1, index)
    return order.view(*lead, count), values.view(*lead, count)
