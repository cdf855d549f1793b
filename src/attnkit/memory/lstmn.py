"""The long short-term memory-network (Cheng, Dong and Lapata 2016, "Long Short-Term
Memory-Networks for Machine Reading", Sec. 3.2; Soydaner Sec. 3; Galassi on intra-attention).

An LSTM whose single memory cell is replaced by a tape of all earlier states: at step t,
intra-attention over the tape chooses what to remember,

    a_i^t = vᵀ tanh(W_h h_i + W_x x_t + W_h̃ h̃_{t−1}),  s^t = softmax(a^t)  (i < t; eqs. 5-6)
    [h̃_t; c̃_t] = Σ_i s_i^t [h_i; c_i]                                      (eq. 7)

and the LSTM update reads the adaptive summary instead of the previous state:
[i; f; o; ĉ] = [σ; σ; σ; tanh](W [h̃_t; x_t] + b), c_t = f ⊙ c̃_t + i ⊙ ĉ, h_t = o ⊙ tanh(c_t)
(eqs. 8-10). At t = 1 the tape is empty and h̃ = c̃ = 0.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, hooks
from attnkit import taxonomy as tx
from attnkit.checks import resolve_alignment
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["LSTMN", "LSTMNOutput"]


class LSTMNOutput(NamedTuple):
    """hidden states h (B, n, d_h), memory cells c (B, n, d_h), intra-attention weights s
    (B, n, n): row t over the earlier steps i < t (zero elsewhere)."""

    hidden: Tensor
    cells: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        """The hidden state at every step (B, n, d_h)."""
        return self.hidden

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("lstmn")
class LSTMN(nn.Module):
    """Long short-term memory-network: an LSTM with intra-attention over its history.

    Args:
        d_x: input size; d_h: hidden size; d_w: size of the attention's hidden layer.
        align: the alignment over the tape (default softmax, eq. 6).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        d_x: int,
        d_h: int,
        d_w: int | None = None,
        *,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        d_w = d_h if d_w is None else d_w
        arguments.sizes(d_x=d_x, d_h=d_h, d_w=d_w)
        kw = {"device": device, "dtype": dtype}
        self.d_x, self.d_h = d_x, d_h
        self.W_h = nn.Linear(d_h, d_w, bias=False, **kw)
        self.W_x = nn.Linear(d_x, d_w, bias=False, **kw)
        self.W_summary = nn.Linear(d_h, d_w, **kw)  # W_h̃, with the hidden layer's bias
        self.v = nn.Linear(d_w, 1, bias=False, **kw)
        self.gates = nn.Linear(d_h + d_x, 4 * d_h, **kw)  # W, b of eq. 8
        self.align = resolve_alignment(align, device=device, dtype=dtype)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(x (2, 4, 3), d_h = 4, a mask)."""
        from attnkit import masks

        mask = masks.from_lengths(torch.tensor([4, 2]), 4)
        return cls(3, 4, 5), (example_tensor(2, 4, 3),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.ADDITIVE, tx.QueryType.SELF_ATTENTIVE]

    def forward(self, x: Tensor, mask: Tensor | None = None) -> LSTMNOutput:
        """x (B, n, d_x); mask (B, n) or (B, 1, n), True = a real step (padding at the end)."""
        x = checks.features(x, "x", self.d_x, what="d_x")
        mask = checks.feature_mask(mask, x, "mask", "x")
        x = checks.without_padding(x, mask)
        b, n = x.shape[:2]
        summary_h = x.new_zeros(b, self.d_h)
        summary_c = x.new_zeros(b, self.d_h)
        hs: list[Tensor] = []
        cs: list[Tensor] = []
        keys: list[Tensor] = []  # W_h h_i, once per step
        rows = []
        projected_x = self.W_x(x)
        for t in range(n):
            row = x.new_zeros(b, n)
            if t > 0:
                hidden = torch.stack(keys, 1) + (
                    projected_x[:, t] + self.W_summary(summary_h)
                ).unsqueeze(1)
                scores = self.v(torch.tanh(hidden)).squeeze(-1)  # eq. 5, (B, t)
                key_mask = None if mask is None else mask[:, :t].unsqueeze(-2)
                s = self.align(scores.unsqueeze(-2), key_mask).weights.squeeze(-2)  # eq. 6
                summary_h = (s.unsqueeze(-1) * torch.stack(hs, 1)).sum(1)  # eq. 7
                summary_c = (s.unsqueeze(-1) * torch.stack(cs, 1)).sum(1)
                row = torch.cat([s, x.new_zeros(b, n - t)], -1)
            hooks.report(self, row)
            i, f, o, g = self.gates(torch.cat([summary_h, x[:, t]], -1)).chunk(4, -1)  # eq. 8
            c = torch.sigmoid(f) * summary_c + torch.sigmoid(i) * torch.tanh(g)  # eq. 9
            h = torch.sigmoid(o) * torch.tanh(c)  # eq. 10
            hs.append(h)
            cs.append(c)
            keys.append(self.W_h(h))
            rows.append(row)
        return LSTMNOutput(torch.stack(hs, 1), torch.stack(cs, 1), torch.stack(rows, 1))
