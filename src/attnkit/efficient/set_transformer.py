"""Set Transformer (Lee, Lee, Kim, Kosiorek, Choi and Teh, "Set Transformer: A Framework for
Attention-based Permutation-Invariant Neural Networks", ICML 2019; Soydaner 5.3).

Every block is built from one multihead attention block (paper eqs. 6-7):

    MAB(X, Y) = LayerNorm(H + rFF(H)),   H = LayerNorm(X + Multihead(X, Y, Y)),

with rFF a row-wise feed-forward layer (here Linear → ReLU → Linear) and Multihead an
:class:`attnkit.MultiHeadAttention`, so any score, alignment or per-head attention part plugs in.

- SAB(X) = MAB(X, X) (eq. 8): set self-attention, O(N²), permutation-equivariant.
- ISAB_m(X) = MAB(X, H), H = MAB(I, X) (eqs. 9-10): m learned inducing points I attend to the
  set, then the set attends to them: O(N·m), permutation-equivariant.
- PMA_k(Z) = MAB(S, rFF(Z)) (eq. 11): k learned seed vectors S pool the set into k vectors,
  permutation-invariant.

Key-padding masks (B, 1, N), True = a real element, mark the elements of each set; a masked
element is removed from the set (it is never attended to). Rows of a per-element output at padded
positions are padding.
"""

from __future__ import annotations

import copy
import math
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.multihead import MultiHeadAttention
from attnkit.scores import Score

__all__ = ["ISAB", "MAB", "PMA", "SAB", "ISABOutput", "SetOutput"]


class SetOutput(NamedTuple):
    """A block's output (B, M, d) and, on request, its attention weights (B, H, M, N)."""

    output: Tensor
    weights: Tensor | None = None

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {} if self.weights is None else {"weights": self.weights}


class ISABOutput(NamedTuple):
    """ISAB's output (B, N, d), the induced set H (B, m, d) and, on request, the weights of the
    inducing points over the set (B, H, m, N) and of the set over H (B, H, N, m)."""

    output: Tensor
    induced: Tensor
    inducing_weights: Tensor | None = None
    output_weights: Tensor | None = None

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        named = {"inducing": self.inducing_weights, "output": self.output_weights}
        return {k: w for k, w in named.items() if w is not None}


def _row_ff(d: int, d_ff: int, kw: dict) -> nn.Sequential:
    """rFF: the same two-layer perceptron applied to every row."""
    return nn.Sequential(nn.Linear(d, d_ff, **kw), nn.ReLU(), nn.Linear(d_ff, d, **kw))


def _check_set(x: Tensor, d: int, name: str, who: str) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"{who}: {name} must be a floating tensor, got {type(x).__name__}")
    if x.dim() < 2 or x.shape[-1] != d:
        raise ValueError(f"{who}: {name} must be (B, …, n, {d}), got shape {tuple(x.shape)}")


def _key_padding(mask: Tensor | None, x: Tensor, who: str) -> Tensor | None:
    """Check that ``mask`` marks the elements of the set x (…, N, d): (…, 1, N) boolean."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"{who}: mask must be a boolean tensor, got {getattr(mask, 'dtype', mask)}")
    if mask.dim() < 2 or mask.shape[-2] != 1:
        raise ValueError(
            f"{who}: mask must be a key-padding mask (…, 1, N) over the set's elements (the "
            f"queries are learned vectors, not the elements), got shape {tuple(mask.shape)}"
        )
    masks.check(mask, torch.Size((*x.shape[:-2], 1, x.shape[-2])))
    return mask


@REGISTRY.register("set_mab")
class MAB(nn.Module):
    """Multihead attention block MAB(X, Y) = LayerNorm(H + rFF(H)), H = LayerNorm(X +
    Multihead(X, Y, Y)) (Lee et al. eqs. 6-7).

    Args:
        embed_dim: d, the size of X, Y and the output.
        num_heads: heads of the multihead attention.
        d_ff: hidden size of rFF (default d).
        score, align, attention: the attention of :class:`attnkit.MultiHeadAttention`.

    ``forward(x, y, mask=None, need_weights=False)``: x (B, …, M, d), y (B, …, N, d), mask over
    y's elements as for :class:`attnkit.MultiHeadAttention` (e.g. (B, 1, N)) → output (B, …, M, d).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("y",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        attention: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        d_ff = embed_dim if d_ff is None else arguments.positive_int(d_ff, "d_ff")
        kw = {"device": device, "dtype": dtype}
        self.attention = MultiHeadAttention(
            embed_dim, num_heads, score, align, attention=attention, **kw
        )
        self.norm1 = nn.LayerNorm(embed_dim, **kw)
        self.ff = _row_ff(embed_dim, d_ff, kw)
        self.norm2 = nn.LayerNorm(embed_dim, **kw)

    @classmethod
    def example(cls):
        x, y = example_tensor(2, 3, 8, seed=40), example_tensor(2, 6, 8, seed=41)
        return cls(8, 2), (x, y), {"mask": masks.from_lengths(torch.tensor([6, 4]), 6)}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.BASIC]

    def forward(
        self, x: Tensor, y: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> SetOutput:
        who = type(self).__name__
        _check_set(x, self.embed_dim, "x", who)
        _check_set(y, self.embed_dim, "y", who)
        out = self.attention(x, y, y, mask=mask, need_weights=need_weights)
        h = self.norm1(x + out.context)
        return SetOutput(self.norm2(h + self.ff(h)), out.weights)


def _seeds(n: int, d: int, kw: dict) -> nn.Parameter:
    """n learned d-vectors, initialised like the rows of a Xavier-uniform matrix."""
    bound = math.sqrt(6.0 / (n + d))
    return nn.Parameter(torch.empty(n, d, **kw).uniform_(-bound, bound))


@REGISTRY.register("set_sab")
class SAB(nn.Module):
    """Set attention block SAB(X) = MAB(X, X) (Lee et al. eq. 8): permutation-equivariant.

    Args as :class:`MAB`. ``forward(x, mask=None, need_weights=False)``: x (B, …, N, d), a
    key-padding mask (B, 1, N) (or any mask :class:`attnkit.MultiHeadAttention` takes) →
    (B, …, N, d).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        attention: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.mab = MAB(
            embed_dim,
            num_heads,
            d_ff,
            score=score,
            align=align,
            attention=attention,
            device=device,
            dtype=dtype,
        )

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)
        return cls(8, 2), (example_tensor(2, 6, 8, seed=42),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SELF_ATTENTIVE]

    def forward(
        self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> SetOutput:
        return self.mab(x, x, mask=mask, need_weights=need_weights)


@REGISTRY.register("set_isab")
class ISAB(nn.Module):
    """Induced set attention block ISAB_m(X) = MAB(X, H), H = MAB(I, X) (Lee et al. eqs. 9-10):
    m learned inducing points, O(N·m) instead of O(N²), permutation-equivariant.

    Args:
        embed_dim, num_heads, d_ff, score, align: as :class:`MAB`.
        num_inducing: m, the number of inducing points.
        attention: a per-head attention part; the second MAB gets its own copy.

    ``forward(x, mask=None, need_weights=False)``: x (B, …, N, d), key-padding mask (B, 1, N)
    (applied where X is attended to, in H = MAB(I, X); padded elements' own rows attend to
    nothing in MAB(X, H)) → (B, …, N, d) and H (B, …, m, d).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_inducing: int,
        d_ff: int | None = None,
        *,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        attention: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_inducing = arguments.positive_int(num_inducing, "num_inducing")
        kw = {"device": device, "dtype": dtype}
        parts = {"score": score, "align": align}

        def own(part):  # each MAB gets its own copy of a module part (no shared parameters)
            return part if isinstance(part, str) or part is None else copy.deepcopy(part)

        self.inducing = _seeds(num_inducing, embed_dim, kw)
        self.induce = MAB(embed_dim, num_heads, d_ff, **parts, attention=attention, **kw)
        parts = {k: own(v) for k, v in parts.items()}
        self.broadcast = MAB(embed_dim, num_heads, d_ff, **parts, attention=own(attention), **kw)

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)
        return cls(8, 2, 3), (example_tensor(2, 6, 8, seed=43),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SPECIALIZED]

    def forward(
        self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> ISABOutput:
        who = type(self).__name__
        _check_set(x, self.embed_dim, "x", who)
        mask = _key_padding(mask, x, who)
        inducing = self.inducing.to(x.dtype).expand(*x.shape[:-2], -1, -1)
        h = self.induce(inducing, x, mask=mask, need_weights=need_weights)
        # Padded elements, as queries, attend to nothing (weights 0): their rows are padding.
        rows = None if mask is None else mask.transpose(-1, -2)
        out = self.broadcast(x, h.output, mask=rows, need_weights=need_weights)
        return ISABOutput(out.output, h.output, h.weights, out.weights)


@REGISTRY.register("set_pma")
class PMA(nn.Module):
    """Pooling by multihead attention PMA_k(Z) = MAB(S, rFF(Z)) (Lee et al. eq. 11): k learned
    seed vectors S pool the set; permutation-invariant.

    Args:
        embed_dim, num_heads, d_ff, score, align, attention: as :class:`MAB`.
        num_seeds: k, the number of output vectors.

    ``forward(z, mask=None, need_weights=False)``: z (B, …, N, d), key-padding mask (B, 1, N) →
    (B, …, k, d).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("z",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_seeds: int = 1,
        d_ff: int | None = None,
        *,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        attention: nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_seeds = arguments.positive_int(num_seeds, "num_seeds")
        d_ff = embed_dim if d_ff is None else arguments.positive_int(d_ff, "d_ff")
        kw = {"device": device, "dtype": dtype}
        self.seeds = _seeds(num_seeds, embed_dim, kw)
        self.ff = _row_ff(embed_dim, d_ff, kw)
        self.mab = MAB(
            embed_dim, num_heads, d_ff, score=score, align=align, attention=attention, **kw
        )

    @classmethod
    def example(cls):
        mask = masks.from_lengths(torch.tensor([6, 4]), 6)
        return cls(8, 2, 2), (example_tensor(2, 6, 8, seed=44),), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryType.SPECIALIZED]

    def forward(
        self, z: Tensor, mask: Tensor | None = None, need_weights: bool = False
    ) -> SetOutput:
        who = type(self).__name__
        _check_set(z, self.embed_dim, "z", who)
        mask = _key_padding(mask, z, who)
        seeds = self.seeds.to(z.dtype).expand(*z.shape[:-2], -1, -1)
        return self.mab(seeds, self.ff(z), mask=mask, need_weights=need_weights)
