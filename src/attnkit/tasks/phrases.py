"""English → Spanish sentences of a small grammar with their exact word alignment: the data of
``examples/seq2seq_en_es.tsv`` and of the ``seq2seq`` task's example runs.

A sentence is ``DET [ADJ] SUBJECT [does not] VERB DET [ADJ] OBJECT``, e.g. "the small girl does
not want a red car" → "la niña pequeña no quiere un coche rojo". Spanish puts the adjective
after its noun and makes the determiner and the adjective agree with the noun's gender, so the
alignment crosses and the model must read the noun to write the words around it. Every word is
translated by one word, which gives the gold alignment exactly: a sure link between each word
and its translation, and a possible link from "does" to the verb (the English auxiliary carries
what the Spanish verb's ending says; "not" is "no"). Links are written in the Pharaoh format,
``i-j`` sure and ``i?j`` possible, i the source word and j the target word, from 0.

The sentences are correct Spanish: subjects are people and animals, objects are things (no
personal "a" is needed).
"""

from __future__ import annotations

import random
from pathlib import Path

__all__ = ["Pair", "make_pairs", "write_tsv"]

SUBJECTS = {  # English: (Spanish, gender)
    "dog": ("perro", "m"), "cat": ("gato", "m"), "boy": ("niño", "m"),
    "girl": ("niña", "f"), "man": ("hombre", "m"), "woman": ("mujer", "f"),
}  # fmt: skip
OBJECTS = {
    "book": ("libro", "m"), "car": ("coche", "m"), "hat": ("sombrero", "m"),
    "house": ("casa", "f"), "table": ("mesa", "f"), "flower": ("flor", "f"),
    "ball": ("pelota", "f"), "key": ("llave", "f"),
}  # fmt: skip
ADJECTIVES = {  # English: (masculine, feminine)
    "small": ("pequeño", "pequeña"), "red": ("rojo", "roja"), "new": ("nuevo", "nueva"),
    "old": ("viejo", "vieja"), "white": ("blanco", "blanca"), "black": ("negro", "negra"),
    "big": ("grande", "grande"),
}  # fmt: skip
DETERMINERS = {"the": ("el", "la"), "a": ("un", "una")}
VERBS = {  # English 3rd person, English base form, Spanish 3rd person
    "sees": ("see", "ve"), "has": ("have", "tiene"), "wants": ("want", "quiere"),
    "finds": ("find", "encuentra"), "takes": ("take", "toma"), "buys": ("buy", "compra"),
}  # fmt: skip

Pair = tuple[str, str, str]
"""(English sentence, Spanish sentence, Pharaoh alignment)."""


def _phrase(rng: random.Random, nouns: dict) -> tuple[list[str], list[str], list[tuple[int, int]]]:
    """A noun phrase: English words, Spanish words and the (English, Spanish) word links,
    counted inside the phrase."""
    det = rng.choice(sorted(DETERMINERS))
    noun = rng.choice(sorted(nouns))
    spanish, gender = nouns[noun]
    g = 0 if gender == "m" else 1
    if rng.random() < 0.5:
        return [det, noun], [DETERMINERS[det][g], spanish], [(0, 0), (1, 1)]
    adj = rng.choice(sorted(ADJECTIVES))
    english = ["an" if det == "a" and adj[0] in "aeiou" else det, adj, noun]
    return english, [DETERMINERS[det][g], spanish, ADJECTIVES[adj][g]], [(0, 0), (1, 2), (2, 1)]


def _sentence(rng: random.Random) -> Pair:
    en1, es1, links1 = _phrase(rng, SUBJECTS)
    verb = rng.choice(sorted(VERBS))
    base, es_verb = VERBS[verb]
    en, es = list(en1), list(es1)
    sure = list(links1)
    possible = []
    if rng.random() < 0.3:
        # does(i) ? verb(j); not(i + 1) - no(j); base(i + 2) - verb(j + 1)
        i, j = len(en), len(es)
        en += ["does", "not", base]
        es += ["no", es_verb]
        sure += [(i + 1, j), (i + 2, j + 1)]
        possible.append((i, j + 1))
    else:
        sure.append((len(en), len(es)))
        en.append(verb)
        es.append(es_verb)
    en2, es2, links2 = _phrase(rng, OBJECTS)
    sure += [(a + len(en), b + len(es)) for a, b in links2]
    en += en2
    es += es2
    links = sorted([(a, b, "-") for a, b in sure] + [(a, b, "?") for a, b in possible])
    return " ".join(en), " ".join(es), " ".join(f"{a}{kind}{b}" for a, b, kind in links)


def make_pairs(n: int, *, seed: int = 0) -> list[Pair]:
    """``n`` distinct sentence pairs with their alignments, drawn by a seeded generator (the
    same for the same ``n`` and ``seed`` on every machine)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Pair] = []
    while len(out) < n:
        pair = _sentence(rng)
        if pair[0] not in seen:
            seen.add(pair[0])
            out.append(pair)
    return out


def write_tsv(path: str | Path, pairs: list[Pair]) -> Path:
    """Write ``pairs`` as lines ``source<TAB>target<TAB>alignment`` (UTF-8); the path."""
    path = Path(path)
    path.write_text("".join(f"{a}\t{b}\t{c}\n" for a, b, c in pairs), encoding="utf-8")
    return path
