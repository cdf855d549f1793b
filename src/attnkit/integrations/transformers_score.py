"""The score of a transformers model's own attention, for
:func:`attnkit.integrations.transformers.swap_attention`: s · qᵀk with the model's ``scaling``,
one parameter-free instance per scale, built once (not resolved by name on every call)."""

from __future__ import annotations

from attnkit.scores.multiplicative import FixedScaleDot

__all__ = ["ModelScaledDot", "model_score"]


class ModelScaledDot(FixedScaleDot):
    """The score of a transformers model's own attention: e_l = s · qᵀ k_l (Brauwers Table II,
    scaled multiplicative) with the model's ``scaling`` s (1/√d for most models, 1 for T5,
    1/(√d · (layer + 1)) for GPT-2 with ``scale_attn_by_inverse_layer_idx``).

    The product is formed as the model's eager attention forms it, (qᵀk) · s, and SDPA gets s as
    its ``scale`` as the model's SDPA attention does. Not registered: :func:`model_score` builds
    it for the swap.

    Args:
        scale: s, the model's ``scaling``.
    """


_SCORES: dict[float, ModelScaledDot] = {}


def model_score(scaling: float | None, head_dim: int) -> ModelScaledDot:
    """The :class:`ModelScaledDot` of scale ``scaling`` (``head_dim ** -0.5`` when None), one
    instance per scale (it has neither parameters nor buffers, so every layer and device can
    share it)."""
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    score = _SCORES.get(scale)
    if score is None:
        score = _SCORES[scale] = ModelScaledDot(scale)
    return score
