"""Greedy generation for a batch of prompts of different lengths, through a paged KV cache
(:mod:`attnkit.paged_cache`), with sequences that leave the batch at their end-of-sequence token
and, with ``max_batch``, waiting prompts that join as places free up (continuous batching).

Every step feeds each running sequence's new tokens, left-padded to the longest: a whole
prompt for a sequence that joins, one token for a sequence that is decoding. The cache's step
mask keeps each sequence to its own keys; relative position schemes see each sequence at its own
positions (the view is right-aligned, see :mod:`attnkit.paged_cache`), and an absolute position
embedding is added at each token's own position (``step.positions``). Each sequence's tokens are
those of :meth:`attnkit.models.decoder_lm.DecoderLM.generate` run on its prompt alone, up to
rounding (a tie between two logits within rounding may break either way).

A hybrid model (``DecoderLM(layers="3 gated_deltanet : 1 full")``, :mod:`attnkit.layer_plan`)
keeps the keys and values of its attention layers (full and sliding-window ones) in the paged
cache, one paged layer per attention layer, and the state of each layer that decodes from a
state (a recurrent part, a token mixer) per sequence: such a layer runs every sequence's real
new tokens alone, from that sequence's state, so the left padding of a step never reaches it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.kv_cache import LayerCache
from attnkit.models.decoder_lm import DecoderLM
from attnkit.paged_cache import PagedKVCache, PagedStep

__all__ = ["generate_batch"]


@dataclass
class _Running:
    index: int  # place in the prompts
    sequence: int  # id in the cache
    pending: Tensor  # (n,) the tokens to feed next
    states: list[LayerCache]  # the caches of the layers that keep a state, in layer order
    generated: list[int] = field(default_factory=list)
    length: int = 0  # tokens fed so far


@torch.no_grad()
def generate_batch(
    model: DecoderLM,
    prompts: Sequence[Tensor],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    max_batch: int | None = None,
    cache: PagedKVCache | None = None,
) -> list[Tensor]:
    """Continue every prompt greedily by up to ``max_new_tokens`` tokens.

    Args:
        model: the decoder-only language model.
        prompts: 1-D long tensors of token ids, of any lengths ≥ 1.
        max_new_tokens: the most tokens added to a prompt.
        eos_token_id: a sequence ends after emitting this token (kept in its output), and its
            pages go back to the pool; None: every sequence gets ``max_new_tokens``.
        max_batch: the most sequences decoded at once; the other prompts wait and join as
            sequences end. None: all at once.
        cache: the :class:`attnkit.paged_cache.PagedKVCache` to decode in (one layer per
            attention layer of the decoder, every layer unless it is a hybrid; e.g. to choose
            ``page_size`` or cap ``num_pages``); by default a new one with pages of 16 tokens.
            Sequences are added to it and freed when they end.

    Returns:
        One 1-D long tensor per prompt, in order: the prompt followed by its new tokens.
    """
    if not isinstance(model, DecoderLM):
        raise TypeError(f"model must be an attnkit DecoderLM, got {type(model).__name__}")
    arguments.nonnegative_int(max_new_tokens, "max_new_tokens")
    arguments.optional_positive_int(max_batch, "max_batch")
    layers = sum(not layer.keeps_state for layer in model.decoder.layers)
    if cache is None:
        cache = PagedKVCache(layers) if layers else None
    elif not isinstance(cache, PagedKVCache) or len(cache) != layers:
        raise ValueError(
            f"cache must be a PagedKVCache with {layers} layers (one per attention layer of the "
            f"decoder), got {cache!r}"
        )
    if eos_token_id is not None and (
        not isinstance(eos_token_id, int)
        or isinstance(eos_token_id, bool)
        or not 0 <= eos_token_id < model.vocab_size
    ):
        raise ValueError(
            f"eos_token_id must be None or a token id in [0, {model.vocab_size}), got "
            f"{eos_token_id!r}"
        )
    prompts = list(prompts)
    device = model.tokens.weight.device
    for i, p in enumerate(prompts):
        _check_prompt(model, p, i, max_new_tokens, device)
    if not prompts or max_new_tokens == 0:
        return [p.clone() for p in prompts]
    out: list[Tensor | None] = [None] * len(prompts)
    waiting = deque(range(len(prompts)))
    running: list[_Running] = []
    while waiting or running:
        while waiting and (max_batch is None or len(running) < max_batch):
            i = waiting.popleft()
            states = [layer.new_cache() for layer in model.decoder.layers if layer.keeps_state]
            sequence = -1 if cache is None else cache.add()
            running.append(_Running(i, sequence, prompts[i], states))
        counts = [len(r.pending) for r in running]
        m = max(counts)
        tokens = torch.zeros(len(running), m, dtype=torch.long, device=device)
        for row, r in enumerate(running):
            tokens[row, m - len(r.pending) :] = r.pending
        step = (
            nullcontext()
            if cache is None
            else cache.step([r.sequence for r in running], counts, device=device)
        )
        with step:
            last = _last_logits(model, tokens, running, step, cache)
        chosen = last.argmax(-1).tolist()
        still: list[_Running] = []
        for r, token in zip(running, chosen, strict=True):
            r.generated.append(token)
            r.length += len(r.pending)
            if token == eos_token_id or len(r.generated) == max_new_tokens:
                if cache is not None:
                    cache.free(r.sequence)
                new = torch.tensor(r.generated, dtype=torch.long, device=device)
                out[r.index] = torch.cat([prompts[r.index], new])
            else:
                r.pending = torch.tensor([token], dtype=torch.long, device=device)
                still.append(r)
        running = still
    return [t for t in out if t is not None]


def _last_logits(
    model: DecoderLM,
    tokens: Tensor,
    running: list[_Running],
    step: PagedStep | None,
    cache: PagedKVCache | None,
) -> Tensor:
    """The logits (B, V) of the next token after each row's last token (rows left-padded)."""
    m = tokens.shape[1]
    x = model.tokens(tokens)
    if model.positions is not None:  # an absolute embedding, at each token's own position
        rows = []
        for row, r in enumerate(running):
            start = m - len(r.pending)
            own = model.positions(x[row : row + 1, start:], offset=r.length)
            rows.append(torch.cat([x[row : row + 1, :start], own], 1))
        x = torch.cat(rows)
    paged = iter(range(0 if cache is None else len(cache)))
    stateful = 0
    # The model's own layers, on token ids checked above: their attention layers know their
    # inputs finite (DecoderLM sets MultiHeadAttention.inputs_finite).
    for layer in model.decoder.layers:
        if not layer.keeps_state:
            x = layer(x, mask=step.mask, cache=cache[next(paged)])
            continue
        out = x.clone()  # the padded places keep their input: no real query reads them
        for row, r in enumerate(running):
            start = m - len(r.pending)
            out[row : row + 1, start:] = layer(x[row : row + 1, start:], cache=r.states[stateful])
        x, stateful = out, stateful + 1
    if model.decoder.norm is not None:
        x = model.decoder.norm(x)
    return model.head(x[:, -1])


def _check_prompt(model: DecoderLM, p: object, i: int, n: int, device: torch.device) -> None:
    if not isinstance(p, Tensor) or p.dtype != torch.long:
        what = p.dtype if isinstance(p, Tensor) else type(p).__name__
        raise TypeError(f"prompts[{i}] must be a torch.long tensor of token ids, got {what}")
    if p.dim() != 1 or p.numel() < 1:
        raise ValueError(f"prompts[{i}] must be 1-D with at least one token, got {tuple(p.shape)}")
    if p.device != device:
        raise ValueError(f"prompts[{i}] is on {p.device} but the model on {device}")
    if bool((p < 0).any()) or bool((p >= model.vocab_size).any()):
        raise ValueError(f"prompts[{i}] holds token ids outside [0, {model.vocab_size})")
    if n > 0 and len(p) + n - 1 > model.max_len:
        raise ValueError(
            f"prompts[{i}] of {len(p)} tokens and max_new_tokens = {n} need "
            f"{len(p) + n - 1} positions, more than the model's max_len = {model.max_len}"
        )
