"""The encoder–decoder Transformer (Vaswani et al.; Soydaner 5, Brauwers 3.3.2) from attnkit's
encoder and decoder stacks, with :meth:`Transformer.from_torch` for ``torch.nn.Transformer``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.kv_cache import KVCache
from attnkit.multihead import MultiHeadAttention
from attnkit.transformer import TransformerDecoder, TransformerEncoder

__all__ = ["Transformer"]


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class Transformer(nn.Module):
    """Encoder stack over the source, decoder stack over the target with cross-attention to the
    encoder output. Defaults as the paper's base model and ``torch.nn.Transformer``.

    Args:
        embed_dim, num_heads, d_ff: model size, number of heads, feed-forward size.
        encoder_layers, decoder_layers: depth of each stack (≥ 1).
        final_norm: a LayerNorm after each stack's last layer (as ``torch.nn.Transformer``,
            which always has one).
        layer: keyword arguments of every layer (``score``, ``align``, ``dropout``,
            ``norm_first``, ``activation``, ``num_kv_heads``, ``head_dim``, ``position``,
            ``pattern``, ``score_mod``, ``device``, ``dtype``; see
            :class:`attnkit.transformer.TransformerEncoderLayer`). A ``pattern`` or
            ``score_mod`` given here applies to the self-attention of both stacks.
    """

    def __init__(
        self,
        embed_dim: int = 512,
        num_heads: int = 8,
        *,
        encoder_layers: int = 6,
        decoder_layers: int = 6,
        d_ff: int | None = 2048,
        final_norm: bool = True,
        **layer: Any,
    ) -> None:
        super().__init__()
        self.encoder = TransformerEncoder(
            encoder_layers, embed_dim, num_heads, d_ff, final_norm=final_norm, **layer
        )
        self.decoder = TransformerDecoder(
            decoder_layers, embed_dim, num_heads, d_ff, final_norm=final_norm, **layer
        )

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_block_mask: BlockMask | None = None,
        tgt_block_mask: BlockMask | None = None,
        src_score_mod: ScoreMod | None = None,
        tgt_score_mod: ScoreMod | None = None,
    ) -> Tensor:
        """src (B, N, embed_dim), tgt (B, M, embed_dim) -> (B, M, embed_dim). Masks are boolean,
        True = may attend (attnkit's convention; the opposite of torch's padding masks):
        ``src_mask`` (B, 1, N) from :func:`attnkit.masks.from_lengths` or (B, N, N);
        ``tgt_mask`` (B, 1, M) for target padding or (B, M, M), combined with the causal mask;
        ``memory_mask`` (B, 1, N) or (B, M, N) for the cross-attention — pass the source's
        padding mask here too (as torch's ``memory_key_padding_mask``). ``src_block_mask`` /
        ``src_score_mod`` reach the encoder's self-attention, ``tgt_block_mask`` /
        ``tgt_score_mod`` the decoder's (see :meth:`attnkit.MultiHeadAttention.forward`)."""
        memory = self.encode(src, src_mask, block_mask=src_block_mask, score_mod=src_score_mod)
        return self.decode(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            block_mask=tgt_block_mask,
            score_mod=tgt_score_mod,
        )

    def encode(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        *,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> Tensor:
        """The encoder output (memory), (B, N, embed_dim); ``block_mask`` and ``score_mod`` reach
        every encoder layer's self-attention."""
        return self.encoder(src, src_mask, block_mask=block_mask, score_mod=score_mod)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: KVCache | None = None,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> Tensor:
        """The decoder over ``tgt`` given the encoder output; with ``cache`` (from
        ``model.decoder.new_cache()``) ``tgt`` holds only the new target positions.
        ``block_mask`` and ``score_mod`` reach every decoder layer's self-attention."""
        return self.decoder(
            tgt,
            memory,
            mask=tgt_mask,
            memory_mask=memory_mask,
            cache=cache,
            block_mask=block_mask,
            score_mod=score_mod,
        )

    @classmethod
    def from_torch(cls, module: nn.Transformer) -> Transformer:
        """A Transformer with the weights and settings of ``module`` (a ``torch.nn.Transformer``
        with its own encoder and decoder layers), giving the same outputs for the same inputs
        and masks. Our module is batch first whatever ``module.batch_first`` is. Layers without
        biases (``bias=False``) and activations other than ReLU and GELU are refused."""
        if not isinstance(module, nn.Transformer):
            raise TypeError(f"expected torch.nn.Transformer, got {type(module).__name__}")
        if not isinstance(module.encoder, nn.TransformerEncoder) or not isinstance(
            module.decoder, nn.TransformerDecoder
        ):
            raise ValueError("from_torch: custom_encoder / custom_decoder are not supported")
        enc, dec = module.encoder.layers, module.decoder.layers
        first = enc[0]
        if first.linear1.bias is None or first.norm1.bias is None:
            raise ValueError("from_torch: layers without biases (bias=False) are not supported")
        ref = first.linear1.weight
        ours = cls(
            first.self_attn.embed_dim,
            first.self_attn.num_heads,
            encoder_layers=len(enc),
            decoder_layers=len(dec),
            d_ff=first.linear1.out_features,
            dropout=first.dropout.p,
            norm_first=first.norm_first,
            activation=_activation(first.activation),
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            for theirs, mine in zip(enc, ours.encoder.layers, strict=True):
                _copy_attention(theirs.self_attn, mine.self_attention.module)
                _copy_feed_forward(theirs, mine)
                _copy_norms([theirs.norm1, theirs.norm2], [mine.norm1, mine.norm2])
            for theirs, mine in zip(dec, ours.decoder.layers, strict=True):
                _copy_attention(theirs.self_attn, mine.self_attention.module)
                _copy_attention(theirs.multihead_attn, mine.cross_attention.module)
                _copy_feed_forward(theirs, mine)
                _copy_norms([theirs.norm1, theirs.norm2, theirs.norm3], mine.norms)
            for stack, theirs in ((ours.encoder, module.encoder), (ours.decoder, module.decoder)):
                if theirs.norm is None:
                    stack.norm = None
                else:
                    _copy_norms([theirs.norm], [stack.norm])
        return ours


def _activation(activation: object) -> nn.Module:
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return nn.ReLU()
    exact_gelu = isinstance(activation, nn.GELU) and activation.approximate == "none"
    if activation is F.gelu or exact_gelu:
        return nn.GELU()
    raise ValueError(f"from_torch: activation {activation!r} is not supported (ReLU or GELU)")


def _copy_attention(theirs: nn.MultiheadAttention, mine: MultiHeadAttention) -> None:
    mine.load_state_dict(MultiHeadAttention.from_torch(theirs).state_dict())


def _copy_feed_forward(theirs: nn.Module, mine: nn.Module) -> None:
    mine.ff[0].load_state_dict(theirs.linear1.state_dict())
    mine.ff[3].load_state_dict(theirs.linear2.state_dict())


def _copy_norms(theirs: list[nn.LayerNorm], mine: Any) -> None:
    for a, b in zip(theirs, mine, strict=True):
        b.load_state_dict(a.state_dict())
        b.eps = a.eps
