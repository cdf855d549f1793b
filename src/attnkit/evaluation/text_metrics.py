"""Extrinsic text metrics beyond BLEU and WER (Brauwers Sec. 4.1; Galassi VI): METEOR for
translation and captioning, and the position-independent error rate (PER) for translation and
speech. Written from the definitions; the tests check METEOR against ``nltk``'s
``meteor_score`` and PER against a search over every word order.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

__all__ = ["meteor", "meteor_sentence", "position_independent_error_rate"]

Synonyms = Callable[[str], Iterable[str]]


def _words(x: object, name: str) -> list[str]:
    if isinstance(x, str):
        return x.split()
    if isinstance(x, Sequence) and all(isinstance(w, str) for w in x):
        return list(x)
    raise TypeError(f"{name}: each sentence must be a string or a sequence of str, got {x!r}")


def _crossings(pairs: Iterable[tuple[int, int]], fixed: Sequence[tuple[int, int]]) -> int:
    """Mappings (i, j), (i', j') with i < i' and j > j', among ``pairs`` and against ``fixed``."""
    pairs = list(pairs)
    every = pairs + list(fixed)
    n = 0
    for a, (i, j) in enumerate(pairs):
        for i2, j2 in every[a + 1 :]:
            n += (i - i2) * (j - j2) < 0
    return n


def _stage(
    hyp_keys: dict[int, set[str]],
    ref_keys: dict[int, set[str]],
    fixed: list[tuple[int, int]],
    search_limit: int,
) -> list[tuple[int, int]]:
    """One stage of the alignment (Banerjee & Lavie 2005, Sec. 2): the unmapped hypothesis word
    i may map to the unmapped reference word j when their key sets share a key. Returns the
    largest set of one-to-one mappings and, among the largest, the one with the fewest
    crossing mappings (counting those of earlier stages, ``fixed``), then the fewest chunks."""
    # Words sharing one key form a class; a word in several classes (synonym stage) makes the
    # classes interact, which the exact and stem stages (one key per word) never do.
    by_key_h: dict[str, list[int]] = defaultdict(list)
    by_key_r: dict[str, list[int]] = defaultdict(list)
    for i, keys in hyp_keys.items():
        for k in keys:
            by_key_h[k].append(i)
    for j, keys in ref_keys.items():
        for k in keys:
            by_key_r[k].append(j)
    single = all(len(k) <= 1 for k in hyp_keys.values()) and all(
        len(k) <= 1 for k in ref_keys.values()
    )
    if single:
        # Classes are disjoint: each contributes min(a, b) mappings; within a class the chosen
        # words are paired in order (pairing out of order only adds crossings), and which words
        # of the larger side are chosen is searched for the fewest crossings.
        classes = []
        for k in sorted(set(by_key_h) & set(by_key_r)):
            hs, rs = sorted(by_key_h[k]), sorted(by_key_r[k])
            classes.append((hs, rs, min(len(hs), len(rs))))
        total = math.prod(math.comb(len(hs), n) * math.comb(len(rs), n) for hs, rs, n in classes)
        if total > search_limit:  # too many ties to search: the leftmost words of each class
            return [p for hs, rs, n in classes for p in zip(hs[:n], rs[:n], strict=True)]
        choices = [
            [
                list(zip(h, r, strict=True))
                for h in itertools.combinations(hs, n)
                for r in itertools.combinations(rs, n)
            ]
            for hs, rs, n in classes
        ]
        best, best_key = [], (math.inf, math.inf)
        for combo in itertools.product(*choices):
            pairs = [p for c in combo for p in c]
            key = (_crossings(pairs, fixed), _chunks(pairs + fixed))
            if key < best_key:
                best, best_key = pairs, key
        return best
    # General case (several keys per word): maximum bipartite matching by augmenting paths,
    # hypothesis words in order; ties in size are not searched for fewer crossings.
    match_r: dict[int, int] = {}

    def augment(i: int, seen: set[int]) -> bool:
        for k in sorted(hyp_keys[i]):
            for j in by_key_r.get(k, ()):
                if j in seen:
                    continue
                seen.add(j)
                if j not in match_r or augment(match_r[j], seen):
                    match_r[j] = i
                    return True
        return False

    for i in sorted(hyp_keys):
        augment(i, set())
    return sorted((i, j) for j, i in match_r.items())


def _chunks(pairs: list[tuple[int, int]]) -> int:
    """The fewest runs of mappings adjacent in both sentences, in hypothesis order."""
    pairs = sorted(pairs)
    return sum(
        1
        for a, (i, j) in enumerate(pairs)
        if a == 0 or (i, j) != (pairs[a - 1][0] + 1, pairs[a - 1][1] + 1)
    )


def _check_stage(x: object, name: str) -> None:
    if x is not None and not callable(x):
        raise TypeError(f"{name} must be None or a callable str -> str, got {x!r}")


def meteor_sentence(
    hypothesis: str | Sequence[str],
    references: Sequence[str | Sequence[str]],
    *,
    stemmer: Callable[[str], str] | None = None,
    synonyms: Synonyms | None = None,
    lowercase: bool = True,
    alpha: float = 0.9,
    beta: float = 3.0,
    gamma: float = 0.5,
    search_limit: int = 4096,
) -> float:
    """METEOR of one hypothesis (Banerjee & Lavie 2005), the best over its references.

    Unigrams are aligned in stages, each mapping only words left unmapped by the earlier ones:
    **exact** (the same word, after lower-casing with ``lowercase``), then **stem** (the same
    ``stemmer(word)``, e.g. ``nltk.stem.PorterStemmer().stem``; skipped when None), then
    **synonym** (hypothesis word h and reference word r map when r ∈ ``synonyms(h)``, e.g. the
    WordNet lemma names of h's synsets; skipped when None). Each stage takes the largest set
    of mappings and, among the largest, the one with the fewest crossing mappings (the paper's
    rule), then the fewest chunks; the tie-break is searched exactly in the exact and stem
    stages while there are at most ``search_limit`` tied candidates (beyond that the leftmost
    words of each word class are mapped), and not in the synonym stage (a maximum matching).

    With m mappings, a hypothesis of t words, a reference of r words and ch chunks (runs of
    mappings adjacent in both sentences):

        P = m / t,  R = m / r,  F_mean = P R / (α P + (1 − α) R)   (α = 0.9: 10PR / (R + 9P))
        Penalty = γ (ch / m)^β   (γ = 0.5, β = 3),  METEOR = F_mean (1 − Penalty),

    and 0 when nothing maps. ``nltk.translate.meteor_score`` computes the same formula with a
    greedy alignment (each hypothesis word from the last to the last unmapped equal reference
    word); the two agree whenever the alignment is unique (no word or stem repeated on either
    side) and may differ otherwise: on nltk's own example ("It is a guide to action which
    ensures that the military always obeys the commands of the party") nltk maps the last "the"
    and counts 6 chunks (0.6944), this function the "the" after "that" and 4 chunks (0.7270).

    Args:
        hypothesis: a string (split on whitespace) or a list of words.
        references: one or more references, each a string or a list of words.
    """
    h = _words(hypothesis, "hypothesis")
    if isinstance(references, str) or not isinstance(references, Sequence) or not references:
        raise ValueError(
            f"references must be a non-empty list of sentences (one hypothesis may have several "
            f"references), got {references!r}"
        )
    rs = [_words(r, "references") for r in references]
    _check_stage(stemmer, "stemmer")
    _check_stage(synonyms, "synonyms")
    for name, value in (("alpha", alpha), ("gamma", gamma)):
        if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not isinstance(beta, int | float) or isinstance(beta, bool) or beta <= 0:
        raise ValueError(f"beta must be a number > 0, got {beta!r}")
    if isinstance(search_limit, bool) or not isinstance(search_limit, int) or search_limit < 1:
        raise ValueError(f"search_limit must be an int ≥ 1, got {search_limit!r}")
    if lowercase:
        h = [w.lower() for w in h]
        rs = [[w.lower() for w in r] for r in rs]
    return max(_meteor_pair(h, r, stemmer, synonyms, alpha, beta, gamma, search_limit) for r in rs)


def _meteor_pair(
    h: list[str],
    r: list[str],
    stemmer: Callable[[str], str] | None,
    synonyms: Synonyms | None,
    alpha: float,
    beta: float,
    gamma: float,
    search_limit: int,
) -> float:
    pairs: list[tuple[int, int]] = []
    keys: list[Callable[[str], str]] = [str]
    if stemmer is not None:
        keys.append(lambda w: str(stemmer(w)))
    for key in keys:
        done_h, done_r = {i for i, _ in pairs}, {j for _, j in pairs}
        free_h = {i: {key(w)} for i, w in enumerate(h) if i not in done_h}
        free_r = {j: {key(w)} for j, w in enumerate(r) if j not in done_r}
        pairs += _stage(free_h, free_r, pairs, search_limit)
    if synonyms is not None:
        # One key per related pair: the stage becomes a maximum matching on that graph.
        done_h, done_r = {i for i, _ in pairs}, {j for _, j in pairs}
        free_h, free_r = {}, defaultdict(set)
        for i, w in enumerate(h):
            if i in done_h:
                continue
            near = set(synonyms(w))
            free_h[i] = {f"{i}:{j}" for j, v in enumerate(r) if j not in done_r and v in near}
            for k in free_h[i]:
                free_r[int(k.split(":")[1])].add(k)
        pairs += _stage(free_h, dict(free_r), pairs, search_limit)
    m = len(pairs)
    if m == 0:
        return 0.0
    p, rec = m / len(h), m / len(r)
    f_mean = p * rec / (alpha * p + (1 - alpha) * rec)
    penalty = gamma * (_chunks(pairs) / m) ** beta
    return f_mean * (1 - penalty)


def meteor(
    hypotheses: Sequence[str | Sequence[str]],
    references: Sequence[Sequence[str | Sequence[str]]],
    **kwargs: object,
) -> float:
    """The mean of :func:`meteor_sentence` over a corpus, in [0, 1]: ``hypotheses[i]`` scored
    against its references ``references[i]``. Keyword arguments go to
    :func:`meteor_sentence`."""
    if isinstance(hypotheses, str) or not isinstance(hypotheses, Sequence):
        raise TypeError(f"hypotheses must be a list of sentences, got {type(hypotheses).__name__}")
    if len(hypotheses) != len(references):
        raise ValueError(
            f"hypotheses ({len(hypotheses)}) and references ({len(references)}) must have one "
            "entry per example"
        )
    if not hypotheses:
        raise ValueError("meteor: no sentences to score")
    scores = [
        meteor_sentence(h, r, **kwargs)  # type: ignore[arg-type]
        for h, r in zip(hypotheses, references, strict=True)
    ]
    return sum(scores) / len(scores)


def position_independent_error_rate(
    references: Sequence[str | Sequence[str]], hypotheses: Sequence[str | Sequence[str]]
) -> float:
    """PER (Tillmann et al. 1997), the word error rate when word order is ignored: each
    sentence's words as a bag, (max(r, t) − matches) / r summed over the corpus as
    Σ (max(r, t) − matches) / Σ r, r and t the reference and hypothesis lengths and matches
    Σ_w min(count_ref(w), count_hyp(w)) — the fewest substitutions, insertions and deletions
    that turn one bag into the other. PER ≤ WER; it can exceed 1 (a long hypothesis)."""
    if isinstance(references, str) or isinstance(hypotheses, str):
        raise TypeError("references and hypotheses must be lists of sentences, not one string")
    if len(references) != len(hypotheses):
        raise ValueError(
            f"references ({len(references)}) and hypotheses ({len(hypotheses)}) must pair up"
        )
    errors = words = 0
    for ref, hyp in zip(references, hypotheses, strict=True):
        r, t = _words(ref, "references"), _words(hyp, "hypotheses")
        count: dict[str, int] = defaultdict(int)
        for w in r:
            count[w] += 1
        matches = 0
        for w in t:
            if count[w] > 0:
                count[w] -= 1
                matches += 1
        errors += max(len(r), len(t)) - matches
        words += len(r)
    if words == 0:
        raise ValueError("position_independent_error_rate: the references have no words")
    return errors / words
