"""The neural Turing machine (Graves, Wayne and Danihelka, 2014; Soydaner Sec. 3): an LSTM
controller with read and write heads that address an N × M memory by content and by location.

Addressing, per head (paper Sec. 3.3, eqs. 5-9), as pure functions on batched tensors:

- content: w^c(i) = softmax_i(β K(k, M(i))) with K the cosine similarity (eqs. 5-6);
- interpolation with the previous weighting: w^g = g w^c + (1 − g) w_{t−1} (eq. 7);
- circular convolutional shift: w̃(i) = Σ_j w^g(j) s(i − j) (eq. 8), s over shifts −r … r;
- sharpening: w(i) = w̃(i)^γ / Σ_j w̃(j)^γ, γ ≥ 1 (eq. 9).

Reading is r = Σ_i w(i) M(i) (eq. 2); writing erases then adds,
M(i) ← M(i)(1 − w(i) e) + w(i) a (eqs. 3-4).

Shapes: memory (B, N, M); weightings (B, H, N) for H heads; keys (B, H, M); β, g, γ (B, H);
shifts (B, H, 2r + 1).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, checks, hooks
from attnkit import taxonomy as tx
from attnkit.checks import resolve_alignment
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = [
    "NTMOutput",
    "NeuralTuringMachine",
    "content_weights",
    "interpolate",
    "read",
    "sharpen",
    "shift",
    "write",
]

_EPS = 1e-8


def content_weights(
    key: Tensor, memory: Tensor, beta: Tensor, align: nn.Module | None = None
) -> Tensor:
    """w^c (B, H, N) = align(β · cos(k, M(i))) (eqs. 5-6); softmax by default."""
    cosine = torch.einsum("bhm,bnm->bhn", key, memory) / (
        key.norm(dim=-1, keepdim=True) * memory.norm(dim=-1).unsqueeze(-2) + _EPS
    )
    scores = beta.unsqueeze(-1) * cosine
    if align is None:
        return scores.softmax(-1)
    return align(scores).weights


def interpolate(content: Tensor, previous: Tensor, gate: Tensor) -> Tensor:
    """w^g = g w^c + (1 − g) w_{t−1} (eq. 7); gate (B, H) in [0, 1]."""
    g = gate.unsqueeze(-1)
    return g * content + (1 - g) * previous


def shift(weights: Tensor, shifts: Tensor) -> Tensor:
    """Circular convolution w̃(i) = Σ_j w(j) s(i − j) (eq. 8): ``shifts`` (B, H, 2r + 1) gives
    s(−r) … s(r); the weight at j moves to j + δ with probability s(δ)."""
    width = shifts.shape[-1]
    if width % 2 != 1:
        raise ValueError(f"shifts must have an odd size 2r + 1, got shape {tuple(shifts.shape)}")
    r = width // 2
    moved = torch.stack([torch.roll(weights, d, dims=-1) for d in range(-r, r + 1)], -1)
    return (moved * shifts.unsqueeze(-2)).sum(-1)


def sharpen(weights: Tensor, gamma: Tensor) -> Tensor:
    """w(i) = w̃(i)^γ / Σ_j w̃(j)^γ (eq. 9); gamma (B, H) ≥ 1."""
    powered = (weights + _EPS) ** gamma.unsqueeze(-1)
    return powered / powered.sum(-1, keepdim=True)


def read(memory: Tensor, weights: Tensor) -> Tensor:
    """r (B, H, M) = Σ_i w(i) M(i) (eq. 2)."""
    return weights @ memory


def write(memory: Tensor, weights: Tensor, erase: Tensor, add: Tensor) -> Tensor:
    """Erase then add for every write head (eqs. 3-4): M(i) ← M(i) Π_h (1 − w_h(i) e_h) +
    Σ_h w_h(i) a_h. erase (B, H, M) in [0, 1], add (B, H, M); heads act in the same step, so
    erasures multiply and additions sum (as the paper prescribes for several write heads)."""
    keep = torch.prod(1 - weights.unsqueeze(-1) * erase.unsqueeze(-2), dim=1)  # (B, N, M)
    added = torch.einsum("bhn,bhm->bnm", weights, add)
    return memory * keep + added


class NTMOutput(NamedTuple):
    """outputs (B, T, d_out); read and write weightings (B, T, H, N); the final memory
    (B, N, M)."""

    outputs: Tensor
    read_weights: Tensor
    write_weights: Tensor
    memory: Tensor

    @property
    def representation(self) -> Tensor:
        """The outputs at every step (B, T, d_out)."""
        return self.outputs

    def named_weights(self) -> dict[str, Tensor]:
        return {"read": self.read_weights, "write": self.write_weights}


class _Heads(nn.Module):
    """The parameters a controller state emits for H heads: key, β, g, s, γ (and e, a)."""

    def __init__(self, d: int, heads: int, width: int, shift_range: int, writes: bool, **kw):
        super().__init__()
        self.heads, self.width, self.n_shifts = heads, width, 2 * shift_range + 1
        self.sizes = [width, 1, 1, self.n_shifts, 1] + ([width, width] if writes else [])
        self.project = nn.Linear(d, heads * sum(self.sizes), **kw)

    def forward(self, h: Tensor) -> list[Tensor]:
        parts = self.project(h).unflatten(-1, (self.heads, -1)).split(self.sizes, -1)
        key, beta, gate, shifts, gamma = parts[:5]
        out = [
            key,
            F.softplus(beta.squeeze(-1)),  # β ≥ 0
            torch.sigmoid(gate.squeeze(-1)),  # g ∈ (0, 1)
            shifts.softmax(-1),  # a distribution over −r … r
            1 + F.softplus(gamma.squeeze(-1)),  # γ ≥ 1
        ]
        if len(parts) > 5:
            out += [torch.sigmoid(parts[5]), parts[6]]  # e ∈ (0, 1), a
        return out


@REGISTRY.register("ntm")
class NeuralTuringMachine(nn.Module):
    """Neural Turing machine with an LSTM controller (Graves et al. 2014, Sec. 3).

    At step t the controller reads [x_t, r_{t−1}]; each read head addresses the memory M_{t−1}
    (content → interpolation → shift → sharpening) and reads r_t; each write head addresses it
    the same way and erases/adds, giving M_t; the output is a linear map of [h_t, r_t].

    Args:
        d_in, d_out: input and output sizes per step.
        memory_size: N memory locations; memory_width: M, the size of each.
        controller_size: hidden size of the LSTM controller.
        read_heads, write_heads: numbers of heads.
        shift_range: r, shifts −r … r allowed (eq. 8); 2r + 1 ≤ N.
        align: the alignment of content addressing (default softmax, eq. 5).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        memory_size: int = 16,
        memory_width: int = 8,
        controller_size: int = 64,
        read_heads: int = 1,
        write_heads: int = 1,
        shift_range: int = 1,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(d_in=d_in, d_out=d_out, memory_size=memory_size)
        arguments.sizes(memory_width=memory_width, controller_size=controller_size)
        arguments.sizes(read_heads=read_heads, write_heads=write_heads)
        arguments.nonnegative_int(shift_range, "shift_range")
        if 2 * shift_range + 1 > memory_size:
            raise ValueError(
                f"shift_range = {shift_range} allows {2 * shift_range + 1} shifts but the memory "
                f"has memory_size = {memory_size} locations; need 2·shift_range + 1 ≤ memory_size"
            )
        kw = {"device": device, "dtype": dtype}
        self.d_in, self.d_out = d_in, d_out
        self.n, self.m, self.read_heads = memory_size, memory_width, read_heads
        self.controller = nn.LSTMCell(d_in + read_heads * memory_width, controller_size, **kw)
        self.readers = _Heads(controller_size, read_heads, memory_width, shift_range, False, **kw)
        self.writers = _Heads(controller_size, write_heads, memory_width, shift_range, True, **kw)
        self.output = nn.Linear(controller_size + read_heads * memory_width, d_out, **kw)
        # A learned initial memory (small values, so that cosine addressing is defined).
        self.memory0 = nn.Parameter(torch.randn(memory_size, memory_width, **kw) * 0.1)
        self.align = resolve_alignment(align, device=device, dtype=dtype)

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(N = 5, M = 3, one read and one write head; x (2, 3, 4))."""
        module = cls(4, 2, memory_size=5, memory_width=3, controller_size=6)
        return module, (example_tensor(2, 3, 4),), {}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SIMILARITY, tx.QueryMultiplicity.MULTI_HEAD]

    def _address(self, heads: list[Tensor], memory: Tensor, previous: Tensor) -> Tensor:
        key, beta, gate, shifts, gamma = heads[:5]
        w = content_weights(key, memory, beta, self.align)
        return sharpen(shift(interpolate(w, previous, gate), shifts), gamma)

    def forward(self, x: Tensor) -> NTMOutput:
        """x (B, T, d_in) → outputs (B, T, d_out), one step at a time."""
        x = checks.features(x, "x", self.d_in, what="d_in")
        b, steps = x.shape[0], x.shape[1]
        memory = self.memory0.to(x.dtype).expand(b, -1, -1)
        first = torch.zeros(self.n, dtype=x.dtype, device=x.device)
        first[0] = 1.0  # every head starts at location 0
        w_read = first.expand(b, self.read_heads, -1)
        w_write = first.expand(b, self.writers.heads, -1)
        r = x.new_zeros(b, self.read_heads * self.m)
        state = None
        outputs, reads, writes = [], [], []
        for t in range(steps):
            state = self.controller(torch.cat([x[:, t], r], -1), state)
            h = state[0]
            w_read = self._address(self.readers(h), memory, w_read)
            r = read(memory, w_read).flatten(1)
            heads = self.writers(h)
            w_write = self._address(heads, memory, w_write)
            memory = write(memory, w_write, heads[5], heads[6])
            hooks.report(self, w_read, "read")
            hooks.report(self, w_write, "write")
            outputs.append(self.output(torch.cat([h, r], -1)))
            reads.append(w_read)
            writes.append(w_write)
        return NTMOutput(
            torch.stack(outputs, 1), torch.stack(reads, 1), torch.stack(writes, 1), memory
        )
