"""Query-key normalisation: each head's queries and keys are normalised over their features
before the score, so that the logits stay bounded (Henry et al. 2020, "Query-Key Normalization
for Transformers"; Dehghani et al. 2023, "Scaling Vision Transformers to 22 Billion Parameters",
sec. 2.1, with LayerNorm; RMSNorm in OLMo 2 and Qwen3):

    q̂ = γ_q ⊙ q / RMS(q),  RMS(q) = sqrt(mean_i q_i² + ε)                     (RMSNorm)
    q̂ = γ_q ⊙ (q − mean(q)) / sqrt(var(q) + ε) + β_q                          (LayerNorm)

(likewise k̂ with its own γ_k, β_k), then the inner attention part scores q̂ against k̂.

As a per-head part it sees q and k after the layer's position scheme: inside a layer with RoPE
it normalises the rotated q and k. For the order of Qwen3, Gemma 3 and OLMo 2 (normalise, then
rotate) put the norm in the layer's q/k chain instead (:mod:`attnkit.qk_chain`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments, hooks
from attnkit import taxonomy as tx
from attnkit.core import Attention
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput
from attnkit.slots import attention_part

__all__ = ["QKNormAttention"]

_NORMS = {"rms": nn.RMSNorm, "layer": nn.LayerNorm}


@REGISTRY.register("qk_norm")
class QKNormAttention(HeadAttention):
    """Normalise q and k per head over their d features, then attend with ``attention``: a
    per-head part ``part(q, k, v, *, mask, bias, need_weights)`` with q (B, …, H, M, d).

    Args:
        head_dim: d.
        norm: ``"rms"`` (RMSNorm) or ``"layer"`` (LayerNorm), with learned gains (and biases).
        eps: ε of the norm.
        attention: the inner per-head part; default ``Attention("scaled_dot", "softmax")``.
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim"}

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("k", "v")}
    takes_facts: ClassVar[bool] = True  # the inner call takes the caller's checked and finite

    def __init__(
        self,
        head_dim: int,
        *,
        norm: str = "rms",
        eps: float = 1e-6,
        attention: nn.Module | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        if norm not in _NORMS:
            raise ValueError(f"norm must be one of {sorted(_NORMS)}, got {norm!r}")
        eps = arguments.finite_float(eps, "eps", positive=True)
        self.norm = norm
        self.q_norm = _NORMS[norm](head_dim, eps=eps, device=device, dtype=dtype)
        self.k_norm = _NORMS[norm](head_dim, eps=eps, device=device, dtype=dtype)
        self.attention = attention_part(
            Attention("scaled_dot", "softmax") if attention is None else attention
        )

    @property
    def decodes_with_cache(self) -> bool:
        return bool(getattr(self.attention, "decodes_with_cache", False))

    @property
    def takes_q_offset(self) -> bool:
        return bool(getattr(self.attention, "takes_q_offset", False))

    @property
    def mixes_queries(self) -> bool:
        return bool(getattr(self.attention, "mixes_queries", False))

    # the other capabilities are the inner part's too (attnkit.head.HeadAttention)
    @property
    def causal_form(self) -> bool:
        return self.attention.causal_form

    @property
    def accepts_bias(self) -> bool:
        return self.attention.accepts_bias

    @property
    def mask_forms(self) -> frozenset[str]:
        return self.attention.mask_forms

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 5, 4, seed=s) for s in (60, 61, 62))
        mask = (torch.arange(5)[None, :] < torch.tensor([5, 3])[:, None])[:, None, None, :]
        module = cls(4)
        with torch.no_grad():  # gains other than 1, so that the test sees them act
            module.q_norm.weight.uniform_(0.5, 1.5)
            module.k_norm.weight.uniform_(0.5, 1.5)
        return module, (q, k, v), {"mask": mask.expand(2, 2, 1, 5)}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE]

    # The template's hole (attnkit.head.HeadAttention.forward validates, refuses by capability,
    # hides masked keys and reports the weights): normalise q and k and hand the call to the
    # inner part. The template reports the weights as this part's, so the inner part's own
    # report of the same weights is not passed on (one report per part in the slot).
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
        need_weights: bool, q_offset: int = 0, checked: bool = False, finite: bool = False,
    ) -> AttentionOutput:  # fmt: skip
        for name, x in (("q", q), ("k", k)):
            if x.shape[-1] != self.head_dim:
                raise ValueError(
                    f"QKNormAttention(head_dim={self.head_dim}) needs {name} (…, L, "
                    f"{self.head_dim}), got {tuple(x.shape)}"
                )
        extra = {"q_offset": q_offset} if self.takes_q_offset else {}
        if self.attention.forward_takes_facts:  # normalised keys are finite where k is
            extra.update(checked=checked, finite=finite)
        with hooks.listen(_drop) if hooks.listening() else nullcontext():
            out = self.attention(
                self.q_norm(q),
                self.k_norm(k),
                v,
                mask=mask,
                bias=bias,
                need_weights=need_weights,
                **extra,
            )
        return AttentionOutput(*out)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, norm={self.norm!r}"


def _drop(report: hooks.Report) -> None:
    """A report not passed on (the inner part's, reported again by the template)."""
