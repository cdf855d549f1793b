"""The English → Spanish example pairs: the shipped file is the generator's, and every gold link
joins a word and its translation."""

from pathlib import Path

from attnkit.tasks import phrases
from attnkit.tasks.parallel import read_pairs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "seq2seq_en_es.tsv"


def _translations() -> dict[str, set[str]]:
    """English word -> the Spanish words it may be, from the lexicon."""
    out: dict[str, set[str]] = {}
    for table in (phrases.SUBJECTS, phrases.OBJECTS):
        for en, (es, _) in table.items():
            out[en] = {es}
    for table in (phrases.ADJECTIVES, phrases.DETERMINERS):
        for en, forms in table.items():
            out[en] = set(forms)
    out["an"] = out["a"]
    for en, (base, es) in phrases.VERBS.items():
        out[en] = {es}
        out[base] = {es}
    out["not"] = {"no"}
    return out


def test_the_shipped_file_is_the_generators_output(tmp_path):
    written = phrases.write_tsv(tmp_path / "pairs.tsv", phrases.make_pairs(500, seed=0))
    assert EXAMPLE.read_bytes() == written.read_bytes()


def test_every_sure_link_joins_a_word_and_its_translation_one_to_one():
    lexicon = _translations()
    pairs = read_pairs(EXAMPLE)
    assert len(pairs) == 500 and len({" ".join(p.source) for p in pairs}) == 500
    for p in pairs:
        sure = sorted(p.sure)
        for i, j in sure:
            assert p.target[j] in lexicon[p.source[i]], (p.source, p.target, i, j)
        # every target word has exactly one sure link; every source word but "does" one
        assert sorted(j for _, j in sure) == list(range(len(p.target)))
        linked = sorted(i for i, _ in sure)
        does = [i for i, w in enumerate(p.source) if w == "does"]
        assert linked == [i for i in range(len(p.source)) if i not in does]
        # "does" has one possible link, to the verb after "no"
        assert p.possible - p.sure == {(i, p.target.index("no") + 1) for i in does}


def test_adjectives_follow_their_noun_in_spanish_and_agree_with_it():
    (p,) = [x for x in phrases.make_pairs(200, seed=0) if x[0] == "the new girl buys an old book"]
    assert p[1:] == ("la niña nueva compra un libro viejo", "0-0 1-2 2-1 3-3 4-4 5-6 6-5")
