"""Gated attention as a layer (Qiu et al. 2025, "Gated Attention for Large Language Models";
Qwen3-Next's full-attention layers): multi-head attention whose concatenated heads pass a
sigmoid gate read from the query tokens before W^O,

    y_i = (concat_h head_h(…)_i ⊙ σ(x_i W_g + b_g)) W^O

(:mod:`attnkit.output_gate` has the gate and its two kinds). :class:`GatedAttention` is
:class:`attnkit.MultiHeadAttention` with the gate on by default, registered as the mechanism
``gated_attention``; :meth:`GatedAttention.from_transformers` builds it equal to transformers'
``Qwen3NextAttention`` with its weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit import masks
from attnkit.head import HeadAttention
from attnkit.kernels.block_mask import MaskMod, ScoreMod
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.multihead import MultiHeadAttention
from attnkit.output_gate import OutputGate
from attnkit.positions import PositionScheme
from attnkit.positions.rope_scaling import ScaledRotary
from attnkit.qk_chain import HeadNorm, QKTransform

__all__ = ["GatedAttention"]


@REGISTRY.register("gated_attention")
class GatedAttention(MultiHeadAttention):
    """Multi-head attention with an output gate (a whole layer: query (B, …, M, E) → output
    (B, …, M, E); called as :class:`attnkit.MultiHeadAttention`).

    Args:
        embed_dim: E.
        num_heads: H.
        gate: ``"elementwise"`` (default; one gate per head and channel, as Qwen3-Next),
            ``"headwise"`` (one per head) or an :class:`attnkit.output_gate.OutputGate`.

    The other arguments (``num_kv_heads``, ``head_dim``, ``kdim``, ``vdim``, ``bias``,
    ``dropout``, ``attention``, ``position``, ``qk``, ``pattern``, ``score_mod``, ``kernel``,
    ``device``, ``dtype``) are :class:`attnkit.MultiHeadAttention`'s; the per-head part is
    scaled dot-product softmax attention unless ``attention=`` gives another.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("query",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        gate: str | OutputGate = "elementwise",
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        attention: HeadAttention | None = None,
        position: str | PositionScheme | None = None,
        qk: Sequence[QKTransform | str] | None = None,
        pattern: MaskMod | None = None,
        score_mod: ScoreMod | None = None,
        kernel: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if gate is None:
            raise ValueError(
                "GatedAttention needs a gate ('elementwise', 'headwise' or an OutputGate); "
                "for no gate use attnkit.MultiHeadAttention"
            )
        super().__init__(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            dropout=dropout,
            attention=attention,
            position=position,
            qk=qk,
            pattern=pattern,
            score_mod=score_mod,
            kernel=kernel,
            gate=gate,
            device=device,
            dtype=dtype,
        )

    @classmethod
    def example(cls) -> tuple[GatedAttention, tuple[Tensor], dict[str, Any]]:
        query = example_tensor(2, 7, 8, seed=51)
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)  # (2, 1, 7)
        return cls(8, 2, gate="headwise"), (query,), {"mask": mask}

    @classmethod
    def from_transformers(cls, module: nn.Module) -> GatedAttention:
        """The layer equal to transformers' ``Qwen3NextAttention`` ``module``, with its weights
        (copied, in their dtype and on their device).

        Qwen3-Next's ``q_proj`` makes, per head, the d query features followed by the d gate
        features; they become W^Q and the elementwise gate's W_g. Its q/k RMSNorms scale by
        1 + w (zero-centred gains), copied as :class:`attnkit.qk_chain.HeadNorm` gains 1 + w
        and run before the rotary embedding; that turns the first ``partial_rotary_factor``
        · d features in the rotate-half layout (``ScaledRotary(layout="halves")``). Call it
        as ``layer(x, mask=...)`` with a causal mask (and key padding); it decodes with an
        :class:`attnkit.kv_cache.LayerCache`.

        Raises:
            TypeError: ``module`` is not a ``Qwen3NextAttention``.
            ValueError: a rotary scaling other than the default (not built here).
        """
        if type(module).__name__ != "Qwen3NextAttention":
            raise TypeError(
                f"GatedAttention.from_transformers builds from transformers' "
                f"Qwen3NextAttention, got {type(module).__name__}"
            )
        config = module.config
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"GatedAttention.from_transformers: rope_type {rope.get('rope_type')!r} is not "
                "built; only the default rotary embedding (partial_rotary_factor allowed) is"
            )
        heads, d = config.num_attention_heads, module.head_dim
        weight = module.o_proj.weight
        bias = module.q_proj.bias is not None
        kw: dict[str, Any] = {"device": weight.device, "dtype": weight.dtype}
        norm = HeadNorm(d, eps=module.q_norm.eps, **kw)
        gate = OutputGate(config.hidden_size, heads, d, "elementwise", bias=bias, **kw)
        layer = cls(
            config.hidden_size,
            heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=d,
            bias=bias,
            dropout=float(config.attention_dropout),
            position=ScaledRotary(
                float(rope.get("rope_theta", 10000.0)),
                fraction=float(rope.get("partial_rotary_factor", 1.0)),
                layout="halves",
            ),
            qk=[norm, "position"],
            gate=gate,
            **kw,
        )
        with torch.no_grad():
            q_rows = module.q_proj.weight.unflatten(0, (heads, 2, d))  # [query | gate] per head
            layer.in_proj_weight.copy_(
                torch.cat([q_rows[:, 0].flatten(0, 1), module.k_proj.weight, module.v_proj.weight])
            )
            gate.proj.weight.copy_(q_rows[:, 1].flatten(0, 1))
            if bias:
                q_bias = module.q_proj.bias.unflatten(0, (heads, 2, d))
                layer.in_proj_bias.copy_(
                    torch.cat([q_bias[:, 0].flatten(), module.k_proj.bias, module.v_proj.bias])
                )
                gate.proj.bias.copy_(q_bias[:, 1].flatten())
                layer.out_proj.bias.copy_(module.o_proj.bias)
            layer.out_proj.weight.copy_(module.o_proj.weight)
            norm.q_weight.copy_(1 + module.q_norm.weight)
            norm.k_weight.copy_(1 + module.k_norm.weight)
        return layer.train(module.training)
