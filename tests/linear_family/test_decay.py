"""The three forms of decayed linear attention agree with a loop written from the equation
(float64, chunk sizes that do and do not divide N), carry the state across calls, never let a
later position reach an earlier row, and the stable segment sum matches the Mamba-2 reference."""

import pytest
import torch
from transformers.models.mamba2 import modeling_mamba2

from attnkit.linear_family import decay


def _inputs(lead=(2, 3), n=11, dk=4, dv=5, vector=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(*lead, n, dk, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(*lead, n, dv, generator=g, dtype=torch.float64)
    # decays α in (0, 1): per key dimension, or one per position
    alpha = torch.rand(*lead, n, dk if vector else 1, generator=g, dtype=torch.float64) * 0.6 + 0.3
    return q, k, v, alpha


def _reference(q, k, v, alpha):
    """o_i = Σ_{j≤i} Σ_d q_id k_jd (Π_{j<t≤i} α_td) v_j, term by term."""
    n = q.shape[-2]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    for i in range(n):
        for j in range(i + 1):
            prod = torch.ones_like(alpha[..., 0, :])
            for t in range(j + 1, i + 1):
                prod = prod * alpha[..., t, :]
            w = (q[..., i, :] * k[..., j, :] * prod).sum(-1, keepdim=True)
            out[..., i, :] += w * v[..., j, :]
    return out


@pytest.mark.parametrize("vector", [True, False], ids=["per-dimension", "scalar"])
def test_parallel_chunkwise_and_recurrent_equal_the_equation(vector):
    q, k, v, alpha = _inputs(vector=vector)
    g = alpha.log()
    ref = _reference(q, k, v, alpha)
    torch.testing.assert_close(decay.parallel(q, k, v, g), ref, atol=1e-12, rtol=1e-10)
    rec, last = decay.recurrent(q, k, v, g)
    torch.testing.assert_close(rec, ref, atol=1e-12, rtol=1e-10)
    for c in (1, 2, 3, 4, 5, 11, 16):  # 3, 4, 5 do not divide 11
        out, state = decay.chunkwise(q, k, v, g, c)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10, msg=f"chunk {c}")
        torch.testing.assert_close(state, last, atol=1e-12, rtol=1e-10)
    w = decay.weights(q, k, g)
    torch.testing.assert_close(w @ v, ref, atol=1e-12, rtol=1e-10)
    assert (w.triu(1) == 0).all()


def test_sub_chunks_of_per_dimension_decays_equal_the_recurrence():
    """Chunks longer than decay.SUB split their per-dimension decays at sub-chunk ends."""
    q, k, v, alpha = _inputs(vector=True, n=3 * decay.SUB + 5, seed=4)
    g = alpha.log()
    ref = decay.recurrent(q, k, v, g)[0]
    torch.testing.assert_close(decay.parallel(q, k, v, g), ref, atol=1e-12, rtol=1e-10)
    for c in (decay.SUB + 4, 2 * decay.SUB + 1, 64):
        out = decay.chunkwise(q, k, v, g, c)[0]
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10, msg=f"chunk {c}")
    bad = [x.clone() for x in (q, k, v, g)]
    for x in bad:
        x[..., 40:, :] = float("nan")
    for out in (decay.parallel(*bad), decay.chunkwise(*bad, 2 * decay.SUB + 1)[0]):
        torch.testing.assert_close(out[..., :40, :], ref[..., :40, :], atol=1e-12, rtol=1e-10)


def test_the_state_carries_a_sequence_across_calls():
    q, k, v, alpha = _inputs(vector=True, n=13, seed=1)
    g = alpha.log()
    whole, last = decay.chunkwise(q, k, v, g, 4)
    a, s = decay.chunkwise(q[..., :6, :], k[..., :6, :], v[..., :6, :], g[..., :6, :], 4)
    b, s2 = decay.chunkwise(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :], g[..., 6:, :], 3, s)
    torch.testing.assert_close(torch.cat([a, b], -2), whole, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(s2, last, atol=1e-12, rtol=1e-10)
    c, s3 = decay.recurrent(q[..., 6:, :], k[..., 6:, :], v[..., 6:, :], g[..., 6:, :], s)
    torch.testing.assert_close(c, b, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(s3, last, atol=1e-12, rtol=1e-10)


def test_gradients_of_the_forms_agree():
    q, k, v, alpha = _inputs(vector=True, n=9, seed=2)
    grads = []
    for form in ("parallel", "chunkwise", "recurrent"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, alpha.log())]
        if form == "parallel":
            out = decay.parallel(*xs)
        elif form == "chunkwise":
            out = decay.chunkwise(*xs, 4)[0]
        else:
            out = decay.recurrent(*xs)[0]
        (out * torch.linspace(-1, 1, out.numel()).view_as(out).double()).sum().backward()
        grads.append([x.grad for x in xs])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("plant", [float("nan"), float("inf")])
def test_a_later_non_finite_position_reaches_no_earlier_row(plant):
    q, k, v, alpha = _inputs(vector=True, n=10, seed=3)
    g = alpha.log()
    clean = decay.parallel(q, k, v, g)
    bad = [x.clone() for x in (q, k, v, g)]
    for x in bad:
        x[..., 7:, :] = plant
    for out in (
        decay.parallel(*bad),
        decay.chunkwise(*bad, 3)[0],
        decay.chunkwise(*bad, 4)[0],
        decay.recurrent(*bad)[0],
    ):
        torch.testing.assert_close(out[..., :7, :], clean[..., :7, :], atol=1e-12, rtol=1e-10)


def test_segment_sum_matches_the_mamba2_reference():
    g = -torch.rand(2, 3, 9, dtype=torch.float64)
    ours = decay.segment_sum(g.unsqueeze(-1)).squeeze(-1)
    theirs = modeling_mamba2.segment_sum(g)  # −inf above the diagonal
    below = decay.tril(9)
    torch.testing.assert_close(ours[..., below], theirs[..., below], atol=1e-14, rtol=1e-12)
    assert (ours[..., ~below] == 0).all() and (theirs[..., ~below] == float("-inf")).all()


def _elements_computed(step) -> int:
    """The elements of every tensor the aten operators produce while ``step`` runs (forward and
    backward): a count of the work that does not depend on the machine's load."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Count.total += sum(x.numel() for x in tree_leaves(out) if isinstance(x, torch.Tensor))
            return out

    with Count():
        step()
    return Count.total


def _recurrence(q, k, v, g):
    """S_t = diag(exp g_t) S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t, one position at a time."""
    s = torch.zeros(*q.shape[:-2], k.shape[-1], v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(q.shape[-2]):
        s = g[..., t, :, None].exp() * s + k[..., t, :, None] @ v[..., t, None, :]
        outs.append((q[..., t, None, :] @ s).squeeze(-2))
    return torch.stack(outs, -2)


@pytest.mark.parametrize("form", ["chunkwise", "sub-chunked", "recurrent"])
@pytest.mark.parametrize("vector", [True, False], ids=["per-dimension", "scalar"])
def test_a_training_step_grows_linearly_in_the_length(vector, form):
    """A forward and backward of the chunkwise form (chunks of 4, or of 2·SUB + 1 with
    per-dimension decays split at sub-chunk ends) and of the recurrent form at 4N computes 4×
    the elements of one at N (O(N·C) at a fixed chunk size, O(N) steps), and their gradients
    equal those of the recurrence."""

    def step(n, form):
        q, k, v, alpha = _inputs(lead=(1, 2), n=n, dk=4, dv=4, vector=vector, seed=5)
        xs = [x.requires_grad_() for x in (q, k, v, alpha.log())]
        if form == "chunkwise":
            out = decay.chunkwise(*xs, 4)[0]
        elif form == "sub-chunked":
            out = decay.chunkwise(*xs, 2 * decay.SUB + 1)[0]
        elif form == "recurrent":
            out = decay.recurrent(*xs)[0]
        else:
            out = _recurrence(*xs)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out).double()).sum().backward()
        return [x.grad for x in xs]

    small, large = (_elements_computed(lambda n=n: step(n, form)) for n in (128, 512))
    assert large / small < 4.4, f"{large / small:.2f}× the elements for 4× the length"
    for a, b in zip(step(61, form), step(61, "reference"), strict=True):  # chunks not dividing 61
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
