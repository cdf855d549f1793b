"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a ring: the latents travel, not the
keys and values.

MLA's keys and values are up-projections of one latent c_t^KV (d_c) per token plus a rotary
key k_t^R (d_h^R) shared by the heads (:mod:`attnkit.modern.latent`). In the absorbed form
(DeepSeek-V2 §2.1.2) every head attends over [c_t^KV ; k_t^R] itself, with W^UK folded into
its query and W^UV applied to its context afterwards, so ring attention
(:mod:`attnkit.distributed.ring`) passes each rank's latents around the ring: d_c + d_h^R
numbers per token as keys and d_c as values, shared by all heads, against H·(d_h + d_h^R) +
H·d_v for the expanded keys and values. Each rank rotates its queries and rotary keys at their
global positions before the ring; the softmax blocks merge online, causal by global
positions, exactly as :func:`attnkit.distributed.ring_attention` does for any softmax
attention.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnkit import arguments
from attnkit.distributed.layout import check_layout, segments
from attnkit.distributed.positions import global_positions
from attnkit.distributed.ring import attend
from attnkit.distributed.transport import Ring
from attnkit.modern.latent import LatentOutput, MultiHeadLatentAttention

__all__ = ["RingLatentAttention"]


class RingLatentAttention(nn.Module):
    """A :class:`attnkit.modern.MultiHeadLatentAttention` layer over a sequence split across
    the ranks of ``group``: each rank passes its tokens x (B, …, L_l, E), laid out as
    ``layout`` says, and gets its tokens' outputs u (B, …, L_l, E), equal to its part of the
    layer's output on the whole sequence.

    Args:
        module: the MLA layer; its parameters are this module's (shared, not copied).
        group: the ring's process group (None: the default group).
        layout: ``"contiguous"`` or ``"zigzag"``.
        causal: each token attends to the tokens at or before its global position (a
            decoder's self-attention).

    ``mask`` may mark padded tokens, (B, …, 1, L_l) as :func:`attnkit.masks.from_lengths`
    gives for this rank's tokens, or — with ``causal`` — be a causal mask of this rank's
    tokens ∧ padding (what a decoder passes). No weights and no cache: decoding needs no
    ring. The parameters' gradients on each rank are its tokens' part: sum them over the group.
    """

    def __init__(
        self,
        module: MultiHeadLatentAttention,
        *,
        group: dist.ProcessGroup | None = None,
        layout: str = "contiguous",
        causal: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, MultiHeadLatentAttention):
            raise TypeError(
                "module must be an attnkit.modern.MultiHeadLatentAttention, got "
                f"{type(module).__name__}"
            )
        self.module = module
        self.group = group
        self.layout = check_layout(layout)
        self.causal = arguments.boolean(causal, "causal")
        # Set by context_parallel for a layer its model declares causal: such a layer passes a
        # causal mask with every call of more than one token (see RingAttention).
        self.causal_by_mask = False

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        need_weights: bool = False,
        cache: object = None,
        absorbed: bool = True,
    ) -> LatentOutput:
        """u (B, …, L_l, E) for this rank's tokens x (B, …, L_l, E); ``absorbed`` is accepted
        for the layer's signature (the ring always attends over the latents, the absorbed
        form)."""
        from attnkit.distributed.attention import _key_padding

        mla = self.module
        refusal, pad = None, None
        q = k = v = x
        try:
            if need_weights:
                raise ValueError(
                    "RingLatentAttention does not return weights: each rank never holds a whole row"
                )
            if cache is not None:
                raise ValueError(
                    "RingLatentAttention takes no cache: decode with the layer itself (one "
                    "process), which holds the same parameters"
                )
            if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-1] != mla.embed_dim:
                shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"x must be (B, …, L_l, {mla.embed_dim}), got {shape}")
            arguments.boolean(absorbed, "absorbed")
            length = x.shape[-2]
            if self.causal_by_mask and length > 1 and (mask is None or mask.shape[-2] == 1):
                raise ValueError(
                    "this causal ring layer belongs to a layer that the model declares "
                    "causal, but it was passed no causal mask; the twin attends causally by "
                    "global positions, as the model declares"
                )
            ring = Ring.of(self.group)
            where = (ring.rank, ring.size, length, self.layout)
            pos = global_positions(*where, x.device)
            q_c, q_r = mla._queries(x, pos)
            parts = [
                mla.latents(x.narrow(-2, s.local, s.length), s.start) for s in segments(*where)
            ]
            c = torch.cat([p[0] for p in parts], dim=-2)
            k_r = torch.cat([p[1] for p in parts], dim=-2)
            w_uk, _ = mla.up_projections()
            q = torch.cat([torch.einsum("...hld,hdc->...hlc", q_c, w_uk), q_r], dim=-1)
            k = torch.cat([c, k_r], dim=-1).unsqueeze(-3)  # one latent "head" for all heads
            v = c.unsqueeze(-3)
            if mask is not None:
                if not self.causal and mask.dim() >= 2 and mask.shape[-2] > 1 and length > 1:
                    raise ValueError(
                        "RingLatentAttention(causal=False) takes a mask of padded tokens only, "
                        f"(B, …, 1, L_l), got {tuple(mask.shape)}; pass causal=True for a "
                        "causal mask (by global positions)"
                    )
                pad = _key_padding(mask, x, x, True)
        except (ValueError, TypeError) as err:
            refusal = err
        out = attend(
            q,
            k,
            v,
            score=mla.attention.score,
            align=mla.attention.align,
            group=self.group,
            causal=self.causal,
            key_padding_mask=pad,
            layout=self.layout,
            block_mask=None,
            score_mod=None,
            chunk_size=None,
            refusal=refusal,
        )
        _, w_uv = mla.up_projections()
        context = torch.einsum("...hlc,hvc->...hlv", out.context, w_uv)
        return LatentOutput(mla.w_o(context.transpose(-2, -3).flatten(-2)))
