"""Bi-directional block self-attention, Bi-BloSA (Shen, Zhou, Long, Jiang and Zhang,
"Bi-Directional Block Self-Attention for Fast and Memory-Efficient Sequence Modeling", ICLR 2018;
Brauwers 3.1): self-attention whose memory is O(N·r + (N/r)²) instead of O(N²), by splitting the
sequence into blocks of length r.

For each direction (DiSAN's forward and backward masks, :mod:`attnkit.patterns.directional`):

1. intra-block: masked self-attention inside each block, h = mSA(x_block, M);
2. block summary: source-to-token attention over each block, v_l = s2t(h_block_l);
3. inter-block: masked self-attention over the block summaries, o = mSA(v, M), and a gate
   G = σ(W_g1 o + W_g2 v + b_g), e = G ⊙ o + (1 − G) ⊙ v;
4. context fusion: e_l is repeated over its block (E), and with
   F = σ(W_f1 [x; h; E] + b_f1), H = σ_r(W_f2 [x; h; E] + b_f2): u = F ⊙ H + (1 − F) ⊙ x.

The output is [u_forward ; u_backward] (B, N, 2d). Scores are additive (token-to-token,
e_ij = wᵀ tanh(W₁ x_i + W₂ x_j + b)); the paper's multi-dimensional (feature-wise) variant is
not used here. Padding positions (a mask (B, 1, N)) are neither attended nor summarised, so
padding equals truncation.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, masks, patterns
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive

__all__ = ["BiBloSA", "BiBloSAOutput"]


class BiBloSAOutput(NamedTuple):
    """The encoded sequence (B, N, 2d) and, with ``need_weights=True``, the weights by name:
    ``{direction}.intra`` (B, m, r, r), ``{direction}.summary`` (B, m, 1, r) and
    ``{direction}.inter`` (B, m, m) for direction forward and backward (m blocks of r)."""

    output: Tensor
    weights: dict[str, Tensor]

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return dict(self.weights)


class _Direction(nn.Module):
    """One direction of Bi-BloSA: intra-block mSA, block summaries, inter-block mSA with its
    gate, and the context fusion gate."""

    def __init__(self, d: int, d_w: int, direction) -> None:
        super().__init__()
        self.direction = direction
        self.intra = Attention(Additive(d, d, d_w), "softmax")
        self.summary = Attention(Additive(None, d, d_w), "softmax")
        self.inter = Attention(Additive(d, d, d_w), "softmax")
        self.gate_o = nn.Linear(d, d)
        self.gate_v = nn.Linear(d, d, bias=False)
        self.fuse_gate = nn.Linear(3 * d, d)
        self.fuse = nn.Linear(3 * d, d)

    def forward(self, x: Tensor, keep: Tensor, r: int, want: bool):
        b, n, d = x.shape
        m = -(-n // r)
        xb = F.pad(x, (0, 0, 0, m * r - n)).reshape(b, m, r, d)
        kb = F.pad(keep, (0, m * r - n)).reshape(b, m, 1, r)
        inside = patterns.dense(self.direction, r, r)  # (r, r) directional mask in a block
        intra = self.intra(xb, xb, mask=inside & kb, need_weights=want)
        h = intra.context  # (B, m, r, d)
        summary = self.summary(None, h, mask=kb, need_weights=want)
        v = summary.context[:, :, 0]  # (B, m, d); a block with no real token gives 0
        block_ok = kb.any(-1).reshape(b, 1, m)
        across = patterns.dense(self.direction, m, m)
        inter = self.inter(v, v, mask=across & block_ok, need_weights=want)
        o = inter.context
        g = torch.sigmoid(self.gate_o(o) + self.gate_v(v))
        e = g * o + (1 - g) * v  # (B, m, d)
        big_e = e[:, :, None].expand(b, m, r, d).reshape(b, m * r, d)[:, :n]
        cat = torch.cat([x, h.reshape(b, m * r, d)[:, :n], big_e], -1)
        f = torch.sigmoid(self.fuse_gate(cat))
        u = f * F.elu(self.fuse(cat)) + (1 - f) * x
        weights = {}
        if want:
            weights = {"intra": intra.weights, "summary": summary.weights, "inter": inter.weights}
        return u, weights


@REGISTRY.register("biblosa")
class BiBloSA(nn.Module):
    """Bi-BloSA: block self-attention in both directions (forward and backward masks), with
    inter-block attention over block summaries and fusion gates.

    Args:
        d: token size.
        block_size: r, the block length (the paper picks r ≈ (2N)^{1/3}).
        d_w: hidden size of the additive scores (default d).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(self, d: int, block_size: int, d_w: int | None = None) -> None:
        super().__init__()
        arguments.positive_int(d, "d")
        self.block_size = arguments.positive_int(block_size, "block_size")
        arguments.optional_positive_int(d_w, "d_w")
        d_w = d if d_w is None else d_w
        self.d = d
        self.forward_direction = _Direction(d, d_w, patterns.forward())
        self.backward_direction = _Direction(d, d_w, patterns.backward())

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([8, 5]), 8)
        return cls(4, 3), (example_tensor(2, 8, 4, seed=21),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE, tx.FeatureLevels.HIERARCHICAL]

    def extra_repr(self) -> str:
        return f"d={self.d}, block_size={self.block_size}"

    def forward(
        self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> BiBloSAOutput:
        arguments.boolean(need_weights, "need_weights")
        x, keep = masks.padding_only(x, self.d, mask, f"BiBloSA(d={self.d})")
        outputs, weights = [], {}
        for name, part in (
            ("forward", self.forward_direction),
            ("backward", self.backward_direction),
        ):
            u, w = part(x, keep, self.block_size, need_weights)
            outputs.append(u)
            weights.update({f"{name}.{k}": v for k, v in w.items()})
        return BiBloSAOutput(torch.cat(outputs, -1), weights)
