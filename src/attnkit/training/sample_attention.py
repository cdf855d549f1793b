"""Attention over training samples, for outlier detection and sample weighting (Galassi VI-B).

Galassi et al. propose attending over all the samples that belong to a class, e.g. to build a
representative embedding of the class: the samples that receive small weights can be regarded
as outliers with respect to their class, and the weights can weight each sample's contribution
to learning. Gao et al. (2019, "Hybrid Attention-Based Prototypical Networks for Noisy Few-Shot
Relation Classification") use such instance-level attention to build class prototypes that are
robust to mislabelled support samples.

:class:`SampleAttention` holds one learned query q_c per class in a learned key space; sample s
of class c scores e_cs = −‖q_c − W x_s‖ (Euclidean score, Galassi Table IV) and the weights are
a softmax over the samples labelled c only. The class prototype is the weighted mean
p_c = Σ_s a_cs x_s. :meth:`SampleAttention.prototype_loss` trains it with a bounded loss of
each sample's distance to its (noisy) class's prototype: the clean majority of a class pulls
the prototype — and so the attention — towards itself, and samples that do not look like their
class lose weight.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.core import Attention
from attnkit.scores import Euclidean

__all__ = ["SampleAttention", "SampleAttentionOutput"]


class SampleAttentionOutput(NamedTuple):
    """prototypes (C, d): the weighted class means; weights (C, S): each class's weights over
    the samples (0 outside the class); sample_weights (S,): each sample's weight in its class
    times the class size, so a uniform attention gives 1 everywhere (a weight for its loss)."""

    prototypes: Tensor
    weights: Tensor
    sample_weights: Tensor


class SampleAttention(nn.Module):
    """A learned query per class attending over the samples of that class.

    Args:
        features: the size d of a sample's features.
        classes: the number of classes C.
        key_dim: the size of the key space (W: d → key_dim); ``features`` by default.
        device, dtype: the parameters'.
    """

    def __init__(
        self,
        features: int,
        classes: int,
        key_dim: int | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(features=features, classes=classes)
        key_dim = features if key_dim is None else arguments.positive_int(key_dim, "key_dim")
        self.features, self.classes = features, classes
        kw = {"device": device, "dtype": dtype}
        self.key = nn.Linear(features, key_dim, bias=False, **kw)
        self.queries = nn.Parameter(torch.zeros(classes, key_dim, **kw))
        self.attention = Attention(score=Euclidean(), align=Softmax())
        # Small keys and zero queries: the weights start near uniform (the class mean), and
        # the attention learns where each class's samples gather.
        nn.init.normal_(self.key.weight, std=0.01)

    def taxonomy_tags(self) -> list:
        # a learned query (Brauwers eq. 34) per class, as capsule-based attention (Sec. 3.3.2)
        return [tx.QueryType.SELF_ATTENTIVE, tx.QueryMultiplicity.CAPSULE_BASED]

    def _check(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        x = checks.floating(x, "x", "(S, features)", min_dim=2)
        if x.dim() != 2 or x.shape[-1] != self.features:
            raise ValueError(
                f"x must be (S, {self.features}) (one row per sample), got {tuple(x.shape)}"
            )
        if not isinstance(labels, Tensor) or labels.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"labels must be an integer tensor (S,), got {labels!r}")
        if tuple(labels.shape) != (x.shape[0],):
            raise ValueError(f"labels must be ({x.shape[0]},), got {tuple(labels.shape)}")
        if bool(((labels < 0) | (labels >= self.classes)).any()):
            raise ValueError(f"labels must lie in [0, {self.classes})")
        return x, labels.long()

    def forward(self, x: Tensor, labels: Tensor) -> SampleAttentionOutput:
        """Attend over the samples x (S, d), labelled ``labels`` (S,) in [0, C). A class without
        samples has weights 0 and prototype 0."""
        x, labels = self._check(x, labels)
        members = labels.unsqueeze(0) == torch.arange(self.classes, device=labels.device)[:, None]
        out = self.attention(
            self.queries.unsqueeze(0),
            self.key(x).unsqueeze(0),
            x.unsqueeze(0),
            mask=members.unsqueeze(0),
            need_weights=True,
        )
        weights = out.weights.squeeze(0)  # (C, S)
        size = members.sum(-1).to(x.dtype)  # (C,)
        own = weights.gather(0, labels.unsqueeze(0)).squeeze(0)
        return SampleAttentionOutput(out.context.squeeze(0), weights, own * size[labels])

    def prototype_loss(self, x: Tensor, labels: Tensor, *, scale: float = 1.0) -> Tensor:
        """The mean over samples of the bounded (Welsch, correntropy-induced) loss
        1 − exp(−‖x_s − p_{y_s}‖² / (2·scale²)) of each sample against its class prototype
        (:meth:`forward`, built from the same samples).

        A bounded loss is what makes the attention robust: a sample far from its class — a
        mislabelled one — costs about 1 wherever the prototype is, so it exerts no pull, and
        the prototype (the attention) settles on the clean majority. (Cross-entropy would do
        the opposite: its gradient is largest for the samples it misclassifies.) ``scale`` is
        the spread of a class, about the root mean squared distance of its samples to their
        centre."""
        x, labels = self._check(x, labels)
        scale = arguments.finite_float(scale, "scale", positive=True)
        prototypes = self(x, labels).prototypes
        distance = (x - prototypes[labels]).pow(2).sum(-1)
        return (1 - torch.exp(-distance / (2 * scale * scale))).mean()
