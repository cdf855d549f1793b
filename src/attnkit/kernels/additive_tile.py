"""The additive score's tile with its own backward: one compiled pass for the scores, one for
all their gradients.

For a tile of the additive score (Brauwers eq. 6) with a = W_1 q (…, M, d_w), b = W_2 k + b
(…, N, d_w) and the importance vector w (d_w),

    s_ij = Σ_c w_c tanh(a_ic + b_jc),

and, with G = ∂L/∂s and t_ijc = tanh(a_ic + b_jc),

    ∂L/∂a_ic = Σ_j G_ij w_c (1 − t_ijc²),   ∂L/∂b_jc = Σ_i G_ij w_c (1 − t_ijc²),
    ∂L/∂w_c = Σ_ij G_ij t_ijc.

Autograd through a compiled forward recomputes the activations in each of its passes (inductor
cannot reduce over j and over i in one loop, so each reduction evaluates the tanh again); here
a tile evaluated with gradient (inside the chunked kernel's backward pass) keeps t from its one
tanh evaluation, and the backward is one compiled function that produces the three reductions
from t. A forward + backward pass of attention then evaluates each tanh twice (the forward, and
the backward's recomputation), the least a kernel that keeps no (M, N, d_w) tensor can do.
Both functions use :func:`attnkit.kernels.fast_tanh.tanh` (float32 and bfloat16, evaluated in
float32; float64 keeps ``torch.tanh``), so the tile runs at the rate of a few multiply-adds per
pair and feature rather than at the library tanh's.

A compilation that fails warns once (as :mod:`attnkit.kernels.compiled` does) and the same
functions run eagerly: never a wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from attnkit.kernels import compilation as compiled
from attnkit.kernels import fast_tanh
from attnkit.scores import Score

__all__ = ["applies", "gradients", "scores", "scores_and_activations", "tile"]


def applies(score: Score) -> bool:
    """Whether ``score`` is an additive (or concat) score with tanh, no layer beyond the first
    and one score per pair: s = wᵀ tanh(a + b), the form this tile evaluates."""
    from attnkit.scores.additive import Additive

    return (
        isinstance(score, Additive)
        and type(score).pairwise is Additive.pairwise
        and score.act is torch.tanh
        and len(score.hidden) == 0
        and score.d_out is None
    )


def _work(x: Tensor) -> Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def scores(a: Tensor, b: Tensor, w: Tensor) -> Tensor:
    """s_ij = Σ_c w_c tanh(a_ic + b_jc): a (…, M, d_w), b (…, N, d_w), w broadcastable to
    (…, 1, 1, d_w) -> (…, M, N) (in float32 for bfloat16 inputs)."""
    a, b, w = _work(a), _work(b), _work(w)
    return (fast_tanh.tanh(a.unsqueeze(-2) + b.unsqueeze(-3)) * w).sum(-1)


def scores_and_activations(a: Tensor, b: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`scores` and the activations t_ijc = tanh(a_ic + b_jc) (…, M, N, d_w) that the
    gradients need, from one evaluation of the tanh."""
    a, b, w = _work(a), _work(b), _work(w)
    t = fast_tanh.tanh(a.unsqueeze(-2) + b.unsqueeze(-3))
    return (t * w).sum(-1), t


def gradients(
    t: Tensor, w: Tensor, g: Tensor, a_shape: list[int], b_shape: list[int]
) -> tuple[Tensor, Tensor, Tensor]:
    """(∂L/∂a, ∂L/∂b, ∂L/∂w) of :func:`scores` for ∂L/∂s = ``g`` (…, M, N), from the tile's
    activations ``t`` (no tanh evaluated again)."""
    w, g = _work(w), _work(g)
    gt = g.unsqueeze(-1)
    u = gt * w * (1 - t * t)
    g_a = u.sum(-2).sum_to_size(a_shape)
    g_b = u.sum(-3).sum_to_size(b_shape)
    g_w = (gt * t).sum_to_size(w.shape)
    return g_a, g_b, g_w


_COMPILED: dict[str, Callable] = {}
_EAGER = {
    "scores": scores,
    "scores_and_activations": scores_and_activations,
    "gradients": gradients,
}


def _run(name: str, *args):
    """The compiled ``name`` (compiled on first use), or the eager one when compilation is off
    or has failed."""
    fn = _EAGER[name]
    if compiled.enabled() and not compiled.failed(fn) and not torch.compiler.is_compiling():
        try:
            if name not in _COMPILED:
                _COMPILED[name] = compiled.compile_tile(fn)
            return _COMPILED[name](*args)
        except Exception as err:  # compilation unavailable (no compiler, unsupported op, ...)
            compiled.fail(fn, "additive", err)
            _COMPILED.pop(name, None)
    return fn(*args)


class _Tile(torch.autograd.Function):
    """s = wᵀ tanh(a + b) over a tile; keeps the tile's activations t for the backward pass
    (the chunked kernel evaluates a tile with gradient only inside its backward pass, one tile
    at a time, so this holds O(tile) memory)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, w: Tensor) -> Tensor:
        s, t = _run("scores_and_activations", a, b, w)
        ctx.save_for_backward(t, w)
        ctx.shapes = (list(a.shape), list(b.shape))
        ctx.dtypes = (a.dtype, b.dtype)
        return s.to(a.dtype)

    @staticmethod
    def backward(ctx, g: Tensor):
        t, w = ctx.saved_tensors
        g_a, g_b, g_w = _run("gradients", t, w, g.contiguous(), *ctx.shapes)
        return g_a.to(ctx.dtypes[0]), g_b.to(ctx.dtypes[1]), g_w.to(w.dtype)


def tile(score: Score) -> Callable[[Tensor | None, Tensor, int], Tensor]:
    """``score.pairwise`` for a score that :func:`applies`, through the fused tile (the plain
    ``pairwise`` for a query-free call, whose tile is a single row)."""
    weight = score.w.weight  # (1, d_w), or (H, 1, d_w) with heads

    def run(qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        if qp is None:
            return score.pairwise(qp, kp, key_offset)
        w = weight.unsqueeze(-2)
        if torch.is_grad_enabled() and (qp.requires_grad or kp.requires_grad or w.requires_grad):
            return _Tile.apply(qp, kp, w)
        return _run("scores", qp, kp, w).to(qp.dtype)

    return run
