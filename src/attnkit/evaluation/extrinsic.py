"""Extrinsic metrics that attention papers report next to the attention analysis (Brauwers
Sec. 4.1; Galassi VI): BLEU for translation and captioning, word error rate for speech,
perplexity for language models. Written from the definitions; the tests check them against
``sacrebleu`` and ``jiwer``."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["bleu", "perplexity", "word_error_rate"]

Tokens = Sequence[Hashable]


def _tokens(x: str | Tokens, name: str) -> list:
    if isinstance(x, str):
        return x.split()
    if isinstance(x, Sequence):
        return list(x)
    raise TypeError(f"{name}: each sentence must be a string or a sequence of tokens, got {x!r}")


def _ngrams(tokens: list, n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def bleu(
    hypotheses: Sequence[str | Tokens],
    references: Sequence[Sequence[str | Tokens]],
    *,
    max_order: int = 4,
) -> float:
    """Corpus BLEU (Papineni et al. 2002), in [0, 1], without smoothing:
    BLEU = BP · exp(Σ_{n=1}^{N} ¼ log p_n), p_n the corpus n-gram precision with each n-gram's
    count clipped by its largest count in any reference of the sentence, and the brevity penalty
    BP = min(1, exp(1 − r/c)), c the hypothesis length and r the sum of the reference lengths
    closest to each hypothesis (the shorter on a tie). 0 when some p_n is 0.

    Args:
        hypotheses: one sentence per example (a string is split on whitespace).
        references: for each example, its reference sentences (one or more).
    """
    if len(hypotheses) != len(references):
        raise ValueError(
            f"hypotheses ({len(hypotheses)}) and references ({len(references)}) must have one "
            "entry per example"
        )
    if isinstance(max_order, bool) or not isinstance(max_order, int) or max_order < 1:
        raise ValueError(f"max_order must be an int ≥ 1, got {max_order!r}")
    matches, totals = [0] * max_order, [0] * max_order
    c = r = 0
    for hyp, refs in zip(hypotheses, references, strict=True):
        if isinstance(refs, str) or not isinstance(refs, Sequence) or len(refs) == 0:
            raise ValueError(f"references: each entry must be a non-empty list, got {refs!r}")
        h = _tokens(hyp, "hypotheses")
        rs = [_tokens(x, "references") for x in refs]
        c += len(h)
        r += min((abs(len(x) - len(h)), len(x)) for x in rs)[1]
        for n in range(1, max_order + 1):
            counts = _ngrams(h, n)
            most = Counter()
            for x in rs:
                most |= _ngrams(x, n)  # elementwise max
            matches[n - 1] += sum(min(k, most[g]) for g, k in counts.items())
            totals[n - 1] += max(0, len(h) - n + 1)
    if c == 0 or min(matches) == 0:
        return 0.0
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / max_order
    bp = 1.0 if c > r else math.exp(1 - r / c)
    return bp * math.exp(log_p)


def _edits(ref: list, hyp: list) -> int:
    """Levenshtein distance (substitutions, deletions, insertions, each cost 1)."""
    prev = list(range(len(hyp) + 1))
    for i, a in enumerate(ref, start=1):
        cur = [i] + [0] * len(hyp)
        for j, b in enumerate(hyp, start=1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a != b))
        prev = cur
    return prev[-1]


def word_error_rate(
    references: Sequence[str | Tokens], hypotheses: Sequence[str | Tokens]
) -> float:
    """WER = (S + D + I) / N over a corpus: the word-level edit distance summed over sentences,
    divided by the number of reference words (can exceed 1)."""
    if len(references) != len(hypotheses):
        raise ValueError(
            f"references ({len(references)}) and hypotheses ({len(hypotheses)}) must pair up"
        )
    edits = words = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        r, h = _tokens(ref, "references"), _tokens(hyp, "hypotheses")
        edits += _edits(r, h)
        words += len(r)
    if words == 0:
        raise ValueError("word_error_rate: the references have no words")
    return edits / words


def perplexity(logits: Tensor, targets: Tensor, *, ignore_index: int | None = None) -> float:
    """exp of the mean negative log-likelihood per token: exp(−(1/T) Σ_t log p(y_t)).

    Args:
        logits: (…, V) unnormalised scores over the vocabulary.
        targets: (…) token ids; those equal to ``ignore_index`` (padding) do not count.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError("logits must be a floating-point Tensor (…, V)")
    if not isinstance(targets, Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError("targets must be an integer Tensor (…)")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits (…, V) {tuple(logits.shape)} and targets (…) {tuple(targets.shape)} must "
            "share the leading dims"
        )
    keep = torch.ones_like(targets, dtype=torch.bool)
    if ignore_index is not None:
        keep = targets != ignore_index
    if not bool(keep.any()):
        raise ValueError("perplexity: no target tokens to score")
    vocab = logits.shape[-1]
    outside = keep & ((targets < 0) | (targets >= vocab))
    if bool(outside.any()):
        idx = tuple(int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"targets must be token ids in [0, V = {vocab}) (logits {tuple(logits.shape)}) or "
            f"ignore_index = {ignore_index}, got {int(targets[idx])} at index {idx}"
        )
    ids = targets.masked_fill(~keep, 0).long()
    log_p = logits.double().log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return math.exp(float(-log_p[keep].mean()))
