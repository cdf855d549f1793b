"""The dates task: renderings, gold links, splits."""

import datetime as dt

from attnkit.tasks.dates import HELD_OUT_PATTERNS, make_dates, patterns, render


def test_fields_and_links():
    e = render(dt.date(2023, 3, 5), "EEEE, d 'de' MMMM 'de' y", "es")
    assert e.text == "domingo, 5 de marzo de 2023" and e.target == "2023-03-05"
    assert e.text[slice(*e.spans["Y"])] == "2023"
    assert e.text[slice(*e.spans["M"])] == "marzo"
    # Each year digit is copied from one character: its sure link; the field is possible, and
    # so is the space before it.
    assert [[i for i, s in enumerate(e.sure[t]) if s] for t in range(4)] == [[23], [24], [25], [26]]
    assert all(e.possible[t][i] for t in range(4) for i in range(22, 27))
    assert [i for i, s in enumerate(e.field[0]) if s] == list(range(23, 27))
    # The month digits are read from the month name: sure to the whole name. The day's units
    # digit is copied from "5"; its "0" is not copied, so it links to the whole (one-character)
    # field. The weekday links to nothing.
    assert all(e.sure[t][i] == (14 <= i < 19) for t in (5, 6) for i in range(len(e.text)))
    assert (
        [i for i, s in enumerate(e.sure[9]) if s]
        == [9]
        == [i for i, s in enumerate(e.sure[8]) if s]
    )
    assert not any(e.sure[t][i] or e.possible[t][i] for t in range(10) for i in range(7))
    assert not any(e.sure[4])  # a dash has no sure link


def test_copied_digits_link_to_one_character_each():
    """Every sure link of a copied digit is the one input character that equals it, found
    here by scanning the field from its right end (units digits end their fields)."""
    for pattern, locale in [("d/M/yy", "fr"), ("dd.MM.y", "de"), ("y-MM-dd", "en")]:
        e = render(dt.date(2007, 11, 9), pattern, locale)
        assert e.text in ("9/11/07", "09.11.2007", "2007-11-09")
        for t in range(10):
            if e.target[t] == "-":
                continue
            key, first, width = {0: ("Y", 0, 4), 5: ("M", 5, 2), 8: ("D", 8, 2)}[
                max(s for s in (0, 5, 8) if s <= t)
            ]
            a, b = e.spans[key]
            back = first + width - 1 - t  # how far from the field's last digit
            links = [i for i, s in enumerate(e.sure[t]) if s]
            if b - 1 - back >= a and e.text[b - 1 - back] == e.target[t]:
                assert links == [b - 1 - back], (pattern, t)
            else:  # not written in the input (the century of "07", the "0" of "9")
                assert links == list(range(a, b)), (pattern, t)
            assert all(e.possible[t][i] for i in range(a, b))


def test_splits_are_disjoint_by_date_and_pattern():
    d = make_dates(300, 80, seed=3)
    train = {e.target for e in d.splits["train"]["examples"]}
    test = {e.target for e in d.splits["test"]["examples"]}
    assert not train & test
    held = {p for loc, name, p in patterns() if (loc, name) in HELD_OUT_PATTERNS}
    assert all(e.pattern in held for e in d.splits["unseen_patterns"]["examples"])
    assert not any(
        (e.locale, e.pattern)
        in {(loc, p) for loc, name, p in patterns() if (loc, name) in HELD_OUT_PATTERNS}
        for e in d.splits["train"]["examples"]
    )
    s = d.splits["train"]
    assert s["src"].shape[0] == 300 and s["tgt"].shape == (300, 10)
    assert d.tgt_vocab.decode(s["tgt"][0].tolist()) == s["examples"][0].target
    assert s["sure"].shape == (300, 10, s["src"].shape[1])


def test_deterministic():
    a, b = make_dates(50, 10, seed=1), make_dates(50, 10, seed=1)
    assert [e.text for e in a.splits["train"]["examples"]] == [
        e.text for e in b.splits["train"]["examples"]
    ]
