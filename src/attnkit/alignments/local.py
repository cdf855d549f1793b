"""Local alignment (Luong et al.; Brauwers eqs. 27-29): softmax inside a window around p."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from torch import Tensor

from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, masked_softmax
from attnkit.layers import HeadwiseLinear

__all__ = ["Local"]


@REGISTRY.register("local")
class Local(Alignment):
    """a_l = exp(e_l) / Σ_{j=p−D}^{p+D} exp(e_j) for |l − p| ≤ D, else 0 (eq. 27).

    Args:
        window: D ≥ 0, the half-width; the window holds 2D+1 keys, centred on round(p).
        position: ``"monotonic"`` — p = m, the query's own index (row of the scores); or
            ``"predictive"`` — p = (S−1)·sigmoid(w_pᵀ tanh(W_p q)) (eq. 28, positions counted
            from 0), S the number of keys the row may attend.
        d_q, d_p: query size and hidden size of the position predictor (predictive only;
            d_p defaults to d_q).
        gaussian: multiply by exp(−(l−p)²/2σ²), σ = D/2 (eq. 29), which makes p trainable.
            Defaults to True for predictive and False for monotonic (Luong's local-p and
            local-m). With the Gaussian the weights no longer sum to 1.
        heads: one position predictor per head.

    A sequence shorter than the window (N < 2D+1) is rejected.
    """

    position_based: ClassVar[bool] = True
    label = tx.Alignment.LOCAL

    def __init__(
        self,
        window: int,
        position: Literal["monotonic", "predictive"] = "monotonic",
        *,
        d_q: int | None = None,
        d_p: int | None = None,
        gaussian: bool | None = None,
        heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an int >= 0, got {window!r}")
        if position not in ("monotonic", "predictive"):
            raise ValueError(f"position must be 'monotonic' or 'predictive', got {position!r}")
        if position == "predictive" and d_q is None:
            raise TypeError("Local(position='predictive') needs d_q, the query size (eq. 28)")
        self.window, self.position = window, position
        self.gaussian = (position == "predictive") if gaussian is None else gaussian
        if self.gaussian and window == 0:
            raise ValueError("gaussian local alignment needs window >= 1 (σ = window/2)")
        self.normalized = not self.gaussian
        if position == "predictive":
            assert d_q is not None
            d_p = d_q if d_p is None else d_p
            kw = {"heads": heads, "device": device, "dtype": dtype}
            self.W_p = HeadwiseLinear(d_q, d_p, bias=False, **kw)
            self.w_p = HeadwiseLinear(d_p, 1, bias=False, **kw)

    def positions(self, scores: Tensor, mask: Tensor | None, query: Tensor | None) -> Tensor:
        """p for every row: (…, M, 1)."""
        m = scores.shape[-2]
        if self.position == "monotonic":
            return torch.arange(m, device=scores.device, dtype=scores.dtype).unsqueeze(-1)
        if query is None:
            raise ValueError("predictive local alignment needs the query (eq. 28); got query=None")
        if mask is None:
            s = torch.tensor(float(scores.shape[-1]), dtype=scores.dtype, device=scores.device)
        else:
            s = mask.sum(dim=-1, keepdim=True).to(scores.dtype)
        gate = torch.sigmoid(self.w_p(torch.tanh(self.W_p(query))))  # (…, M, 1)
        return (s - 1).clamp_min(0) * gate

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        n = scores.shape[-1]
        if 2 * self.window + 1 > n:
            raise ValueError(
                f"local window of 2·{self.window}+1 = {2 * self.window + 1} keys is larger than "
                f"the sequence: scores have N = {n} (shape {tuple(scores.shape)})"
            )
        p = self.positions(scores, mask, query)
        offset = torch.arange(n, device=scores.device, dtype=scores.dtype) - p  # l − p
        inside = (torch.arange(n, device=scores.device) - torch.round(p.detach())).abs()
        inside = inside <= self.window
        allowed = inside if mask is None else inside & mask
        weights = masked_softmax(scores, allowed)
        if self.gaussian:
            sigma = self.window / 2.0
            weights = weights * torch.exp(-(offset**2) / (2 * sigma**2))
        return AlignOutput(weights)
