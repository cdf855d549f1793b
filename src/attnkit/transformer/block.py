"""What the encoder and the decoder layer share: validated sizes, the self-attention (or a
token mixer in its place), the feed-forward, where the norms sit, and the sliding window."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.kernels.block_mask import BlockMask, MaskMod, ScoreMod
from attnkit.kv_cache import LayerCache
from attnkit.multihead import MultiHeadAttention
from attnkit.positions import PositionScheme
from attnkit.queries.query_types import QueryTagged
from attnkit.transformer.feed_forward import FeedForward
from attnkit.transformer.window import window_block_mask, window_mask

__all__ = ["Block", "attention_heads"]


def _identity(x: Tensor) -> Tensor:
    return x


def _mixer(mixer: nn.Module | None, slots: dict[str, Any]) -> nn.Module | None:
    """``mixer`` checked: a token mixer takes the self-attention's place, so none of the
    self-attention's slots may be given with it."""
    if mixer is None:
        return None
    from attnkit.mixers import TokenMixer

    if not isinstance(mixer, TokenMixer):
        raise TypeError(
            f"mixer must be an attnkit.mixers.TokenMixer or None, got {type(mixer).__name__}"
        )
    given = [name for name, value in slots.items() if value is not None]
    if given:
        raise ValueError(
            f"mixer= replaces the self-attention, so its {', '.join(given)} cannot be given too"
        )
    return mixer


def attention_heads(
    embed_dim: int, num_heads: int, score: Any, align: Any, dropout: float, query: str, **kw: Any
) -> QueryTagged:
    """A multi-head attention part, tagged with where its queries come from; ``kw`` holds
    device and dtype, and for self-attention the attention and position slots."""
    mha = MultiHeadAttention(embed_dim, num_heads, score, align, dropout=dropout, **kw)
    return QueryTagged(mha, query)


class Block(nn.Module):
    """What both layers share: validated sizes, causal or plain self-attention, feed-forward,
    and where the norms sit (``norm_first``). Arguments as
    :class:`attnkit.transformer.TransformerEncoderLayer`; a subclass adds its own sublayers and
    norms in :meth:`_build`."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        d_ff: int | None = None,
        *,
        score: Any = "scaled_dot",
        align: Any = "softmax",
        dropout: float = 0.0,
        norm_first: bool = False,
        activation: nn.Module | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        attention: nn.Module | None = None,
        position: str | PositionScheme | None = None,
        pattern: MaskMod | None = None,
        score_mod: ScoreMod | None = None,
        window: int | None = None,
        mixer: nn.Module | None = None,
        gate: str | nn.Module | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.positive_int(embed_dim, "embed_dim")
        arguments.positive_int(num_heads, "num_heads")
        arguments.probability(dropout, "dropout")
        self.norm_first = arguments.boolean(norm_first, "norm_first")
        self.window = arguments.optional_positive_int(window, "window")
        kw = {"device": device, "dtype": dtype}
        slots = {
            "attention": attention,
            "position": position,
            "pattern": pattern,
            "score_mod": score_mod,
            "gate": gate,
        }
        if self.window is not None and pattern is not None:
            raise ValueError(
                "window= and pattern= both restrict the self-attention's keys: give one (a "
                "causal sliding window is patterns.sliding_window(w, causal=True))"
            )
        sizes = {"num_kv_heads": num_kv_heads, "head_dim": head_dim}
        self.mixer = _mixer(mixer, {**slots, "window": window})
        self.self_attention = (
            None
            if self.mixer is not None
            else attention_heads(
                embed_dim,
                num_heads,
                *self._self_score(score, align, attention),
                dropout,
                "self-attentive",
                **sizes,
                **slots,
                **kw,
            )
        )
        self._build(embed_dim, num_heads, score, align, dropout, {**kw, **sizes})
        activation = nn.ReLU() if activation is None else activation
        self.ff = FeedForward(embed_dim, d_ff, dropout, activation, **kw)
        self.drop = nn.Dropout(dropout)

    def _sublayer(self, x: Tensor, norm: nn.Module, f: Callable[[Tensor], Tensor]) -> Tensor:
        """Post-norm Norm(x + f(x)) (Vaswani et al.), or pre-norm x + f(Norm(x)) (Xiong et al.
        2020: better-behaved gradients at the start of training, no warm-up needed)."""
        drop = self.drop if self.training and self.drop.p > 0 else _identity
        if self.norm_first:
            return x + drop(f(norm(x)))
        return norm(x + drop(f(x)))

    def _build(
        self, embed_dim: int, num_heads: int, score: Any, align: Any, dropout: float, kw
    ) -> None:
        raise NotImplementedError

    def _self_score(self, score: Any, align: Any, attention: nn.Module | None) -> tuple[Any, Any]:
        """The score and alignment the self-attention is built with."""
        return score, align

    def _mix(
        self,
        y: Tensor,
        mask: Tensor | None,
        cache: LayerCache | None,
        block_mask: BlockMask | None,
        score_mod: ScoreMod | None,
    ) -> Tensor:
        """The token mixer's output on y (B, M, embed_dim); ``mask`` must be key padding."""
        who = f"{type(self).__name__} with the token mixer {type(self.mixer).__name__}"
        if block_mask is not None or score_mod is not None:
            raise ValueError(
                f"{who}: block_mask and score_mod act on attention scores, which a token mixer "
                "has none of; pass them to a stack of attention layers only"
            )
        if mask is not None and not (mask.dim() == 3 and mask.shape[-2] == 1):
            raise ValueError(
                f"{who}: the mask must be key padding (B, 1, N) (masks.from_lengths), the only "
                f"mask a token mixer honours; got shape {tuple(mask.shape)}"
            )
        padding = None if mask is None else mask[..., -y.shape[-2] :]
        return self.mixer(y, mask=padding, cache=cache)

    def _window_block_mask(
        self,
        m: int,
        n: int,
        causal: bool,
        device: torch.device,
        cached: int,
        block_mask: BlockMask | None,
    ) -> BlockMask | None:
        """(M, N) the sliding window of the self-attention as a block mask, for a call over a
        whole sequence (nothing ``cached``): the chunked kernel visits only the tiles near the
        diagonal, so time and memory follow N·window, not N². Causally it holds the causal mask
        too. None where the window is a dense mask instead (:meth:`_window_mask`): no window or
        every key inside it; a decoding step (M × window is small, and a window cache keeps the
        last keys in places of its own); a ``block_mask`` of the call's (the two restrictions
        meet as masks); or a per-head part that does not declare ``accepts_block_mask``."""
        if self.window is None or n <= self.window or cached or block_mask is not None:
            return None
        if not self.self_attention.module.attention.accepts_block_mask:
            return None
        return window_block_mask(self.window, n, causal, device)

    def _window_mask(self, m: int, n: int, causal: bool, device: torch.device) -> Tensor | None:
        """(M, N) the sliding window of the self-attention (None without one, or when every key
        is inside it): the M queries are the last of N places; causally each attends itself
        and the window − 1 places before it, else the places less than window away."""
        if self.window is None or n <= self.window:
            return None
        return window_mask(self.window, m, n, causal, device)
