"""DiSAN, the directional self-attention network (Shen, Zhou, Long, Jiang, Pan and Zhang, AAAI
2018; Soydaner 5.1; Brauwers Table III): directional multi-dimensional token2token
self-attention with a fusion gate in each direction, then multi-dimensional source2token
attention that compresses the sequence into one vector.

Directional self-attention, DiSA, for the forward and the backward direction (own parameters):

1. h_i = elu(W⁽ʰ⁾ x_i + b⁽ʰ⁾) ∈ ℝ^{d_h};
2. feature-wise token2token scores with the directional mask (DiSAN eq. 15):
   f(h_i, h_j) = c · tanh((W⁽¹⁾ h_i + W⁽²⁾ h_j + b⁽¹⁾)/c) ∈ ℝ^{d_h} where j may be attended
   (j < i forward, j > i backward, :mod:`attnkit.patterns.directional`), −∞ elsewhere;
3. per feature k, a softmax over j: s_i = Σ_j softmax_j(f(h_i, h_j))_k ⊙ h_j;
4. fusion gate: F = σ(W⁽ᶠ¹⁾ s_i + W⁽ᶠ²⁾ h_i + b⁽ᶠ⁾), u_i = F ⊙ h_i + (1 − F) ⊙ s_i.

Then u_i = [u_i^fw ; u_i^bw] ∈ ℝ^{2d_h} and multi-dimensional source2token attention:
g(u_i) = W⁽²⁾ᵀ elu(W⁽¹⁾ u_i + b⁽¹⁾) + b ∈ ℝ^{2d_h}, per feature a softmax over i, and the
sentence encoding s = Σ_i P_i ⊙ u_i.

Multi-dimensional weights are reported per feature, (B, d, M, N): one distribution over the keys
for every feature, as the alignment computes them.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, hooks, masks, patterns
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["DiSAN", "DiSANOutput"]


class DiSANOutput(NamedTuple):
    """encoding (B, 2d_h), the sentence vector s; tokens (B, N, 2d_h), [u^fw ; u^bw]; weights
    by name: ``forward`` and ``backward`` (B, d_h, N, N), ``source2token`` (B, 2d_h, 1, N)."""

    encoding: Tensor
    tokens: Tensor
    weights: dict[str, Tensor]

    @property
    def representation(self) -> Tensor:
        return self.encoding

    def named_weights(self) -> dict[str, Tensor]:
        return dict(self.weights)


class _DiSA(nn.Module):
    """DiSA in one direction: fc layer, masked multi-dimensional token2token self-attention and
    the fusion gate (steps 1-4 of the module docstring); a part of :class:`DiSAN`.

    Args:
        d_in: token size; d_h: hidden size; direction: a mask_mod from
        :mod:`attnkit.patterns` (``patterns.forward()`` or ``patterns.backward()``);
        c: the scale of the tanh in the scores (the paper's c = 5).
    """

    def __init__(self, d_in: int, d_h: int, direction, c: float = 5.0, **kw) -> None:
        super().__init__()
        self.direction, self.c = direction, float(arguments.finite_float(c, "c"))
        if not self.c > 0:
            raise ValueError(f"c must be > 0, got {c!r}")
        self.fc = nn.Linear(d_in, d_h, **kw)  # W^(h), b^(h)
        self.w1 = nn.Linear(d_h, d_h, **kw)  # W^(1) and b^(1)
        self.w2 = nn.Linear(d_h, d_h, bias=False, **kw)  # W^(2)
        self.fuse_s = nn.Linear(d_h, d_h, **kw)  # W^(f1) and b^(f)
        self.fuse_h = nn.Linear(d_h, d_h, bias=False, **kw)  # W^(f2)
        self.align = Softmax()

    def forward(self, x: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, N, d_in), keep (B, N) real tokens -> u (B, N, d_h), weights (B, d_h, N, N)."""
        n = x.shape[1]
        h = F.elu(self.fc(x))
        e = self.w1(h)[:, :, None, :] + self.w2(h)[:, None, :, :]  # (B, i, j, d_h)
        e = self.c * torch.tanh(e / self.c)
        allowed = patterns.dense(self.direction, n, n).to(x.device) & keep[:, None, :]
        a = self.align(e.movedim(-1, 1), allowed[:, None]).weights  # (B, d_h, i, j)
        hooks.report(self, a)
        s = torch.einsum("bkij,bjk->bik", a, h)
        gate = torch.sigmoid(self.fuse_s(s) + self.fuse_h(h))
        return gate * h + (1 - gate) * s, a


@REGISTRY.register("disan")
class DiSAN(nn.Module):
    """DiSAN: forward and backward directional self-attention, concatenated, then
    multi-dimensional source2token attention (see the module docstring).

    Args:
        d_in: token size; d_h: hidden size of each direction (the encoding has 2·d_h).
        c: the scale of the tanh in the token2token scores (the paper's 5).
        device, dtype: of the parameters.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        d_in: int,
        d_h: int,
        *,
        c: float = 5.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(d_in=d_in, d_h=d_h)
        self.d_in, self.d_h = d_in, d_h
        kw = {"device": device, "dtype": dtype}
        self.forward_direction = _DiSA(d_in, d_h, patterns.forward(), c, **kw)
        self.backward_direction = _DiSA(d_in, d_h, patterns.backward(), c, **kw)
        self.s2t_hidden = nn.Linear(2 * d_h, 2 * d_h, **kw)  # W^(1), b^(1)
        self.s2t_out = nn.Linear(2 * d_h, 2 * d_h, **kw)  # W^(2), b
        self.s2t_align = Softmax()

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([5, 3]), 5)
        return cls(3, 2), (example_tensor(2, 5, 3, seed=51),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE, tx.Dimensionality.MULTI, tx.Scoring.ADDITIVE]

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_h={self.d_h}"

    def forward(self, x: Tensor, mask: Tensor | None = None) -> DiSANOutput:
        """x (B, N, d_in); mask (B, 1, N) from :func:`attnkit.masks.from_lengths` (padding)."""
        x, keep = masks.padding_only(x, self.d_in, mask, f"DiSAN(d_in={self.d_in})")
        u_fw, a_fw = self.forward_direction(x, keep)
        u_bw, a_bw = self.backward_direction(x, keep)
        u = torch.cat([u_fw, u_bw], -1)  # (B, N, 2d_h)
        g = self.s2t_out(F.elu(self.s2t_hidden(u)))  # (B, N, 2d_h)
        p = self.s2t_align(g.transpose(1, 2)[:, :, None, :], keep[:, None, None, :]).weights
        hooks.report(self, p)  # (B, 2d_h, 1, N)
        s = torch.einsum("bkn,bnk->bk", p[:, :, 0], u)
        weights = {"forward": a_fw, "backward": a_bw, "source2token": p}
        return DiSANOutput(s, u, weights)
