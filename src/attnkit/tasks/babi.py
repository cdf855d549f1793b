"""bAbI-style stories from a small world simulator (Weston et al. 2015, "Towards AI-Complete
Question Answering": tasks 1, 2, 6 and 7), generated locally with their supporting facts.

People move between places and pick up and drop objects; a story is the list of those events,
one sentence each, and the question is about the world at its end. Four kinds:

- ``single`` (task 1, single supporting fact): "where is mary" — her last move.
- ``two-facts`` (task 2, two supporting facts): "where is the football" — the last sentence in
  which it was picked up or dropped, then the last move of the person who did it before that
  sentence (if it was dropped) or before the question (if it is still carried).
- ``yes-no`` (task 6): "is mary in the kitchen" — yes or no, from her last move.
- ``counting`` (task 7): "how many objects is mary carrying" — none … three; every sentence in
  which she picked up or dropped something supports the answer.

Every answer is a word of :data:`VOCAB`; the supporting facts are the gold attention.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["KINDS", "VOCAB", "WORD", "BabiData", "make_babi"]

PEOPLE = ("mary", "john", "sandra", "daniel")
PLACES = ("kitchen", "garden", "office", "hallway", "bathroom", "bedroom")
OBJECTS = ("football", "apple", "milk")
VERBS = ("moved", "went", "journeyed", "travelled")
GETS = (("picked", "up"), ("got",), ("took",))
DROPS = (("dropped",), ("discarded",), ("put", "down"))
COUNTS = ("none", "one", "two", "three")
# Id 0 pads; the answer is a word of the same vocabulary (as in the paper, W maps to words).
VOCAB = (
    "<pad>", *PEOPLE, *PLACES, *VERBS, "to", "the", "where", "is",
    *OBJECTS, "picked", "up", "got", "took", "dropped", "discarded", "put", "down",
    "how", "many", "objects", "carrying", "in", "yes", "no", *COUNTS,
)  # fmt: skip
WORD = {w: i for i, w in enumerate(VOCAB)}
SENTENCE = 5  # "mary moved to the kitchen", "mary picked up the milk"


class Kind(NamedTuple):
    max_sentences: int  # stories have 2 … max_sentences sentences
    question: int  # words in the question
    supports: int  # supporting facts in order (0: a variable set, see BabiData.gold)


KINDS = {
    "single": Kind(10, 3, 1),
    "two-facts": Kind(12, 4, 2),
    "yes-no": Kind(10, 5, 1),
    "counting": Kind(12, 6, 0),
}


class BabiData(NamedTuple):
    """story (N, n, L) word ids, 0 = padding; mask (N, n, L) True = a real word; question
    (N, L_q); answer (N,) word id; gold (N, n) True = a supporting fact; supports (N, k) the
    supporting facts in the order the question needs them (k = 0 for counting)."""

    story: Tensor
    mask: Tensor
    question: Tensor
    answer: Tensor
    gold: Tensor
    supports: Tensor


def _ids(words: tuple[str, ...] | list[str], length: int) -> list[int]:
    ids = [WORD[w] for w in words]
    return ids + [0] * (length - len(ids))


def make_babi(n: int, *, kind: str = "single", seed: int = 0) -> BabiData:
    """``n`` stories of one ``kind`` (see :data:`KINDS`), reproducibly from ``seed``. Each
    question has a definite answer (the person asked about has moved, the object's place is
    known, the person counted has picked up or dropped something)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    spec = KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    story = torch.zeros(n, spec.max_sentences, SENTENCE, dtype=torch.long)
    question = torch.zeros(n, spec.question, dtype=torch.long)
    answer = torch.zeros(n, dtype=torch.long)
    gold = torch.zeros(n, spec.max_sentences, dtype=torch.bool)
    supports = torch.zeros(n, spec.supports, dtype=torch.long)
    make = _single if kind == "single" else _world
    for e in range(n):
        while True:  # draw until the question has an answer
            made = make(g, kind, spec)
            if made is not None:
                break
        sentences, q, a, facts = made
        for s, words in enumerate(sentences):
            story[e, s] = torch.tensor(_ids(words, SENTENCE))
        question[e] = torch.tensor(_ids(q, spec.question))
        answer[e] = WORD[a]
        gold[e, list(facts)] = True
        if spec.supports:
            supports[e] = torch.tensor(facts)
    return BabiData(story, story != 0, question, answer, gold, supports)


def _pick(g: torch.Generator, k: int) -> int:
    return int(torch.randint(0, k, (1,), generator=g))


def _single(g: torch.Generator, kind: str, spec: Kind):
    """Task 1: moves only."""
    length = 2 + _pick(g, spec.max_sentences - 1)
    sentences, last = [], {}
    for s in range(length):
        who, verb, where = (
            PEOPLE[_pick(g, len(PEOPLE))],
            VERBS[_pick(g, len(VERBS))],
            PLACES[_pick(g, len(PLACES))],
        )
        sentences.append((who, verb, "to", "the", where))
        last[who] = (s, where)
    asked = sorted(last)[_pick(g, len(last))]
    s, place = last[asked]
    return sentences, ("where", "is", asked), place, (s,)


def _world(g: torch.Generator, kind: str, spec: Kind):
    """Tasks 2, 6 and 7: people move, pick up and drop objects. Returns None when the drawn
    story leaves the question without an answer (the caller draws again)."""
    length = 2 + _pick(g, spec.max_sentences - 1)
    place: dict[str, tuple[int, str]] = {}  # person -> (sentence of the last move, place)
    holder: dict[str, str] = {}  # object -> the person carrying it
    where_obj: dict[str, tuple[int, int | None, str | None]] = {}  # obj -> (fact, move, place)
    handled: dict[str, list[int]] = {p: [] for p in PEOPLE}  # person -> get/drop sentences
    sentences: list[tuple[str, ...]] = []
    for s in range(length):
        who = PEOPLE[_pick(g, len(PEOPLE))]
        carried = [o for o in OBJECTS if holder.get(o) == who]
        free = [o for o in OBJECTS if o not in holder]
        act = _pick(g, 10)
        if act < 4 or (act < 7 and not free) or (act >= 7 and not carried):
            where = PLACES[_pick(g, len(PLACES))]
            sentences.append((who, VERBS[_pick(g, len(VERBS))], "to", "the", where))
            place[who] = (s, where)
            for o in carried:
                where_obj[o] = (where_obj[o][0], s, where)
        elif act < 7:
            obj = free[_pick(g, len(free))]
            sentences.append((who, *GETS[_pick(g, len(GETS))], "the", obj))
            holder[obj] = who
            move, at = place.get(who, (None, None))
            where_obj[obj] = (s, move, at)
            handled[who].append(s)
        else:
            obj = carried[_pick(g, len(carried))]
            sentences.append((who, *DROPS[_pick(g, len(DROPS))], "the", obj))
            del holder[obj]
            move, at = place.get(who, (None, None))
            where_obj[obj] = (s, move, at)
            handled[who].append(s)
    if kind == "two-facts":
        known = sorted(o for o, (_, move, _) in where_obj.items() if move is not None)
        if not known:
            return None
        obj = known[_pick(g, len(known))]
        fact, move, at = where_obj[obj]
        return sentences, ("where", "is", "the", obj), at, (fact, move)
    if kind == "yes-no":
        if not place:
            return None
        asked = sorted(place)[_pick(g, len(place))]
        move, at = place[asked]
        if _pick(g, 2):
            return sentences, ("is", asked, "in", "the", at), "yes", (move,)
        other = [p for p in PLACES if p != at][_pick(g, len(PLACES) - 1)]
        return sentences, ("is", asked, "in", "the", other), "no", (move,)
    counted = sorted(p for p in PEOPLE if handled[p])  # counting
    if not counted:
        return None
    asked = counted[_pick(g, len(counted))]
    count = sum(holder.get(o) == asked for o in OBJECTS)
    question = ("how", "many", "objects", "is", asked, "carrying")
    return sentences, question, COUNTS[count], tuple(handled[asked])
