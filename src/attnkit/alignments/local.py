"""Local alignment (Luong et al.; Brauwers eqs. 27-29): softmax inside a window around p."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from attnkit import arguments, inputs
from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, masked_softmax
from attnkit.layers import HeadwiseLinear
from attnkit.sizing import Sizes, build, example_sizes

__all__ = ["Local"]


def _exact(dtype: torch.dtype) -> torch.dtype:
    """A dtype that holds key indices exactly (bfloat16 holds integers only up to 256)."""
    return torch.promote_types(dtype, torch.float32)


@REGISTRY.register("local")
@arguments.renamed(heads="num_heads")
class Local(Alignment):
    """a_l = exp(e_l) / Σ_{j: |j−p| ≤ D} exp(e_j) for |l − p| ≤ D, else 0 (Brauwers eq. 27).

    The window is exactly [p − D, p + D]: for a fractional p (predictive) it holds the keys
    whose index lies in that interval, not 2D+1 keys centred on round(p). Keys outside the
    window get weight 0 and take no part in the normaliser.

    Args:
        window: D ≥ 0, the half-width.
        position: ``"monotonic"`` — p_t = t, the query's position (local-m): by default the row
            index of the scores, or the ``positions`` given to :meth:`forward` (a decoder that
            runs one step at a time passes its step); or ``"predictive"`` —
            p = (S−1)·sigmoid(w_pᵀ tanh(W_p q)) (eq. 28, positions counted from 0), S the number
            of keys the row may attend.
        d_q, d_p: query size and hidden size of the position predictor (predictive only;
            d_p defaults to d_q).
        gaussian: multiply by exp(−(l−p)²/2σ²), σ = D/2 (eq. 29), which makes p trainable.
            Defaults to True for predictive and False for monotonic (Luong's local-p and
            local-m). With the Gaussian the weights no longer sum to 1.
        num_heads: one position predictor per head.

    A window that crosses an end of the sequence keeps the keys inside it (Luong et al.).
    """

    position_based: ClassVar[bool] = True
    label = tx.AlignmentKind.LOCAL

    @classmethod
    def for_heads(
        cls,
        head_dim: int,
        num_heads: int | None = None,
        *,
        embed_dim: int | None = None,
        max_len: int | None = None,
        **overrides: Any,
    ) -> Local:
        """Luong's predictive local alignment (eq. 28) with a half-window of 2, its predictor
        reading queries of ``head_dim`` features, one per head; ``overrides`` replace any of
        these (``position="monotonic"`` takes no query size)."""
        args = {"window": 2, "position": "predictive"} | overrides
        if args["position"] == "predictive":
            args = {"d_q": head_dim, "num_heads": num_heads} | args
        sizes = Sizes(head_dim=head_dim, num_heads=num_heads, embed_dim=embed_dim, max_len=max_len)
        return build(cls, sizes, args)

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Alignment]:
        """Half-window 1: monotonic (p_t = t), with a Gaussian, and predictive (d_p = 3)."""
        s = example_sizes(cls.example_sizes, **sizes).for_heads()
        return {
            "": cls.for_heads(**s, window=1, position="monotonic"),
            "gaussian": cls.for_heads(**s, window=1, position="monotonic", gaussian=True),
            "predictive": cls.for_heads(**s, window=1, d_p=3),
        }

    @classmethod
    def example(cls, **sizes: int | None) -> Alignment:
        return cls.examples(**sizes)[""]

    def __init__(
        self,
        window: int,
        position: Literal["monotonic", "predictive"] = "monotonic",
        *,
        d_q: int | None = None,
        d_p: int | None = None,
        gaussian: bool | None = None,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an int >= 0, got {window!r}")
        if position not in ("monotonic", "predictive"):
            raise ValueError(f"position must be 'monotonic' or 'predictive', got {position!r}")
        if position == "predictive" and d_q is None:
            raise TypeError("Local(position='predictive') needs d_q, the query size (eq. 28)")
        if position == "predictive":
            arguments.positive_int(d_q, "d_q")
            arguments.optional_positive_int(d_p, "d_p")
        elif d_q is not None or d_p is not None:
            raise TypeError("d_q and d_p are for position='predictive' (eq. 28) only")
        if gaussian is not None and not isinstance(gaussian, bool):
            raise TypeError(f"gaussian must be a bool or None, got {gaussian!r}")
        self.window, self.position = window, position
        self.query_position_based = position == "monotonic"  # type: ignore[misc]  # p_t = t
        self.gaussian = (position == "predictive") if gaussian is None else gaussian
        if self.gaussian and window == 0:
            raise ValueError("gaussian local alignment needs window >= 1 (σ = window/2)")
        self.normalized = not self.gaussian
        # A step-by-step decoder reads this to pass its step as p_t (monotonic form only).
        self.takes_positions = position == "monotonic"
        if position == "predictive":
            assert d_q is not None
            d_p = d_q if d_p is None else d_p
            kw = {"num_heads": num_heads, "device": device, "dtype": dtype}
            self.W_p = HeadwiseLinear(d_q, d_p, bias=False, **kw)
            self.w_p = HeadwiseLinear(d_p, 1, bias=False, **kw)

    def _given(self, positions: Tensor | int, scores: Tensor) -> Tensor:
        """Validated query positions as (…, M, 1) in the scores' dtype."""
        rows = tuple(scores.shape[:-1])
        if isinstance(positions, bool) or not isinstance(positions, (int, Tensor)):
            raise TypeError(
                f"positions must be an int or an integer tensor (…, M), got {positions!r}"
            )
        if isinstance(positions, int):
            positions = torch.tensor(positions, device=scores.device)
        if (
            positions.dtype.is_floating_point
            or positions.dtype.is_complex
            or (positions.dtype == torch.bool)
        ):
            raise TypeError(f"positions must be an integer tensor, got dtype {positions.dtype}")
        if positions.device != scores.device:
            raise ValueError(
                f"positions is on {positions.device} but the scores are on {scores.device}"
            )
        if not inputs.broadcasts_to(positions.shape, rows):
            raise ValueError(
                f"positions of shape {tuple(positions.shape)} does not broadcast to the query "
                f"rows (…, M) = {rows} of scores {tuple(scores.shape)}"
            )
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
        return positions.to(_exact(scores.dtype)).unsqueeze(-1)

    def positions(
        self,
        scores: Tensor,
        mask: Tensor | None,
        query: Tensor | None,
        given: Tensor | int | None = None,
    ) -> Tensor:
        """p for every row: (…, M, 1)."""
        if self.position == "monotonic":
            if given is not None:
                return self._given(given, scores)
            m = scores.shape[-2]
            return torch.arange(m, device=scores.device, dtype=_exact(scores.dtype)).unsqueeze(-1)
        if given is not None:
            raise ValueError(
                "positions= is for monotonic local alignment (p_t = t); predictive local "
                "alignment computes p from the query (eq. 28)"
            )
        if query is None:
            raise ValueError("predictive local alignment needs the query (eq. 28); got query=None")
        w = self.W_p.weight
        if not isinstance(query, Tensor) or query.shape[-1] != w.shape[-1]:
            shape = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
            raise ValueError(
                f"query must be (…, M, d_q) with d_q = {w.shape[-1]} (eq. 28), got {shape}"
            )
        if query.dtype != w.dtype or query.device != w.device:
            raise TypeError(
                f"query is {query.dtype} on {query.device} but the local alignment's position "
                f"predictor is {w.dtype} on {w.device}; convert one of them (alignment.to(...))"
            )
        if mask is None:
            s = torch.tensor(float(scores.shape[-1]), dtype=scores.dtype, device=scores.device)
        else:
            s = mask.sum(dim=-1, keepdim=True).to(scores.dtype)
        gate = torch.sigmoid(self.w_p(torch.tanh(self.W_p(query))))  # (…, M, 1)
        return (s - 1).clamp_min(0) * gate

    def forward(
        self,
        scores: Tensor,
        mask: Tensor | None = None,
        *,
        query: Tensor | None = None,
        positions: Tensor | int | None = None,
    ) -> AlignOutput:
        """Weights (…, M, N) from scores (…, M, N).

        Args:
            scores: (…, M, N).
            mask: boolean, broadcastable to (…, M, N), True = may attend.
            query: (…, M, d_q), needed by the predictive form (eq. 28).
            positions: monotonic form only: p_t for every query row, an int or an integer
                tensor broadcastable to (…, M); default the row index 0 … M−1.
        """
        # A window that crosses the sequence's ends keeps only the keys inside it (Luong et al.:
        # "we simply ignore the outside part").
        scores = inputs.alignment_inputs(self, scores, mask)
        n = scores.shape[-1]
        p = self.positions(scores, mask, query, positions)
        offset = torch.arange(n, device=scores.device, dtype=p.dtype) - p  # l − p
        inside = offset.detach().abs() <= self.window  # l ∈ [p − D, p + D] (eq. 27)
        allowed = inside if mask is None else inside & mask
        weights = masked_softmax(scores, allowed)
        if self.gaussian:
            sigma = self.window / 2.0
            weights = weights * torch.exp(-(offset**2) / (2 * sigma**2)).to(weights.dtype)  # eq. 29
        return AlignOutput(weights)
