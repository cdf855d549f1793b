"""Chunked (memory-efficient) exact attention for every score function.

FlashAttention's idea (Wikipedia, "FlashAttention"), for any score, not only dot products: the
queries and keys are processed in blocks, so no (M, N, d_w) tensor of an additive score and no
(M, N) weight matrix is ever held whole. Peak memory is O(block_q·block_k·d_w + (M + N)·d).

- Softmax (Brauwers eq. 25, with temperature): one pass with a running maximum and sum (online
  softmax); the log-sum-exp per row is kept for the backward pass.
- α-entmax for 1 < α ≤ 2 (sparsemax is α = 2): the threshold τ of
  p_l = [(α−1)e_l − τ]_+^{1/(α−1)} is found by Newton's method on Σ_l p_l(τ) = 1, whose value and
  slope are row sums accumulated over key blocks (one pass per step). The sum is convex and
  decreasing in τ, so Newton from the left, τ₀ = max − 1, rises monotonically to the root; for
  sparsemax each step is Michelot's support update and ends exact, for 1.5-entmax the last
  step solves the quadratic on the final support exactly.
- Sigmoid: each weight is independent, one pass.

The backward pass recomputes each block's scores from the saved per-row statistics (log-sum-exp
or τ) and returns gradients for q, k, v, the bias and every parameter of the score (via
``torch.autograd.grad`` on the block), so training needs no more memory than inference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.alignments import Alignment, Entmax, Entmax15, Sigmoid, Softmax, Sparsemax
from attnkit.output import AttentionOutput
from attnkit.scores import Score

__all__ = ["attend", "default_chunk_size", "supports", "tile_width"]

# Elements per (block_q, block_k, width) score tile: small tiles for cheap scores (memory),
# larger for wide ones (additive: amortise the per-tile Python overhead).
TILE_ELEMENTS = 1 << 19
WIDE_TILE_ELEMENTS = 1 << 21


def tile_width(score: Score) -> int:
    """Elements per (query, key) pair that a dense evaluation of ``score`` materialises."""
    width = getattr(score, "d_w", None) or 1
    return width * (score.d_out or 1)


def default_chunk_size(n: int, score: Score) -> int:
    """Key block size: large enough to amortise Python overhead, small enough for cache."""
    return max(16, min(n, 1024 if tile_width(score) == 1 else 128))


def _alpha(align: Alignment) -> float | None:
    """α of a sparse alignment that the chunked kernel supports, else None."""
    if isinstance(align, Sparsemax):
        return 2.0
    if isinstance(align, Entmax15):
        return 1.5
    if isinstance(align, Entmax) and not align.rho.requires_grad:
        alpha = align._alpha()
        return alpha if 1.0 < alpha <= 2.0 else None
    return None


def supports(align: Alignment) -> bool:
    """Whether the chunked kernel evaluates ``align`` exactly."""
    return isinstance(align, (Softmax, Sigmoid)) or _alpha(align) is not None


def _take(x: Tensor | None, dim: int, start: int, stop: int) -> Tensor | None:
    """x[..., start:stop, ...] along ``dim`` unless that dim is broadcast (size 1)."""
    if x is None or x.shape[dim] == 1:
        return x
    return x.narrow(dim, start, stop - start)


def _block(x: Tensor | None, q0: int, q1: int, k0: int, k1: int) -> Tensor | None:
    """The (…, q1−q0, k1−k0) block (a view) of a mask or bias broadcastable to (…, M, N)."""
    if x is None:
        return None
    if x.dim() < 2:
        return _take(x, -1, k0, k1)
    return _take(_take(x, -2, q0, q1), -1, k0, k1)


@dataclass
class _Plan:
    """Everything the blocks need that is not a tensor to differentiate."""

    score: Score
    align: Alignment
    mask: Tensor | None
    multi: bool
    m: int
    n: int
    block_q: int
    block_k: int
    alpha: float | None

    @property
    def kdim(self) -> int:
        """The key axis of a score block: (…, mq, nk) or (…, mq, nk, d_v)."""
        return -2 if self.multi else -1

    def blocks(self, size: int, total: int) -> Iterator[tuple[int, int]]:
        for start in range(0, total, size):
            yield start, min(start + size, total)

    def scores(
        self, qb: Tensor | None, kb: Tensor, bb: Tensor | None, q0: int, q1: int, k0: int
    ) -> Tensor:
        """Scores of query rows [q0, q1) × keys [k0, k0 + len(kb)) from their blocks (qb, kb
        and the bias block bb), with bias, temperature, and −inf where masked."""
        k1 = k0 + kb.shape[-2]
        e = self.score.pairwise(qb, kb, k0)
        row = -3 if self.multi else -2
        if e.shape[row] != q1 - q0:  # a query-free score scores every row alike
            shape = list(e.shape)
            shape[row] = q1 - q0
            e = e.expand(shape)
        if bb is not None:
            e = e + (bb.unsqueeze(-1) if self.multi else bb)
        if isinstance(self.align, Softmax) and not self.align.is_plain():
            e = e / self.align.temperature.to(e.dtype)
        mask = self.block_mask(q0, q1, k0, k1)
        if mask is not None:
            e = e.masked_fill(~mask, float("-inf"))
        return e

    def tile(self, qp, kp, bias, q0: int, q1: int, k0: int, k1: int) -> Tensor:
        """Scores of the tile [q0, q1) × [k0, k1), slicing the full tensors."""
        qb = None if qp is None else qp[..., q0:q1, :]
        return self.scores(qb, kp[..., k0:k1, :], _block(bias, q0, q1, k0, k1), q0, q1, k0)

    def block_mask(self, q0: int, q1: int, k0: int, k1: int) -> Tensor | None:
        mask = _block(self.mask, q0, q1, k0, k1)
        return None if mask is None else (mask.unsqueeze(-1) if self.multi else mask)

    def per_row(self, stat: Tensor) -> Tensor:
        """A per-row statistic shaped to scale the context: (…, mq, 1) or (…, mq, d_v)."""
        return stat.squeeze(-2) if self.multi else stat

    def combine(self, p: Tensor, vb: Tensor) -> Tensor:
        """Σ_l p_l v_l over the block: (…, mq, d_v)."""
        if self.multi:
            return (p * vb.unsqueeze(-3)).sum(-2)  # eq. 30
        return torch.matmul(p, vb)

    def d_weights(self, d_out: Tensor, vb: Tensor) -> Tensor:
        """∂loss/∂p for the block, from ∂loss/∂context."""
        if self.multi:
            return d_out.unsqueeze(-2) * vb.unsqueeze(-3)
        return torch.matmul(d_out, vb.transpose(-1, -2))

    def d_values(self, p: Tensor, d_out: Tensor) -> Tensor:
        if self.multi:
            return (p * d_out.unsqueeze(-2)).sum(-3)
        return torch.matmul(p.transpose(-1, -2), d_out)

    # ---- the normaliser: weights from scores and per-row statistics -------------------------

    def prob(self, e: Tensor, stat: Tensor | None) -> Tensor:
        if isinstance(self.align, Sigmoid):
            return torch.sigmoid(e)  # −inf (masked) -> 0
        assert stat is not None
        if self.alpha is None:  # softmax; stat = log-sum-exp (+inf for rows with no key)
            return torch.exp(e - stat)
        z = (self.alpha - 1.0) * e - stat
        return torch.clamp(z, min=0) ** (1.0 / (self.alpha - 1.0))

    def slope(self, p: Tensor) -> Tensor:
        """s with ∂p/∂e = diag(s) − [coupled] s sᵀ / Σ s."""
        if isinstance(self.align, Sigmoid):
            return p * (1 - p)
        if self.alpha is None:
            return p
        if self.alpha == 2.0:
            return (p > 0).to(p.dtype)
        return torch.where(p > 0, p, torch.zeros((), dtype=p.dtype)) ** (2.0 - self.alpha)

    @property
    def coupled(self) -> bool:
        return not isinstance(self.align, Sigmoid)


def _softmax_forward(plan: _Plan, qp, kp, v, bias, q0, q1) -> tuple[Tensor, Tensor]:
    """Online softmax over key blocks: returns context and log-sum-exp for rows [q0, q1)."""
    kd = plan.kdim
    run_max = run_sum = acc = None
    for k0, k1 in plan.blocks(plan.block_k, plan.n):
        e = plan.tile(qp, kp, bias, q0, q1, k0, k1)
        blk_max = e.amax(dim=kd, keepdim=True)
        new_max = blk_max if run_max is None else torch.maximum(run_max, blk_max)
        safe = torch.where(torch.isinf(new_max), torch.zeros((), dtype=e.dtype), new_max)
        p = torch.exp(e - safe)
        part = plan.combine(p, v[..., k0:k1, :])
        if run_max is None:
            run_sum, acc = p.sum(dim=kd, keepdim=True), part
        else:
            old_safe = torch.where(torch.isinf(run_max), safe, run_max)
            rescale = torch.exp(old_safe - safe)
            run_sum = run_sum * rescale + p.sum(dim=kd, keepdim=True)
            acc = acc * plan.per_row(rescale) + part
        run_max = new_max
    assert run_max is not None and run_sum is not None and acc is not None
    empty = run_sum == 0
    safe_max = torch.where(torch.isinf(run_max), torch.zeros((), dtype=acc.dtype), run_max)
    denom = torch.where(empty, torch.ones((), dtype=acc.dtype), run_sum)
    context = torch.where(
        plan.per_row(empty), torch.zeros((), dtype=acc.dtype), acc / plan.per_row(denom)
    )
    lse = torch.where(
        empty, torch.full((), float("inf"), dtype=acc.dtype), safe_max + torch.log(denom)
    )
    return context, lse


def _entmax_threshold(plan: _Plan, qp, kp, bias, q0, q1) -> Tensor:
    """τ per row for α-entmax (1 < α ≤ 2) by Newton steps over key-block row sums."""
    assert plan.alpha is not None
    a1 = plan.alpha - 1.0
    power = 1.0 / a1
    kd = plan.kdim

    def passes(tau: Tensor | None):
        tot = slope = cnt = s1 = s2 = zmax = None
        for k0, k1 in plan.blocks(plan.block_k, plan.n):
            z = a1 * plan.tile(qp, kp, bias, q0, q1, k0, k1)
            if tau is None:
                m = z.amax(dim=kd, keepdim=True)
                zmax = m if zmax is None else torch.maximum(zmax, m)
                continue
            gap = torch.clamp(z - tau, min=0)
            inside = (gap > 0).to(z.dtype)
            parts = (
                (gap**power).sum(kd, keepdim=True),
                (gap ** (power - 1.0) * inside).sum(kd, keepdim=True),
                inside.sum(kd, keepdim=True),
                torch.where(gap > 0, z, torch.zeros((), dtype=z.dtype)).sum(kd, keepdim=True),
                torch.where(gap > 0, z * z, torch.zeros((), dtype=z.dtype)).sum(kd, keepdim=True),
            )
            if tot is None:
                tot, slope, cnt, s1, s2 = parts
            else:
                tot, slope, cnt, s1, s2 = (
                    x + y for x, y in zip((tot, slope, cnt, s1, s2), parts, strict=True)
                )
        return zmax if tau is None else (tot, slope, cnt, s1, s2)

    zmax = passes(None)
    empty = torch.isinf(zmax)
    zmax = torch.where(empty, torch.zeros((), dtype=zmax.dtype), zmax)
    tau = zmax - 1.0
    tol = 64 * torch.finfo(zmax.dtype).eps
    for _ in range(100):
        tot, slope, cnt, s1, s2 = passes(tau)
        if plan.alpha == 2.0:
            # Michelot: τ = (Σ_S z − 1)/|S| on the current support; exact once S is stable.
            new = torch.where(cnt > 0, (s1 - 1.0) / cnt.clamp_min(1), tau)
        else:
            step = (tot - 1.0) / (power * slope).clamp_min(torch.finfo(tau.dtype).tiny)
            new = torch.where(slope > 0, tau + step, tau)
        done = bool(((new - tau).abs() <= tol * (1 + tau.abs())).all())
        tau = torch.maximum(tau, new)  # monotone from the left; guards rounding
        if done:
            break
    if plan.alpha == 1.5:
        # On the final support S: Σ_S (z − τ)² = 1, the smaller root of the quadratic.
        tot, slope, cnt, s1, s2 = passes(tau)
        disc = (s1 * s1 - cnt * (s2 - 1.0)).clamp_min(0)
        exact = (s1 - torch.sqrt(disc)) / cnt.clamp_min(1)
        tau = torch.where(cnt > 0, exact, tau)
    return torch.where(empty, torch.full((), float("inf"), dtype=tau.dtype), tau)


def _forward_rows(plan: _Plan, qp, kp, v, bias, q0, q1) -> tuple[Tensor, Tensor | None]:
    """Context and per-row statistic for query rows [q0, q1)."""
    if isinstance(plan.align, Softmax):
        return _softmax_forward(plan, qp, kp, v, bias, q0, q1)
    stat = (
        None if isinstance(plan.align, Sigmoid) else _entmax_threshold(plan, qp, kp, bias, q0, q1)
    )
    acc = None
    for k0, k1 in plan.blocks(plan.block_k, plan.n):
        p = plan.prob(plan.tile(qp, kp, bias, q0, q1, k0, k1), stat)
        part = plan.combine(p, v[..., k0:k1, :])
        acc = part if acc is None else acc + part
    assert acc is not None
    return acc, stat


class _Chunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, qp, kp, v, bias, *params):
        contexts, stats = [], []
        with torch.no_grad():
            for q0, q1 in plan.blocks(plan.block_q, plan.m):
                c, s = _forward_rows(plan, qp, kp, v, bias, q0, q1)
                contexts.append(c)
                stats.append(s)
        context = torch.cat(contexts, dim=-2)
        stat = None if stats[0] is None else torch.cat(stats, dim=-3 if plan.multi else -2)
        ctx.plan = plan
        ctx.save_for_backward(qp, kp, v, bias, context, stat, *params)
        return context

    @staticmethod
    def backward(ctx, d_context):
        plan: _Plan = ctx.plan
        qp, kp, v, bias, context, stat, *params = ctx.saved_tensors
        kd, row = plan.kdim, (-3 if plan.multi else -2)
        g_qp = None if qp is None else torch.zeros_like(qp)
        g_kp, g_v = torch.zeros_like(kp), torch.zeros_like(v)
        g_bias = None if bias is None or not ctx.needs_input_grad[4] else torch.zeros_like(bias)
        g_params = [torch.zeros_like(p) for p in params]
        for q0, q1 in plan.blocks(plan.block_q, plan.m):
            d_out = d_context[..., q0:q1, :]
            st = None if stat is None else stat.narrow(row, q0, q1 - q0)
            if isinstance(plan.align, Softmax):
                # Σ_l p_l ∂L/∂p_l = ∂L/∂c · c, no extra pass needed.
                corr = d_out * context[..., q0:q1, :]
                corr = corr.sum(-1, keepdim=True) if not plan.multi else corr.unsqueeze(-2)
            elif plan.coupled:
                num = den = None
                with torch.no_grad():
                    for k0, k1 in plan.blocks(plan.block_k, plan.n):
                        p = plan.prob(plan.tile(qp, kp, bias, q0, q1, k0, k1), st)
                        s = plan.slope(p)
                        dp = plan.d_weights(d_out, v[..., k0:k1, :])
                        a, b = (s * dp).sum(kd, keepdim=True), s.sum(kd, keepdim=True)
                        num, den = (a, b) if num is None else (num + a, den + b)
                corr = num / torch.where(den > 0, den, torch.ones((), dtype=den.dtype))
            else:
                corr = None
            for k0, k1 in plan.blocks(plan.block_k, plan.n):
                with torch.enable_grad():
                    qb = None if qp is None else qp[..., q0:q1, :].detach().requires_grad_()
                    kb = kp[..., k0:k1, :].detach().requires_grad_()
                    bb = _block(bias, q0, q1, k0, k1)
                    if g_bias is not None:
                        bb = bb.detach().requires_grad_()
                    e = plan.scores(qb, kb, bb, q0, q1, k0)
                with torch.no_grad():
                    p = plan.prob(e.detach(), st)
                    vb = v[..., k0:k1, :]
                    g_v[..., k0:k1, :] += plan.d_values(p, d_out).sum_to_size(vb.shape)
                    dp = plan.d_weights(d_out, vb)
                    s = plan.slope(p)
                    de = s * dp if corr is None else s * (dp - corr)
                    de = torch.where(torch.isinf(e.detach()), torch.zeros((), dtype=de.dtype), de)
                wrt = [t for t in (qb, kb) if t is not None]
                if g_bias is not None:
                    wrt.append(bb)
                grads = list(torch.autograd.grad(e, [*wrt, *params], de, allow_unused=True))
                targets = []
                if qb is not None:
                    targets.append(g_qp[..., q0:q1, :])
                targets.append(g_kp[..., k0:k1, :])
                if g_bias is not None:
                    targets.append(_block(g_bias, q0, q1, k0, k1))
                for target, g in zip([*targets, *g_params], grads, strict=True):
                    if g is not None:
                        target += g
        return (None, g_qp, g_kp, g_v, g_bias, *g_params)


def _weights(plan: _Plan, qp, kp, v, bias) -> tuple[Tensor, Tensor]:
    """Weights and scores, recomputed block by block (no gradient)."""
    w_rows, e_rows = [], []
    with torch.no_grad():
        for q0, q1 in plan.blocks(plan.block_q, plan.m):
            _, stat = _forward_rows(plan, qp, kp, v, bias, q0, q1)
            ws, es = [], []
            for k0, k1 in plan.blocks(plan.block_k, plan.n):
                e = plan.tile(qp, kp, bias, q0, q1, k0, k1)
                ws.append(plan.prob(e, stat))
                es.append(e)
            w_rows.append(torch.cat(ws, dim=plan.kdim))
            e_rows.append(torch.cat(es, dim=plan.kdim))
    row = -3 if plan.multi else -2
    return torch.cat(w_rows, dim=row), torch.cat(e_rows, dim=row)


def attend(
    q: Tensor | None,
    k: Tensor,
    v: Tensor,
    score: Score,
    align: Alignment,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    need_weights: bool = False,
    chunk_size: int | None = None,
) -> AttentionOutput:
    """Evaluate attention block by block; inputs are assumed validated and ``supports(align)``.

    ``chunk_size`` is the key block size (default :func:`default_chunk_size`); query blocks are
    sized so that a score tile holds about 2¹⁹ elements (2²¹ for wide scores such as
    additive). With ``need_weights`` the weights and scores are recomputed block by block into
    (…, M, N) tensors, without gradient.
    """
    if not supports(align):
        raise ValueError(
            f"chunked evaluation does not support the {type(align).__name__} alignment; it "
            "supports softmax, sigmoid, sparsemax and α-entmax with fixed 1 < α ≤ 2"
        )
    n = k.shape[-2]
    m = 1 if q is None else q.shape[-2]
    block_k = default_chunk_size(n, score) if chunk_size is None else chunk_size
    if not isinstance(block_k, int) or block_k < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    lead = math.prod(torch.broadcast_shapes(k.shape[:-2], (q.shape[:-2] if q is not None else ())))
    per_row = block_k * tile_width(score) * max(1, lead)
    budget = TILE_ELEMENTS if tile_width(score) == 1 else WIDE_TILE_ELEMENTS
    block_q = max(1, min(m, budget // per_row))
    plan = _Plan(
        score, align, mask, score.multi_dimensional, m, n, block_q, min(block_k, n), _alpha(align)
    )
    qp = score.project_query(q)
    kp = score.project_key(k)
    params = [p for p in (*score.parameters(), *align.parameters()) if p.requires_grad]
    context = _Chunked.apply(plan, qp, kp, v, bias, *params)
    if not need_weights:
        return AttentionOutput(context)
    weights, scores = _weights(plan, qp, kp, v, bias)
    return AttentionOutput(context, weights, scores)
