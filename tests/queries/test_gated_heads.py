"""GaAN's gated heads against a loop over queries, neighbours and heads written from the paper's
equations (float64), with a graph-neighbourhood mask; zero gates silence every head."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.queries.gated_heads import GatedHeadAttention

D = torch.float64


def _loop(mod, x, z, allowed):
    k_heads, dh = mod.num_heads, mod.head_dim
    wq, wk, wv = (w.weight.detach() for w in (mod.query, mod.key, mod.value))
    b, m, _ = x.shape
    n = z.shape[1]
    out = torch.zeros(b, m, mod.out.out_features, dtype=D)
    gates_all = torch.zeros(b, m, k_heads, dtype=D)
    for bi in range(b):
        for i in range(m):
            nbrs = [j for j in range(n) if allowed[bi, i, j]]
            # gate network: max of W_m z_j + b_m over neighbours, feature by feature; mean of z_j
            if nbrs:
                proj = [mod.pool.weight.detach() @ z[bi, j] + mod.pool.bias.detach() for j in nbrs]
                pooled = torch.tensor(
                    [max(p[f].item() for p in proj) for f in range(proj[0].shape[0])], dtype=D
                )
                mean = sum(z[bi, j] for j in nbrs) / len(nbrs)
            else:
                pooled = torch.zeros(mod.pool.out_features, dtype=D)
                mean = torch.zeros(z.shape[-1], dtype=D)
            cat = torch.cat([x[bi, i], pooled, mean])
            g = torch.sigmoid(mod.gate.weight.detach() @ cat + mod.gate.bias.detach())
            gates_all[bi, i] = g
            heads = []
            for h in range(k_heads):
                rows = slice(h * dh, (h + 1) * dh)
                qi = wq[rows] @ x[bi, i]
                o = torch.zeros(dh, dtype=D)
                if nbrs:
                    e = [float(qi @ (wk[rows] @ z[bi, j])) for j in nbrs]
                    top = max(e)
                    tot = sum(math.exp(s - top) for s in e)
                    for j, s in zip(nbrs, e, strict=True):
                        o = o + math.exp(s - top) / tot * (wv[rows] @ z[bi, j])
                heads.append(g[h] * o)
            cat = torch.cat([x[bi, i], *heads])
            out[bi, i] = mod.out.weight.detach() @ cat + mod.out.bias.detach()
    return out, gates_all


def test_gated_heads_equal_the_paper_loop_on_a_graph():
    torch.manual_seed(0)
    mod = GatedHeadAttention(4, 5, num_heads=3, head_dim=2, d_m=3, d_out=6, dtype=D)
    x, z = torch.randn(2, 4, 4, dtype=D), torch.randn(2, 5, 5, dtype=D)
    adjacency = torch.rand(2, 4, 5) < 0.5
    adjacency[0, 1] = False  # a node without neighbours
    out = mod(x, z, adjacency)
    ref, gates = _loop(mod, x, z, adjacency)
    torch.testing.assert_close(out.output, ref)
    torch.testing.assert_close(out.gates, gates)
    assert (out.weights[0, :, 1] == 0).all()


def test_closed_gates_leave_only_the_query_path():
    torch.manual_seed(1)
    mod = GatedHeadAttention(4, 4, num_heads=2, head_dim=3, d_m=2, dtype=D)
    with torch.no_grad():
        mod.gate.weight.zero_()
        mod.gate.bias.fill_(-1e4)  # σ → 0: every head silenced
    x, z = torch.randn(2, 3, 4, dtype=D), torch.randn(2, 5, 4, dtype=D)
    out = mod(x, z)
    w_x = mod.out.weight[:, :4]
    torch.testing.assert_close(out.output, x @ w_x.T + mod.out.bias)


def test_errors():
    mod = GatedHeadAttention(4, 5, num_heads=2, head_dim=3, d_m=4)
    with pytest.raises(ValueError, match=r"z must be \(B, L, 5\)"):
        mod(torch.randn(2, 3, 4), torch.randn(2, 6, 4))
    with pytest.raises(ValueError, match="batch"):
        mod(torch.randn(2, 3, 4), torch.randn(3, 6, 5))
