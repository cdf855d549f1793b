"""xPos, the extrapolatable position embedding (Sun et al. 2022, "A Length-Extrapolatable
Transformer", sec. 3.1-3.2, eqs. 7-9).

RoPE rotates each feature pair i of q and k by n·θ_i at position n (Su et al. eq. 34). xPos
also scales pair i of the query at position n by ζ_i^{n/γ} and pair i of the key at position m
by ζ_i^{−m/γ}:

    f_q(q, n)_i = q_i e^{i n θ_i} ζ_i^{n/γ},   f_k(k, m)_i = k_i e^{i m θ_i} ζ_i^{−m/γ},
    ζ_i = (2i/d + ζ₀) / (1 + ζ₀) ∈ (0, 1],   θ_i = base^{−2i/d},

so that f_q(q, n) · f_k(k, m) = Σ_i Re(q_i k̄_i e^{i(n−m)θ_i}) ζ_i^{(n−m)/γ}: the score depends on
the positions through n − m only, and the low-frequency pairs (small i, small ζ_i), whose
rotation alone cannot tell far distances apart, decay with the distance n − m ≥ 0 of causal
attention — the attention resolution the paper designs for. The paper's ζ₀ = 0.4 and γ = 512
(``scale_base``) are the defaults, as in the authors' code.

Numerical range: the scales grow as ζ_0^{−|n − c|/γ} (ζ_0 = ζ₀ / (1 + ζ₀) ≈ 0.29) away from the
centre c (``center``, 0 in the equations above). Moving the centre multiplies every query by
ζ^{−c/γ} and every key by ζ^{c/γ}, which changes no score; in float32 the scales stay finite
for |n − c| up to about 70·γ (≈ 36000 positions at γ = 512), so a long sequence is best
centred in its middle (the authors' code centres each call on its own length).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.positions.base import REGISTRY, Positioned, PositionScheme, check_qk

__all__ = ["XPos", "xpos_scales"]


def xpos_scales(head_dim: int, zeta: float = 0.4) -> Tensor:
    """ζ_i = (2i/d + ζ₀) / (1 + ζ₀), i = 0 … d/2 − 1, float64 (Sun et al. sec. 3.2)."""
    two_i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    return (two_i / head_dim + zeta) / (1 + zeta)


@REGISTRY.register("xpos")
class XPos(PositionScheme):
    """Rotate and scale queries and keys by position (module docstring): pair i of the query at
    position n becomes R_{nθ_i} q_i · ζ_i^{(n−c)/γ}, of the key at position m
    R_{mθ_i} k_i · ζ_i^{−(m−c)/γ}. No parameters; any number of heads; d must be even; pairs
    are interleaved, (x_{2i}, x_{2i+1}), as in RoFormer and the authors' code.

    Declares ``translation_invariant`` (the scores read n − m only, so a paged cache and a KV
    cache take it), but not ``per_token``: queries and keys take different transforms (inverse
    scales), and :meth:`~attnkit.positions.PositionScheme.transform_at` places a vector by its
    position alone, so evaluation part by part over a ring is refused.

    Args:
        base: RoPE's base (θ_i = base^{−2i/d}).
        scale_base: γ, the positions over which a scale is raised to the power 1 (512).
        zeta: ζ₀ of ζ_i = (2i/d + ζ₀)/(1 + ζ₀) (0.4).
        center: c, the position whose scale is 1 (module docstring; no score depends on it).
    """

    translation_invariant = True  # the scores read only n − m
    bias_of_positions = True  # (no bias)

    def __init__(
        self,
        base: float = 10000.0,
        *,
        scale_base: float = 512.0,
        zeta: float = 0.4,
        center: int = 0,
    ) -> None:
        super().__init__()
        self.base = arguments.finite_float(base, "base")
        if not self.base > 1:
            raise ValueError(f"base must be > 1, got {base!r}")
        self.scale_base = arguments.finite_float(scale_base, "scale_base", positive=True)
        self.zeta = arguments.finite_float(zeta, "zeta", positive=True)
        if isinstance(center, bool) or not isinstance(center, int):
            raise TypeError(f"center must be an int (a position), got {center!r}")
        self.center = center

    def place(self, x: Tensor, positions: Tensor, *, key: bool) -> Tensor:
        """Queries (``key=False``) or keys (``key=True``) x (…, L, d) at ``positions`` (L,):
        rotated by position·θ_i and scaled by ζ_i^{±(position − c)/γ}."""
        d = x.shape[-1]
        if d % 2:
            raise ValueError(f"xpos rotates feature pairs: d must be even, got {tuple(x.shape)}")
        theta = self.base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        pos = positions.to(device="cpu", dtype=torch.float64)[:, None]  # (L, 1)
        power = (pos - self.center) / self.scale_base
        scale = xpos_scales(d, self.zeta) ** (-power if key else power)  # (L, d/2)
        angle = pos * theta
        cos = (angle.cos() * scale).to(device=x.device, dtype=x.dtype)
        sin = (angle.sin() * scale).to(device=x.device, dtype=x.dtype)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def transform_at(self, x: Tensor, positions: Tensor, total: int) -> Tensor:
        """Refused: one transform per position cannot place both queries and keys (their
        scales are inverse); :meth:`place` takes which of the two x holds."""
        raise NotImplementedError(
            "xpos scales queries by ζ^{n/γ} and keys by ζ^{-m/γ}, so no single transform per "
            "position places both (it does not declare per_token); use place(x, positions, "
            "key=...)"
        )

    def forward(self, q: Tensor, k: Tensor, *, q_offset: int = 0, k_offset: int = 0) -> Positioned:
        check_qk(q, k, "xpos", q_offset=q_offset, k_offset=k_offset)
        m, n = q.shape[-2], k.shape[-2]
        qpos = torch.arange(q_offset, q_offset + m)
        kpos = torch.arange(k_offset, k_offset + n)
        return Positioned(self.place(q, qpos, key=False), self.place(k, kpos, key=True))

    def extra_repr(self) -> str:
        return (
            f"base={self.base:g}, scale_base={self.scale_base:g}, zeta={self.zeta:g}, "
            f"center={self.center}"
        )
