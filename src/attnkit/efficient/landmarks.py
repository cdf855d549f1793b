"""The shared core of the low-rank and landmark mechanisms (Linformer, Nyströmformer, SOFT,
Skyformer; Soydaner 5.3): padding masks split into query and key padding, landmarks as segment
means, the iterative Moore-Penrose pseudo-inverse, and the three-factor Nyström product.

Nyström approximation (Xiong et al. 2021): a matrix S (M × N) whose rows and
columns are indexed by queries and keys is approximated from m landmark queries q̃ and keys k̃ by

    Ŝ = F A⁺ B,   F = κ(Q, K̃) (M × m),   A = κ(Q̃, K̃) (m × m),   B = κ(Q̃, K) (m × N),

so that Ŝ V = F (A⁺ (B V)) costs O((M + N)·m·d + m³). When the landmarks are all the tokens
(K̃ = K, Q̃ = Q) the approximation is exact: Ŝ = S S⁺ S = S.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, hooks, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment, AlignOutput
from attnkit.head import HeadAttention
from attnkit.inputs import broadcast_shapes
from attnkit.output import AttentionOutput

__all__ = [
    "GaussianKernel",
    "LandmarkAttention",
    "iterative_pinv",
    "landmark_attention",
    "newton_pinv",
    "padding_masks",
    "segment_means",
]


class GaussianKernel(Alignment):
    """The Gaussian kernel as an alignment: scores e_ij = −‖q_i − k_j‖² / (2√d) give weights
    a_ij = exp(e_ij) (SOFT; Skyformer), not normalised over the keys; masked keys
    get 0."""

    label = tx.AlignmentKind.SOFT
    normalized = False

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        w = torch.exp(scores if mask is None else torch.where(mask, scores, -torch.inf))
        return AlignOutput(w)


def gaussian_scores(x: Tensor, y: Tensor) -> Tensor:
    """−‖x_i − y_j‖² / (2√d) (…, M, N) for x (…, M, d), y (…, N, d), clamped at 0 from above
    (the expansion ‖x‖² + ‖y‖² − 2x·y can round a little above 0)."""
    sq = (x * x).sum(-1, keepdim=True) + (y * y).sum(-1).unsqueeze(-2) - 2 * x @ y.transpose(-1, -2)
    return (-sq / (2 * x.shape[-1] ** 0.5)).clamp_max(0)


def padding_masks(
    mask: Tensor | None, shape: torch.Size, who: str
) -> tuple[Tensor | None, Tensor | None]:
    """Split a boolean mask broadcastable to ``shape`` (…, M, N) into query padding (…, M, 1)
    and key padding (…, 1, N), or raise a ValueError when it is not of that form.

    A mask is a padding mask when mask_ij = query_i ∧ key_j: each query row is either all False
    (a padded query, which attends nothing) or the same set of keys. Such masks the landmark
    mechanisms honour: padded keys and queries are left out of every landmark and sum. Any other
    mask (causal, windows) would need a different landmark set per query and is refused.
    """
    if mask is None:
        return None, None
    masks.check(mask, shape)
    if mask.dim() < 2 or mask.shape[-2] == 1:  # key padding: never form (…, M, N)
        key = mask if mask.dim() >= 2 else mask.unsqueeze(0)
        return key.any(-1, keepdim=True), key
    rows = mask.broadcast_to(shape)
    key = rows.any(-2, keepdim=True)
    query = rows.any(-1, keepdim=True)
    if not torch.equal(rows, key & query):
        raise ValueError(
            f"{who}: the mask (shape {tuple(mask.shape)}) is not a padding mask: its landmarks "
            "and projections are shared by all queries, so it honours only masks whose rows "
            "are either all False (a padded query) or the same keys (key padding (…, 1, N)); "
            "causal and other per-query masks are not supported"
        )
    return query, key


def segment_means(x: Tensor, m: int, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """m landmarks of x (…, L, d) as means of consecutive segments (Nyströmformer).

    The real rows (``keep`` (…, L, 1), True = real; all when None) are split in order: the r-th
    of L' real rows goes to segment ⌊r·m / L'⌋, so that with L' divisible by m each segment has
    L'/m rows (the paper's segment means), with m = L' each landmark is one token, and padding
    equals truncation. With L' < m some segments are empty.

    Returns:
        landmarks (…, m, d) (0 where empty) and ``present`` (…, m, 1), True where non-empty.
    """
    n = x.shape[-2]
    if keep is None and n % m == 0:  # segments of n/m rows: a mean over a reshape
        present = torch.ones(m, 1, dtype=torch.bool, device=x.device)
        return x.unflatten(-2, (m, n // m)).mean(-2), present
    if keep is None:
        keep = torch.ones(n, 1, dtype=torch.bool, device=x.device)
    keep = keep.broadcast_to(*keep.shape[:-2], n, 1)
    rank = keep.long().cumsum(-2) - 1  # (…, L, 1)
    real = keep.sum(-2, keepdim=True)  # (…, 1, 1)
    segment = torch.div(rank * m, real.clamp_min(1), rounding_mode="floor")
    ids = torch.arange(m, device=x.device)
    member = keep & (segment == ids)  # (…, L, m)
    count = member.sum(-2).unsqueeze(-1)  # (…, m, 1)
    clean = torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
    sums = member.to(x.dtype).transpose(-1, -2) @ clean
    present = count > 0
    return sums / count.clamp_min(1).to(x.dtype), present


def iterative_pinv(a: Tensor, iterations: int = 6) -> Tensor:
    """The Moore-Penrose pseudo-inverse of a (…, m, m) by Nyströmformer's iteration (after
    Razavi et al. 2014): Z₀ = Aᵀ / (‖A‖₁ ‖A‖_∞) and

        Z_{j+1} = ¼ Z_j (13 I − A Z_j (15 I − A Z_j (7 I − A Z_j))).

    ‖A‖₂² ≤ ‖A‖₁‖A‖_∞, so every singular value x of A Z₀ lies in (0, 1]; the iteration drives
    them all to 1 (for small x it multiplies x by 13/4; near 1 it converges with order 3,
    1 − x ↦ ¾(1 − x)³ + ¼(1 − x)⁴), and Z_j stays in the row space of Aᵀ, so it converges to
    A⁺, also for a singular A. Six iterations suffice for a softmax kernel matrix (the paper);
    use more for exactness.

    Caveat: x = 0 is an unstable fixed point, so for a numerically singular A the rounding
    errors in its null space also grow by 13/4 per step and, after ~30 steps, swamp the result;
    exact zero rows and columns (the masked landmarks here) stay exactly zero.
    """
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    z = _initial_inverse(a)
    for _ in range(iterations):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def newton_pinv(a: Tensor, iterations: int = 20) -> Tensor:
    """The Moore-Penrose pseudo-inverse of a (…, m, m) by the Newton-Schulz iteration that SOFT
    uses (Lu et al. 2021; Ben-Israel and Cohen 1966): Z₀ = Aᵀ / (‖A‖₁ ‖A‖_∞),
    Z_{j+1} = 2 Z_j − Z_j A Z_j. Each singular value x of A Z goes to 2x − x² (quadratic
    convergence near 1); the caveat of :func:`iterative_pinv` about numerically singular A
    applies (the growth factor is 2)."""
    z = _initial_inverse(a)
    for _ in range(iterations):
        z = 2 * z - z @ a @ z
    return z


def _initial_inverse(a: Tensor) -> Tensor:
    col = a.abs().sum(-2).amax(-1)[..., None, None]
    row = a.abs().sum(-1).amax(-1)[..., None, None]
    scale = col * row
    return a.transpose(-1, -2) / torch.where(scale > 0, scale, 1)


def working_dtype(x: Tensor) -> torch.dtype:
    """At least float32: the pseudo-inverse iteration loses everything in bfloat16/float16."""
    return torch.promote_types(x.dtype, torch.float32)


def zero_rows(x: Tensor, keep: Tensor | None) -> Tensor:
    """x with the rows where ``keep`` (…, L, 1) is False set to 0."""
    return x if keep is None else torch.where(keep, x, torch.zeros((), dtype=x.dtype))


def _both(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    if a is None or b is None:
        return b if a is None else a
    return a & b


Landmarks = Callable[[Tensor, Tensor, Tensor | None, Tensor | None], tuple[Tensor, ...]]


def landmark_attention(
    part: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    bias: Tensor | None,
    need_weights: bool,
    score: Callable[[Tensor, Tensor], Tensor],
    landmarks: Landmarks,
) -> AttentionOutput:
    """The Nyström product Ŝ V = F (A⁺ (B V)) with F = align(score(Q, K̃)), A = align(score(Q̃,
    K̃)), B = align(score(Q̃, K)) (``part.align``; Xiong et al.), A⁺ by
    ``part.pseudo_inverse(A)``.

    ``landmarks(q, k, query_keep (…, M, 1), key_keep (…, N, 1))`` returns (Q̃, present_q, K̃,
    present_k), present (…, m, 1). Padded queries and keys and empty landmarks are masked out of
    every factor; computed in at least float32 and returned in the inputs' dtype.

    The body of :meth:`LandmarkAttention.attend`: the inputs are those of the template
    :meth:`attnkit.HeadAttention.forward` (validated, no bias, a key or padding mask, padded
    keys holding zeros), which also reports the weights.

    Returns:
        AttentionOutput: the context; with ``need_weights=True`` the weights, the dense
        approximation F A⁺ B (…, M, N), whose entries may be negative (A⁺ is a pseudo-inverse)
        and whose rows need not sum to 1; and always the two non-negative factors by name in
        ``extra``: ``to_landmarks`` F (…, M, m) and ``from_landmarks`` B (…, m, N).
    """
    who = type(part).__name__
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    m, n = q.shape[-2], k.shape[-2]
    query_keep, key_row = padding_masks(mask, torch.Size((*lead, m, n)), who)
    key_keep = None if key_row is None else key_row.transpose(-1, -2)
    dtype, work = q.dtype, working_dtype(q)
    # padded keys hold zeros already (the template); padded queries are zeroed here, so that
    # they reach no query landmark
    q = zero_rows(q.to(work), query_keep).broadcast_to(*lead, m, q.shape[-1])
    k = k.to(work).broadcast_to(*lead, n, k.shape[-1])
    v = v.to(work)
    ql, q_present, kl, k_present = landmarks(q, k, query_keep, key_keep)
    # every landmark non-empty (the usual case): no mask to apply to the factors
    q_present = None if bool(q_present.all()) else q_present
    kp = None if bool(k_present.all()) else k_present.transpose(-1, -2)
    f = part.align(score(q, kl), _both(query_keep, kp)).weights
    a = part.align(score(ql, kl), _both(q_present, kp)).weights
    b = part.align(score(ql, k), _both(q_present, key_row)).weights
    z = part.pseudo_inverse(a)
    context = f @ (z @ (b @ v))
    dense = None
    if need_weights:
        dense = (f @ z @ b).to(dtype)
    f, b = f.to(dtype), b.to(dtype)
    hooks.report(part, f, "to_landmarks")
    hooks.report(part, b, "from_landmarks")
    factors = {"to_landmarks": f, "from_landmarks": b}
    return AttentionOutput(context.to(dtype), dense, extra=factors)


class LandmarkAttention(HeadAttention):
    """The per-head part shared by the three-factor landmark mechanisms (Nyströmformer, SOFT,
    Skyformer): ``part(q, k, v, *, mask, bias, need_weights)`` with q (B, …, M, d), k (B, …, N, d),
    v (B, …, N, d_v) → context (B, …, M, d_v), computed by :func:`landmark_attention`.

    A mechanism says what differs: its factor ``score(x, y)``, its alignment ``align`` (applied
    to each factor), its :meth:`pseudo_inverse` and, if not segment means of the queries and of
    the keys apart, its :meth:`landmarks`.

    Masks: padding masks only (see :func:`padding_masks`). The query landmarks are computed from
    all real queries, so a padded query must be named as one — by an all-False row of a
    (…, M, N) mask — or it counts as real. Inside :class:`attnkit.MultiHeadAttention`
    self-attention does this for a key-padding mask (…, 1, N): the part declares
    ``mixes_queries = True`` (a query's result depends on the other queries), and a token that
    no query may attend is then padding as a query too, so that padding equals truncation.

    Args:
        num_landmarks: m, the number of landmarks.
        iterations: steps of the pseudo-inverse iteration.
        align: the alignment applied to each factor's scores.
    """

    # capabilities (attnkit.head.HeadAttention)
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding"})

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    mixes_queries: ClassVar[bool] = True

    def __init__(self, num_landmarks: int, iterations: int, align: Alignment) -> None:
        super().__init__()
        self.num_landmarks = arguments.positive_int(num_landmarks, "num_landmarks")
        self.iterations = arguments.positive_int(iterations, "iterations")
        self.align = align

    def extra_repr(self) -> str:
        return f"num_landmarks={self.num_landmarks}, iterations={self.iterations}"

    @staticmethod
    def score(x: Tensor, y: Tensor) -> Tensor:
        """The factor's scores between rows of x (…, P, d) and y (…, R, d): (…, P, R)."""
        raise NotImplementedError

    def pseudo_inverse(self, a: Tensor) -> Tensor:
        """Z ≈ A⁺ by ``iterations`` steps of the paper's iteration (Nyströmformer's, by default)."""
        return iterative_pinv(a, self.iterations)

    def landmarks(
        self, q: Tensor, k: Tensor, query_keep: Tensor | None, key_keep: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Segment means of the real queries and keys: (Q̃, present, K̃, present)."""
        return (
            *segment_means(q, self.num_landmarks, query_keep),
            *segment_means(k, self.num_landmarks, key_keep),
        )

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:
        return landmark_attention(
            self,
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            need_weights=need_weights,
            score=self.score,
            landmarks=self.landmarks,
        )
