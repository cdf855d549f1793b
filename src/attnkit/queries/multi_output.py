"""Multiple outputs (Galassi IV-D1): an importance matrix gives several distributions over the
same keys at once (Lin et al.), with the Frobenius penalty ‖AAᵀ − I‖²_F; label-wise attention is
the same with one distribution per label."""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import checks, hooks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.checks import resolve_alignment
from attnkit.features._pooling import key_mask
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive

__all__ = ["ImportanceMatrixAttention", "LabelWiseAttention", "MultiOutput", "frobenius_penalty"]


class MultiOutput(NamedTuple):
    """Context matrix C = A V (B, r, d_v) and weights A (B, r, n)."""

    contexts: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        """The r context vectors C (B, r, d_v)."""
        return self.contexts

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("importance_matrix")
class ImportanceMatrixAttention(nn.Module):
    """A = align(W_imp act(W k_l + b)) with W_imp ∈ R^{r×d_w}: r self-attentive distributions over
    the n keys (Lin et al.'s structured self-attention), C = A V.

    The score is the additive self-attentive score with r outputs (``Additive(None, d_k, d_w,
    d_out=r)``), aligned over keys separately for each of the r rows; the weights are reported
    to :mod:`attnkit.hooks`.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("keys", "values")}

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(3 distributions, (keys (2, 6, 4), values (2, 6, 2)), a mask)."""
        args = (example_tensor(2, 6, 4, seed=1), example_tensor(2, 6, 2, seed=2))
        return cls(4, 5, 3), args, {"mask": masks.from_lengths(torch.tensor([6, 3]), 6)}

    def __init__(
        self,
        d_k: int,
        d_w: int,
        n_outputs: int,
        *,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d_k=d_k, d_w=d_w, n_outputs=n_outputs)
        self.d_k = d_k
        self.score = Additive(None, d_k, d_w, d_out=n_outputs, device=device, dtype=dtype)
        self.align = resolve_alignment(align, device=device, dtype=dtype)

    # Several distributions, one weight per key each: single-dimensional attention with
    # multiple outputs, although the score has r outputs per key.
    taxonomy_final = (tx.Dimensionality,)

    def taxonomy_tags(self) -> list:
        return [tx.Dimensionality.SINGLE]

    def forward(
        self, keys: Tensor, values: Tensor | None = None, mask: Tensor | None = None
    ) -> MultiOutput:
        """keys (B, n, d_k); values (B, n, d_v) (default keys); mask None, (B, n) or (B, 1, n)
        boolean, True = a real key."""
        keys = checks.features(keys, "keys", self.d_k, what="d_k")
        values = keys if values is None else checks.features(values, "values")
        checks.same_batch(("keys", keys), ("values", values))
        checks.part_matches(self, type(self).__name__, "keys", keys)
        if values.shape[-2] != keys.shape[-2]:
            raise ValueError(
                f"values has {values.shape[-2]} rows (shape {tuple(values.shape)}) but keys has "
                f"{keys.shape[-2]} (shape {tuple(keys.shape)}); they must match"
            )
        mask = checks.feature_mask(mask, keys, "mask", "keys")
        keys = checks.without_padding(keys, mask)
        values = checks.without_padding(values, mask)
        e = self.score(None, keys).squeeze(-3).transpose(-1, -2)  # (B, r, n)
        a = self.align(e, key_mask(mask)).weights
        hooks.report(self, a)
        return MultiOutput(a @ values, a)


@REGISTRY.register("label_wise")
class LabelWiseAttention(ImportanceMatrixAttention):
    """One attention distribution per label (Galassi IV-D1): an importance matrix with
    ``n_labels`` rows."""

    def __init__(
        self,
        d_k: int,
        d_w: int,
        n_labels: int,
        *,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        sizes(n_labels=n_labels)
        super().__init__(d_k, d_w, n_labels, align=align, device=device, dtype=dtype)


def frobenius_penalty(weights: Tensor) -> Tensor:
    """‖A Aᵀ − I‖²_F per batch item, averaged (Lin et al.): pushes the r distributions apart.

    ``weights``: A, (B, r, n) or (r, n)."""
    checks.tensor(weights, "weights", min_dim=2)
    r = weights.shape[-2]
    eye = torch.eye(r, dtype=weights.dtype, device=weights.device)
    gram = weights @ weights.transpose(-1, -2)
    return ((gram - eye) ** 2).sum(dim=(-1, -2)).mean()
