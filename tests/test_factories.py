"""The test factories must cover every registered part (so contract tests cover them)."""

from factories import ALIGNMENTS, SCORES, registered

import attnkit as ak


def test_factories_cover_score_registry():
    assert {registered(n) for n in SCORES} == set(ak.scores.available())


def test_factories_cover_alignment_registry():
    assert {registered(n) for n in ALIGNMENTS} == set(ak.alignments.available())
