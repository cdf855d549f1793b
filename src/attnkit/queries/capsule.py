"""Capsule-based attention (Wang et al.; Brauwers 3.3.2, Fig. 11, eqs. 43-45)."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import checks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.features._pooling import key_mask, masked_mean
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = ["CapsuleAttention", "CapsuleOutput", "capsule_loss"]


class CapsuleOutput(NamedTuple):
    """Per class c: probability p_c (B, C), context c_c (B, C, d_v), representation r_c
    (B, C, d_v), weights (B, C, n)."""

    probabilities: Tensor
    contexts: Tensor
    representations: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        """The capsules' representations r_c (B, C, d_v)."""
        return self.representations

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("capsule")
class CapsuleAttention(nn.Module):
    """One capsule per class: a learned query q_c with e_{c,l} = q_cᵀ k_l (eq. 43), context c_c,
    probability p_c = σ(w_cᵀ c_c + b_c) (eq. 44), representation r_c = p_c c_c (eq. 45).

    Keys and values are the features (d_k = d_v = d_f), as the reconstruction loss compares r_c
    with the mean feature vector. The C queries attend through :class:`attnkit.Attention` with
    the dot score and ``align`` (softmax by default).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("features",)}

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(3 capsules over 4 features, (features (2, 5, 4),), a mask)."""
        mask = masks.from_lengths(torch.tensor([5, 2]), 5)
        return cls(4, 3), (example_tensor(2, 5, 4, seed=1),), {"mask": mask}

    def __init__(
        self,
        d_f: int,
        n_classes: int,
        *,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d_f=d_f, n_classes=n_classes)
        self.d_f, self.n_classes = d_f, n_classes
        kw = {"device": device, "dtype": dtype}
        self.queries = nn.Parameter(torch.randn(n_classes, d_f, **kw) / d_f**0.5)
        self.w = nn.Parameter(torch.randn(n_classes, d_f, **kw) / d_f**0.5)
        self.b = nn.Parameter(torch.zeros(n_classes, **kw))
        self.attention = Attention("dot", align)

    def taxonomy_tags(self) -> list:
        return [
            tx.QueryMultiplicity.CAPSULE_BASED,
            tx.QueryType.SELF_ATTENTIVE,
            tx.Scoring.MULTIPLICATIVE,
        ]

    def forward(self, features: Tensor, mask: Tensor | None = None) -> CapsuleOutput:
        """features (B, n, d_f); mask None, (B, n) or (B, 1, n) boolean, True = a real feature."""
        features = checks.features(features, "features", self.d_f, what="d_f")
        checks.part_matches(self, "CapsuleAttention", "features", features)
        mask = checks.feature_mask(mask, features, "mask", "features")
        features = checks.without_padding(features, mask)
        q = self.queries.expand(features.shape[0], *self.queries.shape)
        out = self.attention(q, features, features, mask=key_mask(mask), need_weights=True)
        a, c = out.weights, out.context  # e_{c,l} = q_cᵀ k_l (eq. 43); c_c (B, C, d)
        p = torch.sigmoid((c * self.w).sum(-1) + self.b)  # eq. 44
        return CapsuleOutput(p, c, p.unsqueeze(-1) * c, a)  # eq. 45


def capsule_loss(
    out: CapsuleOutput,
    features: Tensor,
    target: Tensor,
    mask: Tensor | None = None,
    reconstruction_weight: float = 1.0,
) -> Tensor:
    """Joint loss of capsule attention: binary cross-entropy of p against the one-hot target,
    plus a hinge on the dot product between each r_c and the mean feature vector f̄ (unit
    length): the true class's r_c should align with f̄ (max(0, 1 − r_yᵀf̄)), the others not
    (max(0, r_cᵀf̄)). Averaged over the batch.

    ``target``: (B,) class indices in [0, C); ``features`` and ``mask`` as the forward call."""
    n_classes = out.probabilities.shape[-1]
    if (
        not isinstance(target, Tensor)
        or target.dtype.is_floating_point
        or target.dtype == torch.bool
    ):
        what = target.dtype if isinstance(target, Tensor) else type(target).__name__
        raise TypeError(f"target must be an integer tensor of class indices (B,), got {what}")
    if target.shape != out.probabilities.shape[:1]:
        raise ValueError(
            f"target of shape {tuple(target.shape)} must be (B,) with "
            f"B = {out.probabilities.shape[0]}"
        )
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= n_classes):
        raise ValueError(f"target holds classes outside [0, {n_classes}): {target.tolist()}")
    mask = checks.feature_mask(mask, features, "mask", "features")
    features = checks.without_padding(features, mask)
    onehot = F.one_hot(target, out.probabilities.shape[-1]).to(out.probabilities.dtype)
    bce = F.binary_cross_entropy(out.probabilities, onehot)
    f = F.normalize(masked_mean(features, mask), dim=-1)
    sim = torch.einsum(
        "bcd,bd->bc",
        F.normalize(out.representations, dim=-1, eps=1e-8) * out.probabilities.unsqueeze(-1),
        f,
    )
    hinge = onehot * F.relu(1 - sim) + (1 - onehot) * F.relu(sim)
    return bce + reconstruction_weight * hinge.sum(-1).mean()
