"""Hermitian scores (Tay et al.; Galassi IV-D2) against loops over Python complex numbers; the
directed (role-dependent) variant, and the direction task that only it learns."""

from __future__ import annotations

import pytest
import torch
from helpers import rand
from successor_task import V, direction_accuracy

import attnkit as ak
from attnkit.scores import DirectedHermitian, Hermitian


def _phi(score, x):
    """φ(x) as a list of Python complex numbers, from the parameters."""
    x = x.detach()
    re = score.W_re.weight.detach() @ x
    im = score.W_im.weight.detach() @ x
    return [complex(float(a), float(b)) for a, b in zip(re, im, strict=True)]


def _hermitian_loop(score, q, k):
    """⟨φ(q_m), φ(k_n)⟩ = Σ_c φ(q_m)_c · conj(φ(k_n)_c) for every (m, n)."""
    rows = []
    for qm in q:
        pq = _phi(score, qm)
        rows.append(
            [sum(a * b.conjugate() for a, b in zip(pq, _phi(score, kn), strict=True)) for kn in k]
        )
    return rows


def test_scores_are_the_real_part_of_the_hermitian_product():
    torch.manual_seed(0)
    score = Hermitian(4, 3, dtype=torch.float64)
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    e = score(q, k)
    h = score.hermitian(q, k)
    assert not e.is_complex() and e.shape == (2, 3, 5)
    for b in range(2):
        ref = torch.tensor(_hermitian_loop(score, q[b], k[b]), dtype=torch.complex128)
        torch.testing.assert_close(h[b], ref, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(e[b], ref.real, atol=1e-12, rtol=1e-12)
    assert h.imag.abs().max() > 1e-3  # the product really is complex


def test_gradients_match_the_real_part_written_out():
    torch.manual_seed(0)
    score = Hermitian(4, 3, dtype=torch.float64)
    q, k = rand(1, 2, 4, seed=1), rand(1, 3, 4, seed=2)
    e = score(q, k)
    ref = (q @ score.W_re.weight.T) @ (k @ score.W_re.weight.T).transpose(-1, -2) + (
        q @ score.W_im.weight.T
    ) @ (k @ score.W_im.weight.T).transpose(-1, -2)
    r = torch.randn(e.shape, dtype=e.dtype)
    params = [q, k, score.W_re.weight, score.W_im.weight]
    got = torch.autograd.grad((e * r).sum(), params)
    want = torch.autograd.grad((ref * r).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_swapping_roles_conjugates():
    """⟨φ(k), φ(q)⟩ = conj⟨φ(q), φ(k)⟩: the real part (the score) is symmetric under the swap and
    the imaginary part antisymmetric; on one sequence against itself, Re E = Re Eᵀ and
    Im E = −Im Eᵀ."""
    torch.manual_seed(0)
    score = Hermitian(4, 6, dtype=torch.float64)
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    forward, swapped = score.hermitian(q, k), score.hermitian(k, q)
    torch.testing.assert_close(swapped, forward.conj().transpose(-1, -2))
    torch.testing.assert_close(score(k, q), score(q, k).transpose(-1, -2))
    self_product = score.hermitian(k, k)
    torch.testing.assert_close(self_product.real, self_product.real.transpose(-1, -2))
    torch.testing.assert_close(self_product.imag, -self_product.imag.transpose(-1, -2))
    assert self_product.imag.abs().max() > 1e-3


def test_dot_form_and_heads():
    torch.manual_seed(0)
    score = Hermitian(4, 3, num_heads=2, dtype=torch.float64)
    q, k = rand(1, 2, 3, 4, seed=1), rand(1, 2, 5, 4, seed=2)
    qp, kp, scale = score.dot_form(q, k)
    torch.testing.assert_close(scale * qp @ kp.transpose(-1, -2), score(q, k))
    for h in range(2):
        alone = Hermitian(4, 3, dtype=torch.float64)
        alone.W_re.weight.data = score.W_re.weight.data[h]
        alone.W_im.weight.data = score.W_im.weight.data[h]
        torch.testing.assert_close(score(q, k)[:, h], alone(q[:, h], k[:, h]))


def test_registered_and_usable_in_multi_head_attention():
    assert isinstance(ak.scores.build("hermitian", d_k=4, d_w=3), Hermitian)
    mha = ak.MultiHeadAttention(8, 2, score="hermitian")
    assert mha(torch.randn(2, 5, 8)).context.shape == (2, 5, 8)


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match=r"q has 3 features .* d_k"):
        Hermitian(4, 3)(torch.randn(1, 2, 3), torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="d_w"):
        Hermitian(4, 0)


# The role-dependent variant: Re Σ_c r_c φ(q)_c conj(φ(k)_c).


def _directed_loop(score, q, k):
    """Σ_c r_c · φ(q_m)_c · conj(φ(k_n)_c) for every (m, n), over Python complex numbers."""
    r = [
        complex(float(a), float(b))
        for a, b in zip(score.r_re.detach(), score.r_im.detach(), strict=True)
    ]
    rows = []
    for qm in q:
        pq = _phi(score, qm)
        rows.append(
            [
                sum(rc * a * b.conjugate() for rc, a, b in zip(r, pq, _phi(score, kn), strict=True))
                for kn in k
            ]
        )
    return rows


def test_directed_scores_are_the_real_part_of_the_weighted_product():
    torch.manual_seed(0)
    score = DirectedHermitian(4, 3, dtype=torch.float64)
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    e, h = score(q, k), score.hermitian(q, k)
    for b in range(2):
        ref = torch.tensor(_directed_loop(score, q[b], k[b]), dtype=torch.complex128)
        torch.testing.assert_close(h[b], ref, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(e[b], ref.real, atol=1e-12, rtol=1e-12)
    # gradients: the dot form against the complex product written out
    r = torch.randn(e.shape, dtype=e.dtype)
    params = [q, k, *score.parameters()]
    got = torch.autograd.grad((e * r).sum(), params)
    want = torch.autograd.grad((score.hermitian(q, k).real * r).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_directed_score_changes_when_the_roles_swap():
    """e(q, k) − e(k, q)ᵀ = −2 Σ_c Im(r_c) Im(φ(q)_c conj(φ(k)_c)): not zero, and zero with
    Im(r) = 0 (then the score is the symmetric Hermitian one)."""
    torch.manual_seed(0)
    score = DirectedHermitian(4, 6, dtype=torch.float64)
    q, k = rand(2, 3, 4, seed=1), rand(2, 5, 4, seed=2)
    gap = score(q, k) - score(k, q).transpose(-1, -2)
    assert gap.abs().max() > 1e-2
    products = score.embed(q).unsqueeze(-2) * score.embed(k).conj().unsqueeze(-3)  # (B, M, N, c)
    torch.testing.assert_close(gap, -2 * (score.r_im * products.imag).sum(-1))
    with torch.no_grad():
        score.r_im.zero_()
        score.r_re.fill_(1.0)
    plain = Hermitian(4, 6, dtype=torch.float64)
    plain.load_state_dict({"W_re.weight": score.W_re.weight, "W_im.weight": score.W_im.weight})
    torch.testing.assert_close(score(q, k), plain(q, k))
    torch.testing.assert_close(score(k, q), score(q, k).transpose(-1, -2))


def test_directed_co_attention_depends_on_which_input_is_first():
    from attnkit.features import ParallelCoAttention

    torch.manual_seed(0)
    score = DirectedHermitian(6, 3).double()
    m = ParallelCoAttention(6, 6, affinity=score, score="max")
    f1, f2 = rand(2, 4, 6, seed=1), rand(2, 5, 6, seed=2)
    assert (m.affinity_matrix(f2, f1) - m.affinity_matrix(f1, f2).mT).abs().max() > 1e-2


def test_direction_task_needs_the_directed_score():
    assert direction_accuracy(DirectedHermitian(V, 8)) == 1.0
    assert direction_accuracy(Hermitian(V, 8)) <= 0.5  # symmetric: one of each pair


def test_directed_heads_dot_form_and_registry():
    torch.manual_seed(0)
    score = DirectedHermitian(4, 3, num_heads=2, dtype=torch.float64)
    q, k = rand(1, 2, 3, 4, seed=1), rand(1, 2, 5, 4, seed=2)
    qp, kp, scale = score.dot_form(q, k)
    torch.testing.assert_close(scale * qp @ kp.transpose(-1, -2), score(q, k))
    for h in range(2):
        alone = DirectedHermitian(4, 3, dtype=torch.float64)
        alone.load_state_dict(
            {
                "W_re.weight": score.W_re.weight[h],
                "W_im.weight": score.W_im.weight[h],
                "r_re": score.r_re[h, 0],
                "r_im": score.r_im[h, 0],
            }
        )
        torch.testing.assert_close(score(q, k)[:, h], alone(q[:, h], k[:, h]))
    assert isinstance(ak.scores.build("directed_hermitian", d_k=4, d_w=3), DirectedHermitian)
    mha = ak.MultiHeadAttention(8, 2, score="directed_hermitian")
    assert mha(torch.randn(2, 5, 8)).context.shape == (2, 5, 8)
