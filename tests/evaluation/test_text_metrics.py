import itertools
import random

import pytest

from attnkit.evaluation.extrinsic import word_error_rate
from attnkit.evaluation.text_metrics import (
    meteor,
    meteor_sentence,
    position_independent_error_rate,
)


def suffix_stem(word: str) -> str:
    """A toy stemmer for the tests: drops a final "s", "ing" or "ed"."""
    for end in ("ing", "ed", "s"):
        if word.endswith(end) and len(word) > len(end) + 2:
            return word[: -len(end)]
    return word


def reference_meteor(h, r, stem=None, alpha=0.9, beta=3.0, gamma=0.5):
    """Every one-to-one alignment, stage by stage (exact, then stem), each stage the most
    mappings, then the fewest crossings, then the fewest chunks (Banerjee & Lavie 2005)."""
    h, r = [w.lower() for w in h], [w.lower() for w in r]

    def crossings(pairs):
        return sum((i - i2) * (j - j2) < 0 for (i, j), (i2, j2) in itertools.combinations(pairs, 2))

    def chunks(pairs):
        pairs = sorted(pairs)
        return sum(
            1
            for a, p in enumerate(pairs)
            if a == 0 or p != (pairs[a - 1][0] + 1, pairs[a - 1][1] + 1)
        )

    def matchings(edges):
        # every set of disjoint edges
        out = [[]]
        for e in edges:
            out += [[*m, e] for m in out if all(e[0] != x[0] and e[1] != x[1] for x in m)]
        return out

    fixed = []
    for key in [lambda w: w] + ([stem] if stem else []):
        hi = [i for i in range(len(h)) if i not in {p[0] for p in fixed}]
        rj = [j for j in range(len(r)) if j not in {p[1] for p in fixed}]
        edges = [(i, j) for i in hi for j in rj if key(h[i]) == key(r[j])]
        best = min(
            matchings(edges),
            key=lambda m: (-len(m), crossings(m + fixed), chunks(m + fixed)),
        )
        fixed += best
    m = len(fixed)
    if m == 0:
        return 0.0
    p, rec = m / len(h), m / len(r)
    f = p * rec / (alpha * p + (1 - alpha) * rec)
    return f * (1 - gamma * (chunks(fixed) / m) ** beta)


def test_meteor_matches_an_exhaustive_alignment_search():
    rng = random.Random(0)
    vocab = [
        "the",
        "cat",
        "cats",
        "sat",
        "sitting",
        "on",
        "mat",
        "mats",
        "a",
        "dog",
        "runs",
        "ran",
        "running",
    ]
    for _ in range(150):
        h = [rng.choice(vocab) for _ in range(rng.randint(1, 6))]
        r = [rng.choice(vocab) for _ in range(rng.randint(1, 6))]
        assert meteor_sentence(h, [r]) == pytest.approx(reference_meteor(h, r), abs=1e-12)
        assert meteor_sentence(h, [r], stemmer=suffix_stem) == pytest.approx(
            reference_meteor(h, r, suffix_stem), abs=1e-12
        )


def test_meteor_worked_example():
    # nltk's doctest pair. Exact stage: It is a guide to action (0-5 -> 0-5), ensures 7->7,
    # that 8->8, the 9->9 (the "the" after "that": no crossing, one chunk with its
    # neighbours), military 10->10, commands 14->15, party 17->14 (lower-cased): m = 12,
    # chunks [0-5] [7-10] [14] [17] = 4; P = 12/18, R = 12/16.
    h = (
        "It is a guide to action which ensures that the military always obeys the commands of "
        "the party"
    )
    r = "It is a guide to action that ensures that the military will forever heed Party commands"
    p, rec = 12 / 18, 12 / 16
    f_mean = 10 * p * rec / (rec + 9 * p)
    assert meteor_sentence(h, [r]) == pytest.approx(f_mean * (1 - 0.5 * (4 / 12) ** 3))
    # nltk maps the last "the" (16 -> 9): 6 chunks
    assert f_mean * (1 - 0.5 * (6 / 12) ** 3) == pytest.approx(0.6944, abs=1e-4)


def test_meteor_against_nltk_where_the_alignment_is_unique():
    nltk_meteor = pytest.importorskip("nltk.translate.meteor_score", reason="nltk not installed")
    from nltk.stem.porter import PorterStemmer

    class NoSynonyms:  # WordNet needs a corpus download; the stem and exact stages do not
        def synsets(self, word):
            return []

    stem = PorterStemmer().stem
    rng = random.Random(1)
    vocab = [
        "the",
        "cat",
        "cats",
        "sat",
        "sitting",
        "on",
        "mat",
        "mats",
        "a",
        "dog",
        "runs",
        "ran",
        "running",
        "quickly",
        "slowly",
    ]
    checked = 0
    for _ in range(300):
        h = rng.sample(vocab, rng.randint(1, 7))
        r = rng.sample(vocab, rng.randint(1, 7))
        stems = [stem(w) for w in h], [stem(w) for w in r]
        if len(set(stems[0])) < len(h) or len(set(stems[1])) < len(r):
            continue  # a repeated stem: several alignments, nltk picks greedily
        ours = meteor_sentence(h, [r], stemmer=stem)
        theirs = nltk_meteor.meteor_score([r], h, wordnet=NoSynonyms())
        assert ours == pytest.approx(theirs, abs=1e-12)
        checked += 1
    assert checked > 50


def test_meteor_synonym_stage_against_nltk():
    nltk_meteor = pytest.importorskip("nltk.translate.meteor_score", reason="nltk not installed")
    table = {"big": {"large", "big"}, "quick": {"fast", "quick"}, "couch": {"sofa", "couch"}}

    class Lemma:
        def __init__(self, name):
            self._name = name

        def name(self):
            return self._name

    class Synset:
        def __init__(self, names):
            self._names = names

        def lemmas(self):
            return [Lemma(n) for n in sorted(self._names)]

    class TinyWordNet:
        def synsets(self, word):
            return [Synset(table[word])] if word in table else []

    h = ["a", "big", "dog", "jumped", "on", "the", "quick", "couch"]
    r = ["the", "large", "dog", "leapt", "onto", "a", "fast", "sofa"]
    ours = meteor_sentence(h, [r], synonyms=lambda w: table.get(w, ()), stemmer=lambda w: w)
    theirs = nltk_meteor.meteor_score([r], h, wordnet=TinyWordNet(), stemmer=_Identity())
    assert ours == pytest.approx(theirs, abs=1e-12)
    assert ours > meteor_sentence(h, [r])  # the synonyms map three more words


class _Identity:
    def stem(self, word):
        return word


def test_meteor_properties():
    assert meteor_sentence("the cat sat", ["the cat sat"]) == pytest.approx(1 - 0.5 * (1 / 3) ** 3)
    assert meteor_sentence("dog", ["cat"]) == 0.0
    # the best of several references
    assert meteor_sentence("a b c", ["x y", "a b c"]) == meteor_sentence("a b c", ["a b c"])
    assert meteor(["a b", "c d"], [["a b"], ["x"]]) == pytest.approx(
        (meteor_sentence("a b", ["a b"]) + 0.0) / 2
    )
    assert meteor_sentence("The Cat", ["the cat"]) == meteor_sentence("the cat", ["the cat"])
    assert meteor_sentence("The Cat", ["the cat"], lowercase=False) == 0.0


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: meteor_sentence("a", "a"), ValueError, "references"),
        (lambda: meteor_sentence("a", []), ValueError, "references"),
        (lambda: meteor_sentence(3, ["a"]), TypeError, "hypothesis"),
        (lambda: meteor_sentence(["a", 1], ["a"]), TypeError, "hypothesis"),
        (lambda: meteor_sentence("a", ["a"], stemmer="porter"), TypeError, "stemmer"),
        (lambda: meteor_sentence("a", ["a"], alpha=2), ValueError, "alpha"),
        (lambda: meteor_sentence("a", ["a"], beta=0), ValueError, "beta"),
        (lambda: meteor_sentence("a", ["a"], search_limit=0), ValueError, "search_limit"),
        (lambda: meteor(["a"], [["a"], ["b"]]), ValueError, "one entry per example"),
        (lambda: meteor([], []), ValueError, "no sentences"),
        (lambda: meteor("a b", [["a"]]), TypeError, "hypotheses"),
    ],
)
def test_meteor_bad_calls(call, error, match):
    with pytest.raises(error, match=match):
        call()


def reference_per(ref, hyp):
    """The fewest substitutions, insertions and deletions when the hypothesis may be reordered
    freely: the fewest position mismatches over every order of the hypothesis."""
    r, h = ref.split(), hyp.split()
    n = max(len(r), len(h))
    r, h = r + [None] * (n - len(r)), h + [None] * (n - len(h))
    return min(
        sum(a != b for a, b in zip(r, perm, strict=True)) for perm in itertools.permutations(h)
    )


def test_per_matches_a_search_over_word_orders():
    rng = random.Random(0)
    vocab = ["a", "b", "c", "d", "e"]
    refs, hyps, errors, words = [], [], 0, 0
    for _ in range(40):
        ref = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 5)))
        hyp = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 5)))
        assert position_independent_error_rate([ref], [hyp]) == pytest.approx(
            reference_per(ref, hyp) / len(ref.split())
        )
        assert position_independent_error_rate([ref], [hyp]) <= word_error_rate([ref], [hyp])
        refs.append(ref)
        hyps.append(hyp)
        errors += reference_per(ref, hyp)
        words += len(ref.split())
    assert position_independent_error_rate(refs, hyps) == pytest.approx(errors / words)


def test_per_ignores_order_only():
    assert position_independent_error_rate(["a b c"], ["c b a"]) == 0.0
    assert word_error_rate(["a b c"], ["c b a"]) > 0
    assert position_independent_error_rate(["a b"], ["a b c d"]) == 1.0  # two insertions / 2


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: position_independent_error_rate(["a"], ["a", "b"]), ValueError, "pair up"),
        (lambda: position_independent_error_rate([""], ["a"]), ValueError, "no words"),
        (lambda: position_independent_error_rate("a b", "a b"), TypeError, "lists"),
        (lambda: position_independent_error_rate([3], ["a"]), TypeError, "references"),
    ],
)
def test_per_bad_calls(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_meteor_many_ties_fall_back_without_enumerating():
    # 40 "the" against 20: C(40, 20) candidate subsets, far beyond search_limit
    h = " ".join(["the"] * 40)
    r = " ".join(["the"] * 20)
    p, rec = 20 / 40, 1.0
    f_mean = p * rec / (0.9 * p + 0.1 * rec)
    assert meteor_sentence(h, [r]) == pytest.approx(f_mean * (1 - 0.5 * (1 / 20) ** 3))
