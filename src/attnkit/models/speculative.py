"""Speculative decoding with a draft model (Leviathan et al., "Fast Inference from Transformers
via Speculative Decoding", ICML 2023; Chen et al. 2023), greedy form.

A small draft model proposes k tokens one at a time; the target model scores the pending token
and the k proposals in **one** call (k + 1 positions through its KV cache) and keeps the
longest prefix of proposals that equals its own greedy choice, then adds its own token after
that prefix (the correction where a proposal was rejected, or a bonus token when all k were
kept). Every kept token is the target's greedy token given the tokens before it, so the output
is the target's greedy :meth:`attnkit.models.decoder_lm.DecoderLM.generate`, up to rounding (a
tie between two logits within rounding may break either way, as in a batched call); each
target call emits between 1 and k + 1 tokens. The positions of rejected proposals are removed
from both caches by :meth:`attnkit.kv_cache.KVCache.rollback`, so the next call continues as if
they had never been decoded.

A batch advances by the shortest accepted prefix of its rows (a longer one is the target's own
tokens too, so stopping early keeps every row greedy; only the acceptance rate pays).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.models.decoder_lm import DecoderLM

__all__ = ["SpeculativeStats", "generate"]


@dataclass
class SpeculativeStats:
    """What a speculative decode did.

    Attributes:
        target_calls: calls of the target model (the prompt's call included).
        draft_calls: calls of the draft model.
        proposed: draft tokens offered to the target.
        accepted: draft tokens the target kept.
    """

    target_calls: int = 0
    draft_calls: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed (0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0


@torch.no_grad()
def generate(
    target: DecoderLM,
    draft: DecoderLM,
    prompt: Tensor,
    n: int,
    k: int = 4,
    *,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, SpeculativeStats]:
    """Continue ``prompt`` (B, P) by ``n`` greedy tokens of ``target`` -> (B, P + n), with
    ``draft`` proposing ``k`` tokens per target call.

    Args:
        target: the model whose greedy tokens are produced.
        draft: the proposing model, over the same vocabulary (usually much smaller).
        prompt: (B, P) long token ids, P ≥ 1.
        n: the tokens to add.
        k: the draft tokens proposed per target call (k ≥ 1).
        return_stats: also return a :class:`SpeculativeStats`.
    """
    for name, model in (("target", target), ("draft", draft)):
        if not isinstance(model, DecoderLM):
            raise TypeError(
                f"{name} must be an attnkit.models.decoder_lm.DecoderLM, got {type(model).__name__}"
            )
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"draft has a vocabulary of {draft.vocab_size} tokens but target of "
            f"{target.vocab_size}: they must share one"
        )
    arguments.nonnegative_int(n, "n")
    arguments.positive_int(k, "k")
    arguments.boolean(return_stats, "return_stats")
    if not isinstance(prompt, Tensor) or prompt.dtype != torch.long or prompt.dim() != 2:
        got = (
            f"{prompt.dtype} of shape {tuple(prompt.shape)}"
            if isinstance(prompt, Tensor)
            else (type(prompt).__name__)
        )
        raise TypeError(f"prompt must be a (B, P) torch.long tensor of token ids, got {got}")
    if prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (B, P) with P >= 1, got {tuple(prompt.shape)}")
    stats = SpeculativeStats()
    out = prompt
    if n:
        caches = {"target": target.new_cache(), "draft": draft.new_cache()}
        for name, cache in caches.items():  # refused by name before any call
            try:
                cache.rollback(0)
            except ValueError as error:
                raise ValueError(
                    f"speculative decoding rolls back the {name}'s cache: {error}"
                ) from None
        out = _decode(target, draft, prompt, n, k, caches["target"], caches["draft"], stats)
    return (out, stats) if return_stats else out


def _decode(target, draft, prompt, n, k, t_cache, d_cache, stats) -> Tensor:
    total = prompt.shape[1] + n
    logits = target(prompt, cache=t_cache)[:, -1]
    stats.target_calls += 1
    out = torch.cat([prompt, logits.argmax(-1, keepdim=True)], 1)
    while out.shape[1] < total:
        # out's last token is in neither cache; the draft's cache may lag one more behind
        step = min(k, total - out.shape[1] - 1)
        proposals = []
        if step:
            new = out[:, d_cache.length :]
            for _ in range(step):
                token = draft(new, cache=d_cache)[:, -1].argmax(-1, keepdim=True)
                stats.draft_calls += 1
                proposals.append(token)
                new = token
        drafted = torch.cat(proposals, 1) if proposals else out[:, :0]
        verify = target(torch.cat([out[:, t_cache.length :], drafted], 1), cache=t_cache)
        stats.target_calls += 1
        greedy = verify.argmax(-1)  # (B, step + 1): the target's token after each place
        agree = (greedy[:, :step] == drafted).long().cumprod(1).sum(1)  # accepted per row
        kept = int(agree.min()) if step else 0
        stats.proposed += step * out.shape[0]
        stats.accepted += kept * out.shape[0]
        out = torch.cat([out, drafted[:, :kept], greedy[:, kept : kept + 1]], 1)
        # the caches hold positions up to the last kept draft token, not the target's own one
        t_cache.rollback(step - kept)
        extra = d_cache.length - (out.shape[1] - 1)
        if extra > 0:
            d_cache.rollback(extra)
    return out[:, :total]
