"""Date normalisation: human-written dates (rendered by Babel from CLDR patterns in several
locales) to ISO ``YYYY-MM-DD``, character level, with the gold alignment.

Each field of a pattern (day, month, year, weekday) is rendered on its own, so the characters of
every field are known (Och & Ney's sure and possible links, S ⊆ P):

- an output digit *copied* from one input character (the field is written in digits and the
  digit is one of them: "2023" or "23" for the year's last two digits, "5" for the day's units
  digit of "05") links *sure* to that character;
- an output character that is not copied (a month written as a name, the "0" of an unpadded
  day, the century of a two-digit year) links *sure* to the whole field, from which it is read;
- every output character of a field links *possibly* to its whole field and the separators next
  to it. The dashes of the output link possibly to the separators around the fields they join;
  the weekday links to nothing.

``field`` keeps the whole-field links of every output character (what ``sure`` was before copied
digits were told apart), for measures that ask whether attention lands in the right field.
"""

from __future__ import annotations

import datetime as dt
import random
import re
from dataclasses import dataclass, field

import torch
from babel.dates import format_date, get_date_format
from torch import Tensor

__all__ = ["DateExample", "DatesData", "Vocab", "make_dates", "render"]

LOCALES = ("en", "fr", "de", "es", "nl")
STANDARD = ("full", "long", "medium", "short")
# Extra patterns beyond each locale's four standard ones.
CUSTOM = ("y-MM-dd", "y/MM/dd", "EEE d MMM y", "d MMMM y")
# Patterns whose surface form would be ambiguous with another locale's (es short d/M/yy vs en
# short M/d/yy): left out, since no model could normalise them.
EXCLUDED = {("es", "short")}
# Held out of training entirely, to test generalisation to unseen patterns.
HELD_OUT_PATTERNS = {("de", "long"), ("en", "medium")}
START, END = dt.date(1950, 1, 1), dt.date(2049, 12, 31)
OUTPUT_LEN = 10
FIELD_OF_OUTPUT = ["y"] * 4 + ["-"] + ["M"] * 2 + ["-"] + ["d"] * 2


@dataclass(frozen=True)
class DateExample:
    """One rendered date: text, target ISO string, field spans, gold links (10 × len(text))."""

    text: str
    target: str
    locale: str
    pattern: str
    spans: dict[str, tuple[int, int]]
    sure: tuple[tuple[bool, ...], ...]
    possible: tuple[tuple[bool, ...], ...]
    field: tuple[tuple[bool, ...], ...]


def _tokens(pattern: str) -> list[tuple[str, str]]:
    """CLDR pattern -> [(kind, text)]: kind 'field' (e.g. 'MMMM') or 'literal'."""
    out: list[tuple[str, str]] = []
    for m in re.finditer(r"'([^']*)'|([A-Za-z])\2*|[^A-Za-z']+", pattern):
        if m.group(1) is not None:
            out.append(("literal", m.group(1) or "'"))
        elif m.group(2) is not None:
            out.append(("field", m.group(0)))
        else:
            out.append(("literal", m.group(0)))
    return out


def render(date: dt.date, pattern: str, locale: str) -> DateExample:
    """Render ``date`` with ``pattern`` in ``locale``, recording each field's characters."""
    text, spans = "", {}
    for kind, tok in _tokens(pattern):
        piece = format_date(date, tok, locale=locale) if kind == "field" else tok
        if kind == "field":
            spans[tok[0].upper() if tok[0] in "yMdE" else tok[0]] = (
                len(text),
                len(text) + len(piece),
            )
        text += piece
    target = date.isoformat()
    n = len(text)
    sure = [[False] * n for _ in range(OUTPUT_LEN)]
    possible = [[False] * n for _ in range(OUTPUT_LEN)]
    whole = [[False] * n for _ in range(OUTPUT_LEN)]

    def separators_around(a: int, b: int) -> list[int]:
        out = []
        i = a - 1
        while i >= 0 and not text[i].isalnum():
            out.append(i)
            i -= 1
        i = b
        while i < n and not text[i].isalnum():
            out.append(i)
            i += 1
        return out

    key = {"y": "Y", "M": "M", "d": "D"}
    for t, f in enumerate(FIELD_OF_OUTPUT):
        if f == "-":
            joined = ("Y", "M") if t == 4 else ("M", "D")
            for k in joined:
                if k in spans:
                    for i in separators_around(*spans[k]):
                        possible[t][i] = True
            continue
        a, b = spans[key[f]]
        copied = _copied_from(text[a:b], target, t)
        for i in range(a, b):
            whole[t][i] = possible[t][i] = True
            sure[t][i] = copied is None or i == a + copied
        for i in separators_around(a, b):
            possible[t][i] = True
    return DateExample(
        text,
        target,
        locale,
        pattern,
        spans,
        tuple(map(tuple, sure)),
        tuple(map(tuple, possible)),
        tuple(map(tuple, whole)),
    )


def _copied_from(piece: str, target: str, t: int) -> int | None:
    """The index in ``piece`` (a field written in digits) of the character that output
    character ``t`` is copied from, or None when it is not copied. Digits align from the right:
    "23" gives the last two digits of "2023", "5" the units digit of "05"."""
    if not piece.isdigit() or not piece.isascii():
        return None
    start = FIELD_OF_OUTPUT.index(FIELD_OF_OUTPUT[t])  # the field's first output position
    width = FIELD_OF_OUTPUT.count(FIELD_OF_OUTPUT[t])
    from_right = start + width - 1 - t  # 0 for the field's last digit
    i = len(piece) - 1 - from_right
    if i < 0 or piece[i] != target[t]:
        return None
    return i


def patterns() -> list[tuple[str, str, str]]:
    """(locale, name, CLDR pattern) for every pattern in use."""
    out = []
    for loc in LOCALES:
        for name in STANDARD:
            if (loc, name) not in EXCLUDED:
                out.append((loc, name, get_date_format(name, locale=loc).pattern))
        for pat in CUSTOM:
            out.append((loc, pat, pat))
    return out


class Vocab:
    """Characters <-> ids; 0 is padding, 1 the start symbol."""

    PAD, BOS = 0, 1

    def __init__(self, chars: set[str]) -> None:
        self.chars = ["<pad>", "<s>", *sorted(chars)]
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.index.get(c, self.PAD) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i > 1 else "" for i in ids)


@dataclass
class DatesData:
    """Encoded splits. Each split: src (n, L) padded, mask (n, L), tgt (n, 10), examples."""

    src_vocab: Vocab
    tgt_vocab: Vocab
    splits: dict[str, dict] = field(default_factory=dict)


def _encode(examples: list[DateExample], src: Vocab, tgt: Vocab) -> dict:
    width = max(len(e.text) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.bool)
    for i, e in enumerate(examples):
        enc = src.encode(e.text)
        ids[i, : len(enc)] = torch.tensor(enc)
        mask[i, : len(enc)] = True
    tgt_ids = torch.tensor([tgt.encode(e.target) for e in examples])
    return {"src": ids, "mask": mask, "tgt": tgt_ids, "examples": examples}


def _gold(examples: list[DateExample], width: int, which: str) -> Tensor:
    out = torch.zeros(len(examples), OUTPUT_LEN, width, dtype=torch.bool)
    for i, e in enumerate(examples):
        links = torch.tensor(getattr(e, which))
        out[i, :, : links.shape[1]] = links
    return out


def make_dates(n_train: int, n_test: int, seed: int = 0) -> DatesData:
    """Train / validation / test splits with disjoint dates, and a test split of unseen
    patterns. Deterministic given ``seed``."""
    rng = random.Random(seed)
    days = (END - START).days + 1
    order = list(range(days))
    rng.shuffle(order)
    n_val = max(1, n_test // 2)
    cut1, cut2 = n_train, n_train + n_val
    pool = {
        "train": order[:cut1],
        "validation": order[cut1:cut2],
        "test": order[cut2 : cut2 + n_test],
        "unseen_patterns": order[cut2 : cut2 + n_test],
    }
    all_patterns = patterns()
    seen = [p for p in all_patterns if (p[0], p[1]) not in HELD_OUT_PATTERNS]
    unseen = [p for p in all_patterns if (p[0], p[1]) in HELD_OUT_PATTERNS]
    examples: dict[str, list[DateExample]] = {}
    for split, offsets in pool.items():
        choices = unseen if split == "unseen_patterns" else seen
        examples[split] = []
        for off in offsets:
            loc, _, pat = choices[rng.randrange(len(choices))]
            examples[split].append(render(START + dt.timedelta(days=off), pat, loc))
    src = Vocab({c for exs in examples.values() for e in exs for c in e.text})
    tgt = Vocab(set("0123456789-"))
    data = DatesData(src, tgt)
    for split, exs in examples.items():
        enc = _encode(exs, src, tgt)
        width = enc["src"].shape[1]
        for which in ("sure", "possible", "field"):
            enc[which] = _gold(exs, width, which)
        data.splits[split] = enc
    return data
