"""BLEU against sacrebleu, WER against jiwer, perplexity by hand."""

import math
import random

import jiwer
import pytest
import sacrebleu
import torch

from attnkit.evaluation.extrinsic import bleu, perplexity, word_error_rate

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "red", "big", "ran"]


def sentence(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_bleu_matches_sacrebleu_with_several_references():
    rng = random.Random(0)
    scores = []
    for trial in range(20):
        n = rng.randint(1, 6)
        refs = [[sentence(rng, rng.randint(3, 12)) for _ in range(2)] for _ in range(n)]
        hyps = [
            rng.choice(r) if rng.random() < 0.3 else sentence(rng, rng.randint(2, 12)) for r in refs
        ]
        ref = sacrebleu.BLEU(tokenize="none", smooth_method="none").corpus_score(
            hyps, [list(x) for x in zip(*refs, strict=True)]
        )
        assert bleu(hyps, refs) == pytest.approx(ref.score / 100, abs=1e-9), trial
        scores.append(ref.score)
    assert sum(0 < s < 100 for s in scores) >= 5  # not only the trivial 0 and 100


def test_bleu_by_hand():
    assert bleu(["a b c d"], [["a b c d"]]) == pytest.approx(1.0)
    assert bleu(["a b c"], [["x y z"]]) == 0.0
    # brevity: a perfect 4-word prefix of an 8-word reference: BP = exp(1 - 8/4)
    assert bleu([["a", "b", "c", "d"]], [["a b c d e f g h"]]) == pytest.approx(math.exp(-1))


def test_word_error_rate_matches_jiwer():
    rng = random.Random(1)
    refs = [sentence(rng, rng.randint(1, 10)) for _ in range(30)]
    hyps = [sentence(rng, rng.randint(0, 10)) for _ in range(30)]
    assert word_error_rate(refs, hyps) == pytest.approx(jiwer.wer(refs, hyps))


def test_word_error_rate_by_hand():
    # one substitution (sat -> sits), one deletion (the), one insertion (now): 3 / 6
    assert word_error_rate(["the cat sat on the mat"], ["the cat sits on mat now"]) == 0.5


def test_perplexity_by_hand():
    v = 7
    assert perplexity(torch.zeros(2, 5, v), torch.zeros(2, 5, dtype=torch.long)) == pytest.approx(v)
    logits = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.5, 0.25], [1.0, 1.0, 1.0]]).log()
    targets = torch.tensor([0, 0, -100])
    # probabilities 0.5 and 0.25: exp(-(log 0.5 + log 0.25)/2) = √8
    assert perplexity(logits, targets, ignore_index=-100) == pytest.approx(math.sqrt(8))


def test_errors():
    with pytest.raises(ValueError, match="one entry per example"):
        bleu(["a"], [])
    with pytest.raises(ValueError, match="non-empty list"):
        bleu(["a"], ["a"])
    with pytest.raises(ValueError, match="no words"):
        word_error_rate([""], ["a"])
    with pytest.raises(ValueError, match="leading dims"):
        perplexity(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="targets"):
        perplexity(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(ValueError, match="no target tokens"):
        perplexity(torch.zeros(1, 3), torch.tensor([0]), ignore_index=0)


BAD_CALLS = [
    (
        "target id = V",
        lambda: perplexity(torch.randn(2, 3, 5), torch.full((2, 3), 5)),
        ValueError,
        r"targets must be token ids in \[0, V = 5\).*got 5 at index \(0, 0\)",
    ),
    (
        "negative target id",
        lambda: perplexity(torch.randn(2, 3, 5), torch.tensor([[0, 1, -2], [0, 0, 0]])),
        ValueError,
        r"got -2 at index \(0, 2\)",
    ),
    (
        "integer logits",
        lambda: perplexity(torch.ones(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long)),
        TypeError,
        r"logits must be a floating-point",
    ),
    (
        "float targets",
        lambda: perplexity(torch.randn(2, 5), torch.zeros(2)),
        TypeError,
        r"targets must be an integer",
    ),
    (
        "leading dims differ",
        lambda: perplexity(torch.randn(2, 5), torch.zeros(3, dtype=torch.long)),
        ValueError,
        r"must share the leading dims",
    ),
]


@pytest.mark.parametrize(
    ("call", "error", "message"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_calls_name_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_perplexity_ignored_ids_may_lie_outside_the_vocabulary():
    logits = torch.zeros(1, 3, 4)  # uniform over V = 4: perplexity 4
    targets = torch.tensor([[1, -100, 2]])
    assert perplexity(logits, targets, ignore_index=-100) == pytest.approx(4.0)
