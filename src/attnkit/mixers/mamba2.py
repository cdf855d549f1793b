"""The Mamba-2 layer (Dao and Gu 2024, "Transformers are SSMs", §7 and Figure 6) as a token mixer:
the whole block around the SSD, equal to transformers' ``Mamba2Mixer`` with its weights copied.

From the layer input u (B, N, E):

1. one input projection gives the gate z (inner), xBC (inner + 2 G n) and the step Δ (H);
2. a short causal depthwise convolution over xBC, then SiLU (:class:`attnkit.mixers.ShortConv`);
3. xBC splits into x (H heads of P = head_dim), B and C (G groups of the state size n; head h
   reads group h // (H/G));
4. Δ_t = clamp(softplus(Δ-projection + b_Δ), time_step_limit), A = −exp(A_log) (one per head),
   and the SSD, per head: S_t = exp(Δ_t A) S_{t−1} + (Δ_t B_t)ᵀ x_t, y_t = C_t S_t + D x_t;
5. the gated RMSNorm, gate first and over G groups: w ⊙ RMSNorm(y ⊙ SiLU(z))
   (:class:`attnkit.mixers.GatedRMSNorm`), then the output projection.

The SSD runs on the decay kernels of :mod:`attnkit.linear_family.decay` (chunkwise for a
sequence, the recurrence for a decoding step) with q = C, k = Δ B, v = x and the log-decay
g = Δ A. The per-head part :class:`attnkit.linear_family.Mamba2SSD` cannot be used as it is:
it sees a head's q, k, v only and reads Δ from k, while here Δ is the layer's own projection of
the input; the mixer calls the kernels with its Δ directly.

Padding and caching: a key-padding mask removes a position entirely — its inputs do not reach the
convolution, its Δ is 0 (the state neither decays nor is written) and its output is 0 — so a
padded batch equals each sequence alone, also for the state kept for decoding. transformers
zeroes padded inputs too, but its Δ at a padded position still decays the state, so after a
right-padded prefill its state differs from the sequence alone (its outputs at real positions
agree). The cache (:class:`attnkit.mixers.MixerCache`) holds ``"conv"`` (the last K − 1 inputs
of the convolution, (B, K − 1, inner + 2 G n)) and ``"ssm"`` (the state, (B, H, n, P); its
transpose is transformers' (B, H, P, n)). The time-step limit is applied in decoding too
(transformers' single-step update leaves it out; with the default limit (0, ∞) no difference).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.linear_family import decay
from attnkit.mixers.base import (
    REGISTRY,
    MixerCache,
    TokenMixer,
    check_state,
)
from attnkit.mixers.conv import ShortConv, zero_padding
from attnkit.mixers.gated_norm import GatedRMSNorm

__all__ = ["Mamba2Mixer"]


def time_limit(limit: object) -> tuple[float, float]:
    """``limit`` as (low, high) with 0 ≤ low ≤ high ≤ ∞; ValueError otherwise."""
    try:
        low, high = (float(t) for t in limit)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit must be (low, high), got {limit!r}") from None
    if not 0 <= low <= high:
        raise ValueError(f"time_step_limit must be (low, high) with 0 ≤ low ≤ high, got {limit!r}")
    return low, high


@REGISTRY.register("mamba2")
class Mamba2Mixer(TokenMixer):
    """The Mamba-2 layer: x (B, N, embed_dim) → (B, N, embed_dim) (see the module docstring).

    Args:
        embed_dim: E, the size of the residual stream.
        num_heads: H, the SSD heads (each with its own A, b_Δ and D).
        head_dim: P, channels per head; the inner size is H·P (default: expand·E / H).
        state_size: n, the state size of B and C.
        n_groups: G, the groups of B and C (H must be a multiple); also the norm's groups.
        conv_kernel: K, the short convolution's kernel.
        expand: the inner size over E, used when ``head_dim`` is not given (if both are
            given, H·P must equal expand·E).
        chunk_size: positions per chunk of the SSD (any value gives the same outputs; it
            only trades memory for speed).
        use_bias: biases in the input and output projections.
        use_conv_bias: a bias in the convolution.
        eps: the norm's epsilon.
        time_step_limit: (low, high) bounds for Δ after the softplus.
        time_step_min, time_step_max, time_step_floor: the initial Δ, log-uniform in
            [min, max] and at least floor (as transformers initialises it).

    Initialised as transformers' ``Mamba2Mixer``: A = 1, …, H, D = 1, the gate weights 1.

    Cache states (:attr:`state_names`, :meth:`state_shapes`):

    - ``"conv"``: (B, K − 1, H·P + 2·G·n), the short convolution's last K − 1 real inputs
      (xBC), in x's dtype;
    - ``"ssm"``: (B, H, n, P), the SSD state of each head (transformers' (B, H, P, n)
      transposed), in x's dtype promoted to at least float32.
    """

    state_names: ClassVar[dict[str, str]] = {
        "conv": "(B, K − 1, H·P + 2·G·n): the short convolution's last K − 1 real inputs (xBC)",
        "ssm": "(B, H, n, P): the SSD state of each head",
    }

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        head_dim: int | None = None,
        *,
        state_size: int = 128,
        n_groups: int = 1,
        conv_kernel: int = 4,
        expand: int | None = None,
        chunk_size: int = 64,
        use_bias: bool = False,
        use_conv_bias: bool = True,
        eps: float = 1e-5,
        time_step_limit: tuple[float, float] = (0.0, math.inf),
        time_step_min: float = 1e-3,
        time_step_max: float = 0.1,
        time_step_floor: float = 1e-4,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.state_size = arguments.positive_int(state_size, "state_size")
        self.n_groups = arguments.positive_int(n_groups, "n_groups")
        self.chunk_size = arguments.positive_int(chunk_size, "chunk_size")
        if expand is not None:
            arguments.positive_int(expand, "expand")
        if head_dim is None:
            inner = (2 if expand is None else expand) * embed_dim
            if inner % num_heads:
                raise ValueError(
                    f"the inner size expand·embed_dim = {inner} must be a multiple of "
                    f"num_heads {num_heads}, or give head_dim"
                )
            head_dim = inner // num_heads
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        if expand is not None and num_heads * head_dim != expand * embed_dim:
            raise ValueError(
                f"num_heads·head_dim = {num_heads * head_dim} must equal expand·embed_dim = "
                f"{expand * embed_dim}"
            )
        if num_heads % n_groups:
            raise ValueError(f"num_heads {num_heads} must be a multiple of n_groups {n_groups}")
        self.time_step_limit = time_limit(time_step_limit)
        self.inner = num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * n_groups * state_size
        kw = {"device": device, "dtype": dtype}
        self.in_proj = nn.Linear(
            embed_dim, self.inner + self.conv_dim + num_heads, bias=use_bias, **kw
        )
        self.conv = ShortConv(
            self.conv_dim, conv_kernel, bias=use_conv_bias, activation="silu", **kw
        )
        a = torch.arange(1, num_heads + 1, **kw)
        self.A_log = nn.Parameter(a.log())
        dt = torch.exp(
            torch.rand(num_heads, **kw) * (math.log(time_step_max) - math.log(time_step_min))
            + math.log(time_step_min)
        ).clamp(min=time_step_floor)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(Δ)
        self.D = nn.Parameter(torch.ones(num_heads, **kw))
        self.norm = GatedRMSNorm(
            self.inner, eps=eps, group_size=self.inner // n_groups, order="gate_first", **kw
        )
        self.out_proj = nn.Linear(self.inner, embed_dim, bias=use_bias, **kw)

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"state_size={self.state_size}, n_groups={self.n_groups}, "
            f"conv_kernel={self.conv.kernel_size}, chunk_size={self.chunk_size}"
        )

    def state_shapes(self, batch: int) -> dict[str, tuple[int, ...]]:
        return {
            "conv": self.conv.state_shape(batch),
            "ssm": (batch, self.num_heads, self.state_size, self.head_dim),
        }

    #: transformers' Mamba-2 mixers: ``Mamba2Mixer``, and the same layer under the names of the
    #: hybrid models (Bamba, Granite 4 hybrid, Nemotron-H, Zamba 2).
    TRANSFORMERS_NAMES: ClassVar[tuple[str, ...]] = (
        "Mamba2Mixer",
        "BambaMixer",
        "GraniteMoeHybridMambaLayer",
        "NemotronHMamba2Mixer",
        "Zamba2MambaMixer",
    )

    @classmethod
    def from_transformers(cls, module: nn.Module, **overrides) -> Mamba2Mixer:
        """The mixer equal to a transformers Mamba-2 mixer ``module`` (one of
        :attr:`TRANSFORMERS_NAMES`), its weights copied (same device and dtype). ``overrides``
        (e.g. ``chunk_size``) replace the sizes read from the module.

        Raises:
            TypeError: another module.
            ValueError: a layer this mixer does not reproduce (a convolution activation other
                than SiLU, heads that do not fill the inner size, a norm not grouped by
                ``n_groups``, a bias on one projection only)."""
        name = type(module).__name__
        if name not in cls.TRANSFORMERS_NAMES or not hasattr(module, "in_proj"):
            others = ", ".join(cls.TRANSFORMERS_NAMES[1:])
            raise TypeError(
                f"module must be a transformers Mamba2Mixer (or the same layer of a hybrid "
                f"model: {others}), got {name}"
            )
        activation = getattr(module, "activation", None)
        if activation != "silu":
            raise ValueError(
                f"{name}: the convolution's activation must be 'silu', got {activation!r}"
            )
        inner = module.num_heads * module.head_dim
        group = getattr(module.norm, "group_size", None)
        if inner != module.intermediate_size or group != inner // module.n_groups:
            raise ValueError(
                f"{name}: expected heads·head_dim = intermediate_size and a gated norm over "
                f"n_groups groups, got {module.num_heads}·{module.head_dim}, intermediate_size "
                f"{module.intermediate_size}, norm group size {group}"
            )
        if (module.in_proj.bias is None) != (module.out_proj.bias is None):
            raise ValueError(
                f"{name}: the input and output projections must both have biases or not"
            )
        weight = module.in_proj.weight
        sizes = {
            "embed_dim": module.hidden_size,
            "num_heads": module.num_heads,
            "head_dim": module.head_dim,
            "state_size": module.ssm_state_size,
            "n_groups": module.n_groups,
            "conv_kernel": module.conv_kernel_size,
            "use_bias": module.in_proj.bias is not None,
            "use_conv_bias": module.conv1d.bias is not None,
            "eps": module.norm.variance_epsilon,
            "time_step_limit": tuple(module.time_step_limit),
        }
        layer = cls(**(sizes | overrides), device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            layer.in_proj.weight.copy_(module.in_proj.weight)
            layer.out_proj.weight.copy_(module.out_proj.weight)
            if module.in_proj.bias is not None:
                layer.in_proj.bias.copy_(module.in_proj.bias)
                layer.out_proj.bias.copy_(module.out_proj.bias)
            layer.conv.weight.copy_(module.conv1d.weight)
            if module.conv1d.bias is not None:
                layer.conv.bias.copy_(module.conv1d.bias)
            for attr in ("A_log", "dt_bias", "D"):
                getattr(layer, attr).copy_(getattr(module, attr))
            layer.norm.weight.copy_(module.norm.weight)
        return layer

    def mix(self, x: Tensor, keep: Tensor | None, cache: MixerCache | None) -> Tensor:
        b, n, _ = x.shape
        h, g, p, s = self.num_heads, self.n_groups, self.head_dim, self.state_size
        work = torch.promote_types(x.dtype, torch.float32)
        if cache is not None:
            check_state(self, cache, "ssm", (b, h, s, p), work)
        z, xbc, dt = self.in_proj(x).split([self.inner, self.conv_dim, h], -1)
        xbc = self.conv(xbc, mask=keep, cache=cache).to(work)
        xs, bs, cs = xbc.split([self.inner, g * s, g * s], -1)
        dt = F.softplus(dt.to(work) + self.dt_bias.to(work)).clamp(*self.time_step_limit)
        dt = zero_padding(dt, keep)  # a padded position neither decays nor writes the state
        # heads as (G, H/G) so that B and C (one per group) broadcast over a group's heads
        v = xs.view(b, n, g, h // g, p).permute(0, 2, 3, 1, 4)
        step = dt.view(b, n, g, h // g).permute(0, 2, 3, 1).unsqueeze(-1)  # (B, G, H/G, N, 1)
        k = bs.view(b, n, g, 1, s).permute(0, 2, 3, 1, 4) * step
        q = cs.view(b, n, g, 1, s).permute(0, 2, 3, 1, 4)
        log_decay = step * -torch.exp(self.A_log.to(work)).view(g, h // g, 1, 1)
        state = None if cache is None else cache.states.get("ssm")
        if state is not None:
            state = state.view(b, g, h // g, s, p)
        if cache is not None and n == 1:
            y, state = decay.recurrent(q, k, v, log_decay, state)
        else:
            y, state = decay.chunkwise(q, k, v, log_decay, self.chunk_size, state)
        y = y + self.D.to(work).view(g, h // g, 1, 1) * v
        y = y.permute(0, 3, 1, 2, 4).reshape(b, n, self.inner)
        y = self.out_proj(self.norm(y, z.to(work)).to(x.dtype))
        if cache is not None:
            cache.advance(n, ssm=state.reshape(b, h, s, p))
        return zero_padding(y, keep)
