"""The dates task: renderings, gold links, splits."""

import datetime as dt

from attnkit.tasks.dates import HELD_OUT_PATTERNS, make_dates, patterns, render


def test_fields_and_links():
    e = render(dt.date(2023, 3, 5), "EEEE, d 'de' MMMM 'de' y", "es")
    assert e.text == "domingo, 5 de marzo de 2023" and e.target == "2023-03-05"
    assert e.text[slice(*e.spans["Y"])] == "2023"
    assert e.text[slice(*e.spans["M"])] == "marzo"
    # Year characters link (sure) to the year field only; possibly to the space before it.
    assert [i for i, s in enumerate(e.sure[0]) if s] == list(range(23, 27))
    assert e.possible[0][22] and not e.sure[0][22]
    # The month digits link to the month name; the weekday links to nothing.
    assert all(e.sure[5][i] for i in range(14, 19))
    assert not any(e.sure[t][i] for t in range(10) for i in range(7))
    assert not any(e.sure[4])  # a dash has no sure link


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
