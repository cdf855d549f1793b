"""The names of :mod:`attnkit.integrations.transformers_masks` (the model's masks in attnkit's
form) and :mod:`attnkit.integrations.transformers_score` (the model's own score) under this
module's earlier name. The swap's calls go through the kernels' direct entry
(:meth:`attnkit.kernels.Kernel.direct`), as a layer's do."""

from __future__ import annotations

from attnkit.integrations.transformers_masks import eager_mask, split_mask
from attnkit.integrations.transformers_score import ModelScaledDot, model_score

__all__ = ["ModelScaledDot", "eager_mask", "model_score", "split_mask"]
