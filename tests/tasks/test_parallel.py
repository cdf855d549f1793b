"""Source/target pair files: TSV and JSONL, Pharaoh alignments, splits and tensors."""

import json

import pytest

from attnkit.tasks.parallel import (
    BOS,
    EOS,
    PAD,
    make_parallel_data,
    parse_alignment,
    read_pairs,
)


def test_pharaoh_links_sure_and_possible():
    sure, possible = parse_alignment("0-0 2-1 1?2", 3, 3)
    assert sure == {(0, 0), (2, 1)}
    assert possible == {(0, 0), (2, 1), (1, 2)}  # P includes S
    assert parse_alignment("", 2, 2) == (frozenset(), frozenset())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0-0 1:1", r"'1:1' is not a link i-j \(sure\) or i\?j"),
        ("0-3", r"link '0-3' is outside the pair \(2 source and 3 target tokens"),
        ("2?0", "link '2\\?0' is outside the pair"),
    ],
)
def test_bad_links_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_alignment(text, 2, 3, "data: f:1")


def test_tsv_and_jsonl_give_the_same_pairs(tmp_path):
    rows = [("a b c", "x y", "0-0 2-1"), ("d e", "z", "1?0"), ("f", "w v", "")]
    tsv = tmp_path / "p.tsv"
    tsv.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"source": s, "target": t, "alignment": a}) + "\n" for s, t, a in rows)
    )
    a, b = read_pairs(tsv), read_pairs(jsonl)
    assert [(e.source, e.target, e.sure, e.possible) for e in a] == [
        (e.source, e.target, e.sure, e.possible) for e in b
    ]
    assert a[0].source == ["a", "b", "c"] and a[0].sure == {(0, 0), (2, 1)}
    assert a[2].sure == frozenset()  # an empty alignment: every word unaligned
    (plain,) = read_pairs(_write(tmp_path / "q.tsv", "a b\tx\n"))
    assert plain.sure is None and plain.possible is None


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.tsv", "a b\n", r"a.tsv:1: 1 tab-separated fields; expected source<TAB>target"),
        ("a.tsv", "a\tb\t0-0\textra\n", "a.tsv:1: 4 tab-separated fields"),
        ("a.tsv", "a\t \n", "a.tsv:1: 'target' must be a non-empty string"),
        ("a.tsv", "a b\tx\t0-5\n", "a.tsv:1: link '0-5' is outside the pair"),
        ("a.jsonl", '{"source": "a"}\n', "a.jsonl:1: 'target' must be a non-empty string"),
        ("a.jsonl", '{"source": "a", "target": "b", "split": "dev"}\n', "'split' must be one"),
        ("a.jsonl", "[1]\n", "a.jsonl:1: expected an object"),
        ("a.csv", "a,b\n", "must end in .tsv, .txt or .jsonl"),
        ("a.tsv", "\n\n", "holds no pairs"),
    ],
)
def test_bad_files_are_named_with_the_line(tmp_path, name, text, message):
    with pytest.raises(ValueError, match=message):
        read_pairs(_write(tmp_path / name, text))


def test_tensors_put_link_i_j_at_target_row_j_and_source_column_i(tmp_path):
    lines = [
        {"source": "a b c", "target": "x y z", "alignment": "0-0 2-1 1?2", "split": "test"},
        {"source": "a", "target": "y", "split": "train"},
        {"source": "b c", "target": "x z", "alignment": "1-0", "split": "validation"},
    ]
    path = _write(tmp_path / "p.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    data = make_parallel_data(path, n_train=10, n_test=10)
    t = data.splits["test"]
    tgt_ids = [data.target_vocab[i] for i in t["tgt"][0].tolist()]
    assert tgt_ids == ["<unk>", "y", "<unk>", "</s>"]  # x and z are not in training
    assert t["tgt_in"][0].tolist()[0] == BOS and t["tgt"][0, 3] == EOS
    assert t["sure"][0].nonzero().tolist() == [[0, 0], [1, 2]]  # (target j, source i)
    assert t["possible"][0].nonzero().tolist() == [[0, 0], [1, 2], [2, 1]]
    assert t["gold_rows"][0].tolist() == [True, True, True, False]
    assert t["src"][0].tolist() == [data.source_vocab.index("a"), 1, 1]  # b, c: <unk>
    v = data.splits["validation"]
    assert v["tgt"][0].tolist() == [1, 1, EOS] and v["src_mask"][0].tolist() == [True, True]
    train = data.splits["train"]
    assert train["tgt"][0].tolist() == [data.target_vocab.index("y"), EOS]
    assert not train["gold_rows"].any() and PAD == 0


def test_split_of_only_some_pairs_and_long_sentences_are_refused(tmp_path):
    lines = [{"source": "a", "target": "b", "split": "train"}, {"source": "a", "target": "b"}]
    path = _write(tmp_path / "p.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError, match="either every pair names its split or none does"):
        make_parallel_data(path, n_train=10, n_test=10)
    path = _write(tmp_path / "l.tsv", "a b c d\tx\n" * 30)
    with pytest.raises(
        ValueError, match=r"l.tsv:1: a sentence of 4 tokens is longer than seq_len 3"
    ):
        make_parallel_data(path, n_train=10, n_test=10, max_len=3)
