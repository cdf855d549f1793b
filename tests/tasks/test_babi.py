"""The world simulator's stories: replayed sentence by sentence here, every question's answer and
supporting facts follow from the story (an independent reading of the generated words)."""

from __future__ import annotations

import pytest
import torch

from attnkit.tasks.babi import COUNTS, KINDS, OBJECTS, PEOPLE, PLACES, VOCAB, WORD, make_babi


def _replay(sentences: list[list[str]]):
    """Where everyone is, who carries what, and which sentences established it."""
    at, moved = {}, {}  # person -> place, sentence of the last move
    carried_by, fact, obj_at, obj_move = {}, {}, {}, {}
    handled = {p: [] for p in PEOPLE}
    for s, words in enumerate(sentences):
        who, obj = words[0], words[-1]
        if words[-1] in PLACES:  # "who <verb> to the place"
            at[who], moved[who] = words[-1], s
            continue
        assert obj in OBJECTS
        fact[obj] = s
        handled[who].append(s)
        if words[1] in ("picked", "got", "took"):
            assert obj not in carried_by  # nobody picks up a carried object
            carried_by[obj] = who
        else:
            assert carried_by.pop(obj) == who  # only the carrier drops it
            obj_at[obj], obj_move[obj] = at.get(who), moved.get(who)
    return at, moved, carried_by, fact, obj_at, obj_move, handled


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_answer_and_support_follows_from_the_story(kind):
    data = make_babi(300, kind=kind, seed=5)
    spec = KINDS[kind]
    for e in range(300):
        real = [s for s in range(spec.max_sentences) if data.mask[e, s].any()]
        assert real == list(range(len(real))) and len(real) >= 2
        words = [[VOCAB[w] for w in data.story[e, s].tolist() if w] for s in real]
        question = [VOCAB[w] for w in data.question[e].tolist() if w]
        answer = VOCAB[int(data.answer[e])]
        gold = data.gold[e].nonzero().flatten().tolist()
        at, moved, carried_by, fact, obj_at, obj_move, handled = _replay(words)
        if kind == "single":
            assert all(w[-1] in PLACES for w in words)
        if kind in ("single", "two-facts"):
            assert question[:2] == ["where", "is"]
        if kind == "single":
            who = question[2]
            assert answer == at[who] and gold == [moved[who]]
        elif kind == "two-facts":
            obj = question[-1]
            if obj in carried_by:  # carried: where the carrier is now
                who = carried_by[obj]
                expected, support = at[who], (fact[obj], moved[who])
            else:  # dropped: where its carrier was then
                expected, support = obj_at[obj], (fact[obj], obj_move[obj])
            assert answer == expected
            assert tuple(data.supports[e].tolist()) == support and gold == sorted(support)
        elif kind == "yes-no":
            assert question[0] == "is" and question[2:4] == ["in", "the"]
            who, place = question[1], question[4]
            assert answer == ("yes" if at[who] == place else "no") and gold == [moved[who]]
        else:
            who = question[4]
            assert question == ["how", "many", "objects", "is", who, "carrying"]
            count = sum(c == who for c in carried_by.values())
            assert answer == COUNTS[count] and gold == handled[who] and gold
    assert (data.mask == (data.story != WORD["<pad>"])).all()


def test_answers_are_spread_over_their_words():
    for kind, words in (("two-facts", PLACES), ("yes-no", ("yes", "no"))):
        answers = make_babi(600, kind=kind, seed=0).answer
        counts = torch.bincount(answers, minlength=len(VOCAB))[[WORD[w] for w in words]]
        assert counts.min() > 0.5 * 600 / len(words)
    counts = torch.bincount(make_babi(600, kind="counting", seed=0).answer, minlength=len(VOCAB))
    assert all(counts[WORD[c]] > 0 for c in COUNTS)


def test_generation_is_reproducible_seeded_and_checked():
    for kind in KINDS:
        a, b = make_babi(20, kind=kind, seed=1), make_babi(20, kind=kind, seed=1)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        assert not torch.equal(a.story, make_babi(20, kind=kind, seed=2).story)
    with pytest.raises(ValueError, match="kind must be one of"):
        make_babi(3, kind="three-facts")
