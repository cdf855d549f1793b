"""The score-function interface (Brauwers eq. 23: e_l = score(q, k_l)) and its registry."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import inputs
from attnkit import taxonomy as tx
from attnkit.inputs import broadcast_shapes
from attnkit.registry import Registry
from attnkit.sizing import Sized

__all__ = ["REGISTRY", "Score", "check_heads", "expect_features"]

REGISTRY: Registry[Score] = Registry("score")


def expect_features(x: Tensor, d: int, name: str, what: str) -> None:
    """Raise ValueError unless the last dimension of ``x`` is ``d``."""
    if x.shape[-1] != d:
        raise ValueError(
            f"{name} has {x.shape[-1]} features (shape {tuple(x.shape)}) but this score "
            f"expects {what} = {d}"
        )


def check_heads(score: Score, q: Tensor | None, k: Tensor) -> None:
    """Raise unless q and k carry the score's head dim at -3 after a batch dim (a per-head
    score given (B, M, d) would otherwise read the batch as heads)."""
    h = score.num_heads
    if h is None:
        return
    for name, x in (("q", q), ("k", k)):
        if x is None or (name == "q" and score.query_free):
            continue
        if x.dim() < 4 or x.shape[-3] != h:
            raise ValueError(
                f"the {type(score).__name__} score was built with num_heads={h}: {name} must be "
                f"(B, …, H, L, d) with H = {h} at dim -3 after a batch dim, got shape "
                f"{tuple(x.shape)}"
            )


class Score(Sized, nn.Module):
    """A score function: maps q (…, M, d_q) and k (…, N, d_k) to scores (…, M, N).

    Multi-dimensional scores (Brauwers eq. 31) return (…, M, N, d_out) instead.

    Every score is split in three steps so that kernels can evaluate it block by block without
    repeating per-query or per-key work (Bahdanau's precomputation of W_2 k, Galassi IV-B):

    - ``project_query(q)`` -> per-query state (or None for query-free scores),
    - ``project_key(k)`` -> per-key state,
    - ``pairwise(qp, kp, key_offset)`` -> scores for those queries and keys; ``key_offset`` is
      the position of ``kp``'s first key, for position-based scores.

    Capabilities, read by kernels and tests:

    - ``content_based``: scores depend on key content only (permuting keys permutes scores).
    - ``mixes_keys``: a key's score also depends on its neighbours' content. Masking the scores
      afterwards would let a query read, through an allowed key, keys it may not attend, so such
      a score takes the mask itself: ``forward(q, k, keep=mask)`` calls ``masked``, which must
      not read a key that a row may not attend (the dense kernel passes it; the chunked kernel
      refuses such a score with a mask). Masking a key is still not the same as removing it.
    - ``dot_product_form``: ``dot_form(q, k)`` gives (q', k', scale) with score = scale·q'ᵀk',
      so SDPA can evaluate it.
    - ``compile_tile``: the chunked kernel may compile ``pairwise`` for its tiles.
    - ``query_free``: the query's content is ignored (self-attentive scores, eq. 33–34); ``q``
      may be None, and the scores then have M = 1.
    - ``num_heads``: H (as given to the constructor) when the score holds one parameter set
      per head, None otherwise; its inputs are then (B, …, H, L, d), the head dim at -3 with
      at least one batch dim before it. A score of one's own that holds per-head parameters
      sets ``self.num_heads`` so that its inputs are checked.

    Built at given sizes by ``for_heads(head_dim, num_heads, *, max_len=None, **overrides)``
    (:class:`attnkit.sizing.Sized`): q and k of ``head_dim`` features, one parameter set per
    head when ``num_heads`` is given. A score says which constructor argument takes which size
    in ``size_arguments`` (e.g. ``{"d_q": "head_dim", "d_k": "head_dim", "d_w": "head_dim",
    "num_heads": "num_heads"}``); a score without parameters needs nothing. ``example()`` and
    ``examples()`` give the small instances the contract tests run.
    """

    part_kind: ClassVar[str] = "score"

    scoring: ClassVar[tx.Scoring]
    content_based: ClassVar[bool] = True
    mixes_keys: ClassVar[bool] = False
    dot_product_form: ClassVar[bool] = False
    query_free: bool = False
    d_out: int | None = None
    # The chunked kernel may compile ``pairwise`` (torch.compile) for its tiles: worth it for
    # scores whose tile is elementwise work over (M_b, N_b, d_w), bound by memory traffic.
    compile_tile: ClassVar[bool] = False
    num_heads: int | None = None

    @property
    def multi_dimensional(self) -> bool:
        return self.d_out is not None

    def taxonomy_tags(self) -> list:
        """Scoring (Table II row), dimensionality, and self-attentive when query-free."""
        tags: list = [self.scoring]
        if self.multi_dimensional:
            tags.append(tx.Dimensionality.MULTI)
        if self.query_free:
            tags.append(tx.QueryType.SELF_ATTENTIVE)
        return tags

    def check(self, q: Tensor | None, k: Tensor) -> None:
        """Validate feature sizes; raise ValueError naming the argument. Override as needed."""

    def project_query(self, q: Tensor | None) -> Tensor | None:
        return q

    def project_key(self, k: Tensor) -> Tensor:
        return k

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        raise NotImplementedError

    def dot_form(self, q: Tensor | None, k: Tensor) -> tuple[Tensor, Tensor, float]:
        raise NotImplementedError(f"{type(self).__name__} is not in dot-product form")

    def masked(self, q: Tensor | None, k: Tensor, keep: Tensor) -> Tensor:
        """Scores under the mask ``keep`` (True = may attend, broadcastable to (…, M, N)) in
        which no row reads a key it may not attend; required of ``mixes_keys`` scores."""
        raise NotImplementedError(f"{type(self).__name__} does not take a mask")

    def forward(self, q: Tensor | None, k: Tensor, *, keep: Tensor | None = None) -> Tensor:
        """Scores (…, M, N) [(…, M, N, d_out) multi-dimensional] from q (…, M, d_q), or None
        for query-free scores, and k (…, N, d_k).

        ``keep`` (boolean, True = may attend, broadcastable to (…, M, N)) is for scores that
        mix neighbouring keys (``mixes_keys``): each row is then scored without reading the
        keys it may not attend. Other scores do not take it: their scores are masked after."""
        if q is None and not self.query_free:
            raise ValueError(
                f"{type(self).__name__} needs a query; q=None is only for query-free "
                "(self-attentive) scores"
            )
        if q is not None:
            inputs.tensor(q, "q")
        inputs.tensor(k, "k")
        if not self.query_free:  # a query-free score reads only q's number of rows
            inputs.same_kind(("q", q), ("k", k))
        inputs.part_matches(self, "score", "k", k)
        check_heads(self, q, k)
        self.check(q, k)
        if keep is None:
            e = self.pairwise(self.project_query(q), self.project_key(k))
        elif not self.mixes_keys:
            raise TypeError(
                f"keep= is for scores that mix neighbouring keys; {type(self).__name__} scores "
                "each key alone, so mask its scores instead"
            )
        else:
            if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
                raise TypeError(f"keep must be a boolean tensor, got {keep!r:.80}")
            e = self.masked(q, k, keep)
        if q is not None and self.query_free:
            # A constant query scores every query row alike (Brauwers eq. 33-34): repeat the row.
            tail = 2 if self.d_out is None else 3
            lead = broadcast_shapes(e.shape[:-tail], q.shape[:-2])
            e = e.expand(*lead, q.shape[-2], *e.shape[e.dim() - tail + 1 :])
        return e
