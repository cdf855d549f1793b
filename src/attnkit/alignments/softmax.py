"""Soft / global alignment (Brauwers eq. 25) with fixed or learned temperature (Galassi IV-C)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import taxonomy as tx
from attnkit.alignments.base import REGISTRY, Alignment, AlignOutput, masked_softmax
from attnkit.alignments.streaming import Streaming, Tiles
from attnkit.sizing import example_sizes

__all__ = ["Softmax"]


@REGISTRY.register("softmax")
class Softmax(Streaming, Alignment):
    """a_l = exp(e_l/τ) / Σ_j exp(e_j/τ) (Brauwers eq. 25; τ = 1 by default).

    Args:
        temperature: τ > 0 and finite. Higher is smoother.
        learnable: learn τ (Lin et al.'s adaptive temperature, Galassi IV-C); it is kept
            positive by learning log τ, a parameter that follows ``.to()``/``.double()``. A fixed
            τ is kept as a Python float, so it is exact in every dtype.
        device, dtype: of the learned log τ.

    Streaming (chunked kernels): online softmax with the row maximum and the log-normaliser kept
    apart, so the weights ignore a constant added to a row at any magnitude.
    """

    stream_online: ClassVar[bool] = True
    stream_weights_are_correction: ClassVar[bool] = True
    label = tx.AlignmentKind.GLOBAL

    @classmethod
    def examples(cls, **sizes: int | None) -> dict[str, Alignment]:
        """τ = 1, and a learned temperature starting at 0.7."""
        s = example_sizes(cls.example_sizes, **sizes).for_heads()
        learned = cls.for_heads(**s, temperature=0.7, learnable=True)
        return {"": cls.example(**sizes), "learned-temperature": learned}

    def __init__(
        self,
        temperature: float = 1.0,
        *,
        learnable: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
        if not isinstance(learnable, bool):
            raise TypeError(f"learnable must be a bool, got {type(learnable).__name__}")
        self.fixed_temperature = None if learnable else float(temperature)
        if learnable:
            self.log_temperature = nn.Parameter(
                torch.tensor(math.log(temperature), device=device, dtype=dtype)
            )

    @property
    def temperature(self) -> Tensor:
        """τ as a tensor (a parameter's function when learned)."""
        if self.fixed_temperature is None:
            return self.log_temperature.exp()
        return torch.tensor(self.fixed_temperature, dtype=torch.float64)

    def softmax_temperature(self) -> float | None:
        return self.fixed_temperature

    def _scaled(self, e: Tensor) -> Tensor:
        if self.fixed_temperature is None:
            return e / self.log_temperature.to(e.dtype).exp()
        if self.fixed_temperature == 1.0:
            return e
        return e / self.fixed_temperature

    def forward(
        self, scores: Tensor, mask: Tensor | None = None, *, query: Tensor | None = None
    ) -> AlignOutput:
        return AlignOutput(masked_softmax(self._scaled(scores), mask))

    # ---- streaming protocol -----------------------------------------------------------------

    def stream_prepare(self, e: Tensor) -> Tensor:
        return self._scaled(e)

    def stream_accumulate(self, e, state):
        blk = e.amax(dim=-1, keepdim=True)
        old = None if state is None else state[0]
        new = blk if old is None else torch.maximum(old, blk)
        ref = torch.where(torch.isinf(new), torch.zeros((), dtype=e.dtype), new)
        p = torch.exp(e - ref)
        total = p.sum(dim=-1, keepdim=True)
        if state is None:
            return p, None, (new, total)
        rescale = torch.exp(old - ref)  # 0 while the row had no key yet (old = −inf)
        return p, rescale, (new, state[1] * rescale + total)

    def stream_finish(self, state):
        top, total = state
        empty = total == 0
        # NaN or +inf among the row's scores: the row is NaN, as torch.softmax makes it.
        undefined = torch.isnan(top) | (top == float("inf"))
        top = torch.where(empty, torch.zeros((), dtype=top.dtype), top)
        norm = torch.where(empty, torch.ones((), dtype=total.dtype), total)
        norm = torch.where(undefined, torch.full((), float("nan"), dtype=norm.dtype), norm)
        return norm, torch.cat([top, torch.log(norm)], dim=-1)

    def stream_statistic(self, tiles: Tiles) -> Tensor:
        state = None
        for e in tiles():
            _, _, state = self.stream_accumulate(e, state)
        assert state is not None
        return self.stream_finish(state)[1]

    def stream_weights(self, e: Tensor, stat: Tensor | None) -> Tensor:
        assert stat is not None
        return torch.exp((e - stat[..., :1]) - stat[..., 1:])

    def stream_slope(self, p: Tensor, stat: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return p, p
