"""Universal Transformer (Dehghani, Gouws, Vinyals, Uszkoreit and Kaiser, ICLR 2019; Soydaner 5.2,
eq. 10): one Transformer layer, shared, applied recurrently to all positions in parallel, with a
timestep embedding added before every step, and Adaptive Computation Time (Graves 2016) deciding
per position how many steps it takes.

Step t = 1 … T: Hᵗ = Layer(Hᵗ⁻¹ + Tᵗ), with Tᵗ the sinusoidal embedding of t
(Tᵗ_{2c} = sin(t / 10000^{2c/d}), Tᵗ_{2c+1} = cos(t / 10000^{2c/d})).

ACT, per position (Graves eqs. 6-13): the halting unit hᵗ = σ(w·Hᵗ + b) ∈ (0, 1); the position
halts at N = min{n : Σ_{t≤n} hᵗ ≥ threshold} (at T at the latest); its halting weights are
pᵗ = hᵗ for t < N and the remainder R = 1 − Σ_{t<N} hᵗ at t = N (0 after), so Σ_t pᵗ = 1; the
output is Σ_t pᵗ Hᵗ and the ponder cost ρ = N + R (Graves eq. 11), to be added to the loss with a
small weight. Without halting the output is H^T.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.transformer import TransformerEncoderLayer

__all__ = ["UniversalOutput", "UniversalTransformer", "timestep_embedding"]


@arguments.renamed(d="embed_dim")
def timestep_embedding(t: int, embed_dim: int, *, device=None, dtype=None) -> Tensor:
    """The sinusoidal embedding (embed_dim,) of step t (the Transformer's position formula read
    at t)."""
    c = torch.arange(0, embed_dim, 2, device=device, dtype=torch.float64)
    angle = t / torch.pow(10000.0, c / embed_dim)
    out = torch.zeros(embed_dim, device=device, dtype=torch.float64)
    out[0::2] = torch.sin(angle)
    out[1::2] = torch.cos(angle[: embed_dim // 2])
    return out.to(dtype or torch.get_default_dtype())


class UniversalOutput(NamedTuple):
    """output (B, N, embed_dim); with halting, the halting weights pᵗ (B, N, T) (each position's
    sum to 1; zero after it halts), the ponder cost ρ = N + R (B, N) and the steps N (B, N)."""

    output: Tensor
    halting_weights: Tensor | None = None
    ponder_cost: Tensor | None = None
    steps: Tensor | None = None


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class UniversalTransformer(nn.Module):
    """A Universal Transformer encoder: one shared :class:`attnkit.TransformerEncoderLayer`
    applied up to ``max_steps`` times.

    Args:
        embed_dim, num_heads, d_ff: the shared layer's sizes.
        max_steps: T, the most steps (with halting) or the number of steps (without).
        halting: Adaptive Computation Time per position (True) or exactly T steps (False).
        threshold: 1 − ε of ACT, in (0, 1]; a position halts once its halting probabilities
            reach it (0 halts every position after one step).
        layer: further keyword arguments of :class:`attnkit.TransformerEncoderLayer`
            (``score``, ``align``, ``attention``, ``position``, ``norm_first``, ``dropout``, ...).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        max_steps: int = 6,
        halting: bool = True,
        threshold: float = 0.99,
        **layer: Any,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.max_steps = arguments.positive_int(max_steps, "max_steps")
        self.halting = arguments.boolean(halting, "halting")
        threshold = arguments.finite_float(threshold, "threshold")
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be in [0, 1], got {threshold!r}")
        self.threshold = float(threshold)
        self.layer = TransformerEncoderLayer(embed_dim, num_heads, d_ff, **layer)
        kw = {k: layer[k] for k in ("device", "dtype") if k in layer}
        self.halt = nn.Linear(embed_dim, 1, **kw) if halting else None
        if self.halt is not None:
            nn.init.constant_(self.halt.bias, 1.0)  # Graves: start by pondering few steps
        steps = [timestep_embedding(t, embed_dim, **kw) for t in range(1, self.max_steps + 1)]
        self.register_buffer("timesteps", torch.stack(steps), persistent=False)

    def extra_repr(self) -> str:
        return f"max_steps={self.max_steps}, halting={self.halting}, threshold={self.threshold}"

    def forward(self, x: Tensor, mask: Tensor | None = None) -> UniversalOutput:
        """x (B, N, embed_dim); mask as :meth:`attnkit.TransformerEncoderLayer.forward`."""
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must be (B, N, {self.embed_dim}), got {getattr(x, 'shape', type(x).__name__)}"
            )
        state = x
        if self.halt is None:
            for t in range(self.max_steps):
                state = self.layer(state + self.timesteps[t], mask)
            return UniversalOutput(state)
        b, n, _ = x.shape
        total = x.new_zeros(b, n)  # Σ of the halting weights so far
        halted = torch.zeros(b, n, dtype=torch.bool, device=x.device)
        steps, remainder = x.new_zeros(b, n), x.new_zeros(b, n)
        output, weights = torch.zeros_like(x), []
        for t in range(self.max_steps):
            state = self.layer(state + self.timesteps[t], mask)
            h = torch.sigmoid(self.halt(state)).squeeze(-1)
            running = ~halted
            stop = running & ((total + h >= self.threshold) | (t == self.max_steps - 1))
            rest = 1 - total
            p = torch.where(stop, rest, torch.where(running, h, 0.0))
            output = output + p.unsqueeze(-1) * state
            remainder = torch.where(stop, rest, remainder)
            steps = steps + running.to(x.dtype)
            total = total + p
            halted = halted | stop
            weights.append(p)
            if bool(halted.all()):
                break
        weights += [x.new_zeros(b, n)] * (self.max_steps - len(weights))
        return UniversalOutput(output, torch.stack(weights, -1), steps + remainder, steps)
