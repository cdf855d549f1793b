"""Truncated history-attention (Li, Bing, Li, Lam and Yang, IJCAI 2018; Galassi IV-A, [120]):
attention iterated over a sequence of steps, in which the context vectors of the previous steps
act as the query.

Galassi IV-A: "Their truncated history-attention model iterates the computation of attention on
top of a bi-LSTM. At each step, the bi-LSTM hidden states are used as keys and values, while the
context vectors computed in the previous steps act as a query." With keys K, values V (the encoder
states), the step inputs x_t and a history of T steps:

    q_t = [x_t ; c_{t−1} ; … ; c_{t−T}]          (c_s = 0 for s < 1: the truncated history)
    a_t = align(score(q_t, K)),   c_t = Σ_i a_{t,i} v_i     (Galassi eqs. 4, 8-9)

for t = 1 … S, in order (c_t needs c_{t−1}). x_t is the step's own input — in Li et al. the
current token's state, for a tagger that attends once per token; it may carry nothing but a
start symbol. The score and the alignment are any registered ones (d_q = d_x + T·d_v).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, inputs, masks
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive, Score

__all__ = ["HistoryOutput", "TruncatedHistoryAttention"]


class HistoryOutput(NamedTuple):
    """contexts c_1 … c_S (B, S, d_v); weights a_1 … a_S (B, S, N)."""

    contexts: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.contexts

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("truncated_history")
class TruncatedHistoryAttention(nn.Module):
    """Attention at each of S steps with the query [x_t ; c_{t−1} ; … ; c_{t−T}] (module
    docstring).

    Args:
        d_x: size of the step inputs x_t.
        d_k: key size. d_v: value size (v = k when no values are given: d_v = d_k).
        history: T ≥ 1, how many earlier context vectors the query holds.
        d_w: hidden size of the default additive score.
        score: the score of q_t against the keys, with d_q = d_x + T·d_v (default
            ``Additive(d_x + T·d_v, d_k, d_w)``).
        align: the alignment (a name or a module).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}

    def __init__(
        self,
        d_x: int,
        d_k: int,
        d_v: int,
        history: int,
        *,
        d_w: int = 32,
        score: Score | None = None,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(d_x=d_x, d_k=d_k, d_v=d_v, history=history, d_w=d_w)
        self.d_x, self.d_k, self.d_v, self.history = d_x, d_k, d_v, history
        self.d_q = d_x + history * d_v
        if score is None:
            score = Additive(self.d_q, d_k, d_w, device=device, dtype=dtype)
        elif getattr(score, "d_q", self.d_q) != self.d_q:
            raise ValueError(
                f"score has d_q = {score.d_q} but the query [x_t ; c_(t-1) ; … ; c_(t-T)] has "
                f"d_x + T·d_v = {d_x} + {history}·{d_v} = {self.d_q} features"
            )
        self.attention = Attention(score, align)  # type: ignore[arg-type]

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        x, k = example_tensor(2, 3, 4, seed=1), example_tensor(2, 5, 6, seed=2)
        v = example_tensor(2, 5, 3, seed=3)
        mask = masks.from_lengths(torch.tensor([5, 2]), 5)  # (B, 1, N)
        return cls(4, 6, 3, 2, d_w=5), (x, k, v), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SPECIALIZED]

    def extra_repr(self) -> str:
        return f"d_x={self.d_x}, d_k={self.d_k}, d_v={self.d_v}, history={self.history}"

    def forward(
        self, x: Tensor, k: Tensor, v: Tensor | None = None, *, mask: Tensor | None = None
    ) -> HistoryOutput:
        """x (B, S, d_x) the step inputs; k (B, N, d_k), v (B, N, d_v) or None (v = k); mask
        broadcastable to (B, S, N), True = may attend (a padding mask (B, 1, N) for all
        steps)."""
        x = inputs.tensor(x, "x", min_dim=3)
        k = inputs.tensor(k, "k", min_dim=3)
        v = k if v is None else inputs.tensor(v, "v", min_dim=3)
        for name, t, d in (("x", x, self.d_x), ("k", k, self.d_k), ("v", v, self.d_v)):
            if t.dim() != 3 or t.shape[-1] != d:
                raise ValueError(
                    f"{name} must be (B, L, {d}) for this TruncatedHistoryAttention, got shape "
                    f"{tuple(t.shape)}"
                )
        inputs.same_kind(("x", x), ("k", k), ("v", v))
        if mask is not None and not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a boolean tensor or None, got {type(mask).__name__}")
        steps = x.shape[1]
        per_step = mask is not None and mask.dim() >= 2 and mask.shape[-2] == steps > 1
        past = [x.new_zeros(x.shape[0], 1, self.d_v)] * self.history  # c_{t−1}, …, c_{t−T}
        contexts, weights = [], []
        for t in range(steps):
            q = torch.cat([x[:, t : t + 1], *past], dim=-1)  # (B, 1, d_x + T·d_v)
            step_mask = mask[..., t : t + 1, :] if per_step else mask  # type: ignore[index]
            out = self.attention(q, k, v, mask=step_mask, need_weights=True)
            past = [out.context, *past[:-1]]
            contexts.append(out.context)
            weights.append(out.weights)
        return HistoryOutput(torch.cat(contexts, dim=-2), torch.cat(weights, dim=-2))
