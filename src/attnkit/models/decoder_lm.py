"""A decoder-only language model (GPT-style; Radford et al. 2018, Soydaner 5.2) from attnkit
parts: token + position embeddings, a causal stack of decoder layers without cross-attention,
and a linear head over the vocabulary; incremental decoding through a KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.kv_cache import KVCache
from attnkit.multihead import MultiHeadAttention
from attnkit.positions import REGISTRY as POSITIONS
from attnkit.transformer import TransformerDecoder

__all__ = ["DecoderLM"]


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class DecoderLM(nn.Module):
    """p(x_t | x_<t) by a causal Transformer: logits = W · Stack(E_tok[x] + E_pos[t]).

    Args:
        vocab_size: V, the number of token ids.
        embed_dim, num_heads, layers, d_ff: sizes of the stack. ``layers`` may be a plan, one
            token mixing per layer (:mod:`attnkit.layer_plan`): ``"3 gated_deltanet : 1 full"``
            (with ``num_layers=12``: repeated to 12 layers), ``"5 sliding:512 : 1 full"``, a
            list of names, token mixers or factories; every layer then decodes with its own
            kind of cache (:meth:`new_cache`), in :meth:`generate` and
            :func:`attnkit.models.batched_generation.generate_batch` too.
        num_layers: the number of layers a pattern in ``layers`` is repeated to fill.
        max_len: the longest sequence (prompt + generated); the size of the learned position
            table.
        position: how token order enters: a per-head scheme of every layer's self-attention
            (a registered name or a :class:`attnkit.positions.PositionScheme`: RoPE, ALiBi,
            ...), or an absolute embedding added to the token embeddings (a module with
            ``absolute = True`` called as ``forward(x, *, offset)``, or the registered name of
            one, built by its ``for_model(embed_dim, max_len=max_len)``).
        learned_positions: add GPT's learned absolute position table (max_len × embed_dim) to the
            token embeddings; by default only when no ``position`` is given.
        tie_embeddings: the output head reuses the token embedding matrix (GPT-2).
        layer: further keyword arguments of the layers (``norm_first`` — pre-norm by default,
            as GPT-2 —, ``score``, ``align``, ``dropout``, ``num_kv_heads``, ``head_dim``,
            ``device``, ``dtype``, ...): ``pattern`` (a causal sparse pattern, e.g.
            ``attnkit.patterns.sliding_window(w, causal=True)`` for local attention: the whole
            sequence attends block-sparsely, a decoding step through the pattern's rows) and
            ``score_mod`` apply to every layer's self-attention, in :meth:`generate` too.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        layers: int | str | Sequence[Any],
        *,
        max_len: int,
        num_layers: int | None = None,
        d_ff: int | None = None,
        learned_positions: bool | None = None,
        position: str | nn.Module | None = None,
        tie_embeddings: bool = True,
        **layer: Any,
    ) -> None:
        super().__init__()
        self.vocab_size = arguments.positive_int(vocab_size, "vocab_size")
        self.max_len = arguments.positive_int(max_len, "max_len")
        kw = {k: layer[k] for k in ("device", "dtype") if k in layer}
        layer.setdefault("norm_first", True)
        self.tokens = nn.Embedding(vocab_size, embed_dim, **kw)
        nn.init.normal_(self.tokens.weight, std=0.02)
        if learned_positions is None:
            learned_positions = position is None
        self.positions: nn.Module | None = None
        if arguments.boolean(learned_positions, "learned_positions"):
            self.positions = _LearnedTable(max_len, embed_dim, **kw)
        if _is_absolute(position):
            if self.positions is not None:
                raise ValueError(
                    "learned_positions=True and an absolute position embedding: pick one"
                )
            if isinstance(position, str):
                position = POSITIONS.get(position).for_model(embed_dim, max_len=max_len)
            self.positions, position = position, None
        self.decoder = TransformerDecoder(
            layers,
            embed_dim,
            num_heads,
            d_ff,
            cross_attention=False,
            position=position,
            num_layers=num_layers,
            max_len=max_len,
            **layer,
        )
        for i, block in enumerate(self.decoder.layers):  # refused now rather than at the first call
            if block.mixer is not None:
                if not block.mixer.causal:
                    raise ValueError(
                        f"{type(self).__name__}: layer {i}'s token mixer "
                        f"{type(block.mixer).__name__} does not mix causally (causal = False)"
                    )
                continue
            mha = getattr(block.self_attention, "module", block.self_attention)
            mha.attention.check_supported(f"{type(self).__name__}(attention=...)", causal=True)
        # The layers' inputs are embeddings of token ids that forward checks, and the
        # activations made from them: finite, padding included. Every attention layer built
        # here is told so once (MultiHeadAttention.inputs_finite): no call looks for
        # non-finite padding keys or clears them.
        for module in self.decoder.modules():
            if isinstance(module, MultiHeadAttention):
                module.inputs_finite = True
        self.head = nn.Linear(embed_dim, vocab_size, bias=False, **kw)
        if arguments.boolean(tie_embeddings, "tie_embeddings"):
            self.head.weight = self.tokens.weight

    def new_cache(self) -> KVCache:
        """An empty cache for :meth:`forward` / :meth:`generate`."""
        return self.decoder.new_cache()

    def forward(
        self,
        tokens: Tensor,
        *,
        cache: KVCache | None = None,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> Tensor:
        """tokens (B, M) long -> logits (B, M, V) of the next token at every position.

        Sequences of different lengths can be right-padded: causal attention never lets a
        real position see the padding after it (ignore the logits at padded positions). With
        ``cache`` the tokens are the new ones only, placed after the cached positions.
        ``block_mask`` (over M × M, no cache) and ``score_mod`` reach every layer's
        self-attention (see :meth:`attnkit.MultiHeadAttention.forward`)."""
        _token_ids(tokens, "tokens")
        offset = 0 if cache is None else cache.length
        m = tokens.shape[-1]
        if offset + m > self.max_len:
            raise ValueError(
                f"{offset} cached + {m} new tokens exceed max_len = {self.max_len} "
                f"(tokens of shape {tuple(tokens.shape)})"
            )
        x = self.tokens(tokens)
        if self.positions is not None:
            x = self.positions(x, offset=offset)
        # (the layers' inputs are embeddings of these checked ids: finite, as each attention
        # layer was told at construction)
        h = self.decoder(x, cache=cache, block_mask=block_mask, score_mod=score_mod)
        return self.head(h)

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        n: int,
        *,
        greedy: bool = True,
        use_cache: bool = True,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Continue ``prompt`` (B, P) by ``n`` tokens -> (B, P + n).

        ``greedy``: take the most likely token, else sample from softmax(logits / temperature)
        with ``generator``. ``use_cache``: feed one token per step through the KV cache;
        without it every step recomputes the whole sequence (the same tokens, slower)."""
        arguments.nonnegative_int(n, "n")
        arguments.boolean(greedy, "greedy")
        arguments.boolean(use_cache, "use_cache")
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        _token_ids(prompt, "prompt")
        if prompt.shape[1] < 1:
            raise ValueError(f"prompt must be (B, P) with P >= 1, got {tuple(prompt.shape)}")
        if use_cache:  # refuse before the first step, naming the argument that avoids the cache
            for module in self.modules():
                if isinstance(module, MultiHeadAttention):
                    module._check_cacheable(
                        "DecoderLM.generate",
                        "generate with use_cache=False (every step then runs the whole sequence)",
                    )
        cache = self.new_cache() if use_cache else None
        out, new = prompt, prompt
        for _ in range(n):
            logits = self(new if use_cache else out, cache=cache)[:, -1]
            if greedy:
                token = logits.argmax(-1, keepdim=True)
            else:
                probs = torch.softmax(logits / temperature, -1)
                token = torch.multinomial(probs, 1, generator=generator)
            out = torch.cat([out, token], 1)
            new = token
        return out


class _LearnedTable(nn.Embedding):
    """GPT's learned absolute positions: x + P[offset : offset + L]."""

    absolute: ClassVar[bool] = True  # an absolute embedding, forward(x, *, offset)

    def __init__(self, max_len: int, embed_dim: int, **kw: Any) -> None:
        super().__init__(max_len, embed_dim, **kw)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor, *, offset: int = 0) -> Tensor:  # type: ignore[override]
        if offset < 0 or offset + x.shape[-2] > self.num_embeddings:
            raise ValueError(
                f"positions {offset}..{offset + x.shape[-2] - 1} are outside the learned table "
                f"of max_len = {self.num_embeddings}"
            )
        steps = torch.arange(offset, offset + x.shape[-2], device=x.device)
        return x + super().forward(steps)


def _is_absolute(position: object) -> bool:
    if isinstance(position, str):
        return bool(getattr(POSITIONS.get(position), "absolute", False))
    return bool(getattr(position, "absolute", False))


def _token_ids(x: object, name: str) -> None:
    if not isinstance(x, Tensor) or x.dtype != torch.long:
        what = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"{name} must be a torch.long tensor of token ids, got {what}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be (B, length) token ids, got shape {tuple(x.shape)}")
