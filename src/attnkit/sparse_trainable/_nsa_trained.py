"""NSA's fused path (:mod:`attnkit.sparse_trainable._nsa_blocks`) under autograd with the gates
and the block compression inside one autograd function, so that their gradients are added
into ∂L/∂q, ∂L/∂k and ∂L/∂v a head at a time.

Where the gates (a linear map of q and a sigmoid) and φ (:class:`~attnkit.sparse_trainable.nsa.
BlockCompression`) run under autograd of their own, each sends back a gradient of the size of
q, k or v, held beside the three gradients until autograd adds it in. Here the function takes
their parameters: the forward computes one head's compressed keys and values and its gates
before the head's branches, the backward recomputes them, runs the branches' backward
(:func:`~attnkit.sparse_trainable._nsa_blocks._backward_item`) into per-head buffers of the
compressed blocks' and the gates' gradients, and carries those back through φ and the gates
into the head's rows of ∂L/∂q, ∂L/∂k, ∂L/∂v and into the parameters' gradients.

φ as :meth:`BlockCompression.sequence` computes it where the stride s divides the block l and
the length N: the compressed block j is W·flatten(P) + b + Σ_i W_i · x̄_{j+i}, x̄_m the m-th
run of s rows flattened, W_i the columns of W that read run i of the block. With G = ∂L/∂K̃
(C × d_out): ∂L/∂x̄_m = Σ_i G_{m−i} W_i, ∂L/∂W_i = Gᵀ x̄_{i : i+C} (+ the position term),
∂L/∂b = Σ_j G_j, ∂L/∂P = reshape(Wᵀ Σ_j G_j). The gates g = σ(q W_gᵀ + b_g): with
∂L/∂z = ∂L/∂g · g(1 − g), ∂L/∂q += ∂L/∂z W_g, ∂L/∂W_g = ∂L/∂zᵀ q, ∂L/∂b_g = Σ ∂L/∂z.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit.sparse_trainable._nsa_blocks import (
    _backward_item,
    _forward_group,
    _Geometry,
)
from attnkit.sparse_trainable._nsa_chunks import Sizes
from attnkit.sparse_trainable.compression import BlockCompression

__all__ = ["fuses", "nsa_trained"]


def fuses(compress_key: nn.Module, compress_value: nn.Module, gate: nn.Module, n: int, sz) -> bool:
    """Whether the compression and the gates fit the fused function: both φ the module's
    :class:`BlockCompression` of block l, s dividing l and N, the gate a plain linear map."""
    return (
        all(
            type(phi) is BlockCompression and phi.block == sz.block
            for phi in (compress_key, compress_value)
        )
        and type(gate) is nn.Linear
        and gate.bias is not None
        and sz.block % sz.stride == 0
        and n % sz.stride == 0
        and n >= sz.block
    )


def _runs(x: Tensor, stride: int) -> Tensor:
    """x (N, d) as its runs of ``stride`` rows flattened, (N/stride, stride·d), a view."""
    return x.view(x.shape[0] // stride, stride * x.shape[1])


def _compress(x: Tensor, position: Tensor, weight: Tensor, bias: Tensor, sz: Sizes) -> Tensor:
    """φ of every block of one head's x (N, d) -> (C, d_out) (module docstring)."""
    s, parts = sz.stride, sz.block // sz.stride
    runs = _runs(x, s)
    c = runs.shape[0] - parts + 1
    out = torch.addmv(bias, weight, position.flatten()).expand(c, -1).clone()
    for i, w in enumerate(weight.split(s * x.shape[1], dim=1)):
        out.addmm_(runs[i : i + c], w.t())
    return out


def _compress_backward(x, position, weight, g: Tensor, sz: Sizes, dx, dposition, dweight, dbias):
    """Add one head's share of φ's gradients, given G = ∂L/∂K̃ (C, d_out) (module docstring)."""
    s = sz.stride
    runs, druns = _runs(x, s), _runs(dx, s)
    c = g.shape[0]
    total = g.sum(0)
    dbias += total
    dweight.addr_(total, position.flatten())
    dposition += (weight.t() @ total).view_as(position)
    for i, (w, dw) in enumerate(
        zip(weight.split(s * x.shape[1], dim=1), dweight.split(s * x.shape[1], dim=1), strict=True)
    ):
        druns[i : i + c].addmm_(g, w)
        dw.addmm_(g.t(), runs[i : i + c])


class _NSATrained(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, pk, wk, bk, pv, wv, bv, wg, bg, q_offset, sz, scale):
        count, m, _ = q.shape
        geo = _Geometry(m, k.shape[1], q_offset, sz)
        out = q.new_empty(count, m, v.shape[-1])
        lse = q.new_empty(count, 3, m)
        blocks = -(-k.shape[1] // sz.select)
        kind = torch.int16 if blocks < 1 << 15 else torch.int32
        chosen = torch.empty(count, m, min(sz.selected, blocks), dtype=kind, device=q.device)
        for c in range(0, count, sz.group):
            items = []
            for i in range(c, c + sz.group):
                kc, vc = _compress(k[i], pk, wk, bk, sz), _compress(v[i], pv, wv, bv, sz)
                gates = torch.sigmoid(torch.addmm(bg, q[i], wg.t()))
                items.append((q[i], k[i], v[i], kc, vc, gates, out[i], lse[i], chosen[i]))
            _forward_group(items, geo, scale)
            del items
        ctx.save_for_backward(q, k, v, pk, wk, bk, pv, wv, bv, wg, bg, lse, chosen)
        ctx.q_offset, ctx.sz, ctx.scale = q_offset, sz, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        q, k, v, pk, wk, bk, pv, wv, bv, wg, bg, lse, chosen = ctx.saved_tensors
        sz = ctx.sz
        geo = _Geometry(q.shape[1], k.shape[1], ctx.q_offset, sz)
        dq, dk, dv = (torch.zeros_like(x) for x in (q, k, v))
        dparams = [torch.zeros_like(x) for x in (pk, wk, bk, pv, wv, bv, wg, bg)]
        dpk, dwk, dbk, dpv, dwv, dbv, dwg, dbg = dparams
        for c in range(q.shape[0]):
            kc, vc = _compress(k[c], pk, wk, bk, sz), _compress(v[c], pv, wv, bv, sz)
            gates = torch.sigmoid(torch.addmm(bg, q[c], wg.t()))
            dkc, dvc, dgates = torch.zeros_like(kc), torch.zeros_like(vc), torch.zeros_like(gates)
            # one head's gradient at a time: the incoming one may be a broadcast (of a sum)
            _backward_item(
                q[c], k[c], v[c], kc, vc, gates, geo, ctx.scale, lse[c], chosen[c],
                grad[c].contiguous(), [dq[c], dk[c], dv[c], dkc, dvc, dgates],
            )  # fmt: skip
            del kc, vc
            _compress_backward(k[c], pk, wk, dkc, sz, dk[c], dpk, dwk, dbk)
            _compress_backward(v[c], pv, wv, dvc, sz, dv[c], dpv, dwv, dbv)
            dz = dgates.mul_(gates).mul_(1.0 - gates)
            dq[c].addmm_(dz, wg)
            dwg.addmm_(dz.t(), q[c])
            dbg += dz.sum(0)
        return (dq, dk, dv, *dparams, None, None, None)


def nsa_trained(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    compress_key: nn.Module,
    compress_value: nn.Module,
    gate: nn.Linear,
    q_offset: int,
    sz: Sizes,
    scale: float,
) -> Tensor:
    """The gated NSA context (count, M, d_v) where the fused path and :func:`fuses` apply,
    under autograd, with the gates and φ inside the autograd function (module docstring).

    Args:
        q: (count, M, d); k, v: (count, N, d), (count, N, d_v), N = q_offset + M.
        compress_key, compress_value: the two :class:`BlockCompression` modules.
        gate: the gates' linear map (d → 3).
        q_offset: the position of the first query, a multiple of l'.
        sz: the sizes; ``group`` consecutive items share their selection.
        scale: the factor of the dot products.
    """
    q, k, v = (x.contiguous() for x in (q, k, v))
    params = (
        compress_key.position, compress_key.proj.weight, compress_key.proj.bias,
        compress_value.position, compress_value.proj.weight, compress_value.proj.bias,
        gate.weight, gate.bias,
    )  # fmt: skip
    return _NSATrained.apply(q, k, v, *params, q_offset, sz, scale)
