"""Channel attention for feature maps (Wikipedia "Variants": CNN attention; Soydaner Sec. 5):
squeeze-and-excitation (Hu et al. 2018) and the channel branch of CBAM (Woo et al. 2018).

Each channel c of a feature map U (B, C, H, W) is pooled to a descriptor z_c — the mean
(SE eq. 2) and, for CBAM, also the max —; a shared two-layer network scores the descriptor and a
sigmoid turns the score into the channel's weight, s = σ(Σ_pools W_2 δ(W_1 z)) (SE eq. 3,
CBAM eq. 2); the output is s_c · u_c (SE eq. 4).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, hooks, inputs
from attnkit import taxonomy as tx
from attnkit.alignments import Sigmoid
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["ChannelAttention", "ChannelAttentionOutput", "feature_map"]

_POOLS = {"avg": lambda u: u.mean((-1, -2)), "max": lambda u: u.amax((-1, -2))}


def feature_map(x: object, name: str, channels: int | None = None) -> Tensor:
    """Check a feature map (B, C, H, W): floating, 4 dims, ``channels`` channels if given."""
    x = inputs.tensor(x, name, min_dim=1)
    if x.dim() != 4:
        raise ValueError(f"{name} must be a feature map (B, C, H, W), got shape {tuple(x.shape)}")
    if channels is not None and x.shape[1] != channels:
        raise ValueError(
            f"{name} has {x.shape[1]} channels (shape {tuple(x.shape)}) but the module was built "
            f"for channels = {channels}"
        )
    return x


class ChannelAttentionOutput(NamedTuple):
    """The reweighted map s ⊙ U (B, C, H, W) and the channel weights s (B, C)."""

    output: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("channel_attention")
class ChannelAttention(nn.Module):
    """Squeeze-and-excitation (``pools=("avg",)``, Hu et al. eqs. 2-4) or CBAM's channel
    attention (``pools=("avg", "max")``, Woo et al. eq. 2).

    Args:
        channels: C.
        reduction: r, the hidden layer has max(1, C // r) units.
        pools: the channel descriptors, each scored by the same network, scores summed.
        align: turns the scores into weights (default sigmoid: channels do not compete).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init__(
        self,
        channels: int,
        reduction: int = 16,
        *,
        pools: tuple[str, ...] = ("avg",),
        align: str | nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(channels=channels, reduction=reduction)
        pools = tuple(pools)
        if not pools or any(p not in _POOLS for p in pools) or len(set(pools)) != len(pools):
            raise ValueError(f"pools must be distinct names from {sorted(_POOLS)}, got {pools!r}")
        kw = {"device": device, "dtype": dtype}
        hidden = max(1, channels // reduction)
        self.channels, self.pools = channels, pools
        self.fc1 = nn.Linear(channels, hidden, **kw)  # W_1
        self.fc2 = nn.Linear(hidden, channels, **kw)  # W_2
        self.align = (
            Sigmoid()
            if align is None
            else checks.resolve_alignment(align, device=device, dtype=dtype)
        )

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(CBAM's pools, C = 6, r = 2; x (2, 6, 3, 4))."""
        return cls(6, 2, pools=("avg", "max")), (example_tensor(2, 6, 3, 4),), {}

    def taxonomy_tags(self) -> list:
        # A feed-forward score of the (pooled) features: the additive family (Brauwers Table II),
        # with no query but the features themselves.
        return [tx.Scoring.ADDITIVE, tx.QueryType.SELF_ATTENTIVE]

    def scores(self, x: Tensor) -> Tensor:
        """Σ_pools W_2 δ(W_1 z) (B, C)."""
        return sum(self.fc2(torch.relu(self.fc1(_POOLS[p](x)))) for p in self.pools)

    def forward(self, x: Tensor) -> ChannelAttentionOutput:
        """x (B, C, H, W) → s ⊙ x, s (B, C)."""
        x = feature_map(x, "x", self.channels)
        s = self.align(self.scores(x).unsqueeze(-2)).weights.squeeze(-2)
        hooks.report(self, s)
        return ChannelAttentionOutput(x * s[..., None, None], s)
