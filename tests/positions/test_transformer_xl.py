"""Transformer-XL: A^rel terms (a)-(d) by a loop (Dai et al. 3.3), and the segment recurrence
equals one pass with the causal mask limited to the memory (3.2)."""

import math

import pytest
import torch

import attnkit as ak
from attnkit.positions import TransformerXL, XLRelative, sinusoid_table


def a_rel_loop(scheme, q, k, q_offset):
    """Per head and pair: (a) q_iᵀk_j + (b) q_iᵀ W_R R_{i−j} + (c) uᵀk_j + (d) vᵀ W_R R_{i−j},
    divided by √d (the scaled-dot score)."""
    h, m, n, d = q.shape[-3], q.shape[-2], k.shape[-2], q.shape[-1]
    out = torch.empty(*q.shape[:-2], m, n, dtype=q.dtype)
    w = scheme.w_r.weight.view(h, d, -1)  # rows of head h
    u, v = scheme.u[:, 0], scheme.v[:, 0]
    for head in range(h):
        for i in range(m):
            for j in range(n):
                r = sinusoid_table(torch.tensor(float(q_offset + i - j)), scheme.d_r).double()
                wr = w[head] @ r
                qi, kj = q[..., head, i, :], k[..., head, j, :]
                terms = (qi * kj).sum(-1) + qi @ wr + kj @ u[head] + v[head] @ wr
                out[..., head, i, j] = terms / math.sqrt(d)
    return out


def test_relative_logits_match_terms_a_to_d():
    scheme = XLRelative(3, 2, dtype=torch.float64)
    q, k = (
        torch.randn(2, 2, 3, 3, dtype=torch.float64),
        torch.randn(2, 2, 5, 3, dtype=torch.float64),
    )
    out = scheme(q, k, q_offset=2)
    logits = out.q @ out.k.transpose(-1, -2) / math.sqrt(3) + out.bias
    torch.testing.assert_close(logits, a_rel_loop(scheme, q, k, 2))
    shifted = scheme(q, k, q_offset=22, k_offset=20)
    torch.testing.assert_close(out.bias, shifted.bias)  # depends on i − j only


def test_segments_with_memory_equal_one_pass_with_the_limited_causal_mask():
    torch.manual_seed(0)
    seg, mem_len, segments = 3, 4, 3
    xl = TransformerXL(2, 8, 2, 16, mem_len=mem_len, dtype=torch.float64).eval()
    x = torch.randn(2, seg * segments, 8, dtype=torch.float64)
    memory, outs = None, []
    for s in range(segments):
        y, memory = xl(x[:, s * seg : (s + 1) * seg], memory)
        outs.append(y)
    # one pass: position t sees s <= t and s >= (start of t's segment) - mem_len
    t = torch.arange(seg * segments)
    start = (t // seg) * seg
    mask = (t[None, :] <= t[:, None]) & (t[None, :] >= (start - mem_len)[:, None])
    whole, _ = xl(x, mask=mask)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole)
    assert [m.shape[1] for m in memory] == [mem_len, mem_len]


def test_memory_is_a_stop_gradient():
    xl = TransformerXL(1, 4, 1, 8, mem_len=2, dtype=torch.float64)
    x = torch.randn(1, 4, 4, dtype=torch.float64, requires_grad=True)
    _, memory = xl(x[:, :2])
    assert not memory[0].requires_grad
    y, _ = xl(x[:, 2:], memory)
    (y * torch.randn_like(y)).sum().backward()  # (a plain sum of a LayerNorm is constant)
    assert x.grad[:, :2].abs().sum() == 0 and x.grad[:, 2:].abs().sum() > 0
    assert xl.layers[0].kv_proj.weight.grad.abs().sum() > 0  # memory still feeds the keys


def test_gradcheck():
    scheme = XLRelative(2, 1, dtype=torch.float64)
    q = torch.randn(1, 1, 2, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True)

    def f(q, k):
        p = scheme(q, k, q_offset=1)
        return ak.attention(p.q, p.k, k, bias=p.bias).context

    assert torch.autograd.gradcheck(f, (q, k))


def test_by_name_and_errors():
    mha = ak.MultiHeadAttention(8, 2, position="transformer_xl")
    assert mha.position.u.shape == (2, 1, 4)
    with pytest.raises(ValueError, match="memory has 1"):
        TransformerXL(2, 4, 1, mem_len=2)(torch.randn(1, 2, 4), [torch.randn(1, 2, 4)])


def _stack():
    return TransformerXL(2, 4, 1, mem_len=2)


BAD_CALLS = [
    (
        "memory of another width",
        lambda: _stack()(torch.randn(1, 2, 4), [torch.randn(1, 3, 6)] * 2),
        ValueError,
        r"memory\[0\] must be \(B, P, D\) = \(1, P, 4\).*got shape \(1, 3, 6\)",
    ),
    (
        "memory of another batch",
        lambda: _stack()(torch.randn(2, 2, 4), [torch.randn(2, 3, 4), torch.randn(1, 3, 4)]),
        ValueError,
        r"memory\[1\] must be \(B, P, D\) = \(2, P, 4\).*\(1, 3, 4\)",
    ),
    (
        "memory of another dtype",
        lambda: _stack()(torch.randn(1, 2, 4), [torch.randn(1, 3, 4, dtype=torch.float64)] * 2),
        TypeError,
        r"memory\[0\] has dtype torch.float64",
    ),
    (
        "memory not a list",
        lambda: _stack()(torch.randn(1, 2, 4), torch.randn(1, 3, 4)),
        TypeError,
        r"memory must be a list of \(B, P, D\) tensors",
    ),
    (
        "memory of too few layers",
        lambda: _stack()(torch.randn(1, 2, 4), [torch.randn(1, 2, 4)]),
        ValueError,
        r"memory has 1 entries but the stack has 2 layers",
    ),
    (
        "x of another width",
        lambda: _stack()(torch.randn(1, 2, 5)),
        ValueError,
        r"x must be \(B, M, D\) with D = embed_dim = 4, got shape \(1, 2, 5\)",
    ),
    (
        "layer: memory of another width",
        lambda: _stack().layers[0](torch.randn(1, 2, 4), torch.randn(1, 3, 6)),
        ValueError,
        r"memory must be \(B, P, D\) = \(1, P, 4\)",
    ),
    (
        "layer: h of rank 2",
        lambda: _stack().layers[0](torch.randn(2, 4)),
        ValueError,
        r"h must have at least 3 dims",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()
