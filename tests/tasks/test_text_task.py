"""The text task over the user's own files: reading JSONL and CSV, every bad row named, splits,
tokens and vocabulary, macro F1 against scikit-learn, and a model that learns a keyword rule."""

import json
import re
from types import SimpleNamespace

import pytest
import torch
from sklearn.metrics import f1_score

from attnkit.tasks.text_task import TextTask, macro_f1, make_text_data, read_examples, tokenize

POSITIVE, NEGATIVE = ["good", "fine", "great"], ["bad", "poor", "awful"]
FILLER = ["the", "film", "was", "plot", "and", "really", "some", "cast", "of", "it"]


def _texts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        label = int(torch.randint(0, 2, (1,), generator=g))
        words = [FILLER[int(i)] for i in torch.randint(0, len(FILLER), (8,), generator=g)]
        cue = (POSITIVE if label else NEGATIVE)[int(torch.randint(0, 3, (1,), generator=g))]
        words.insert(int(torch.randint(0, 9, (1,), generator=g)), cue)
        rows.append(
            {"text": " ".join(words).capitalize() + ".", "label": "pos" if label else "neg"}
        )
    return rows


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _config(data, **kw):
    base = {
        "data": str(data),
        "seq_len": 16,
        "n_train": 10**6,
        "n_test": 10**6,
        "seed": 0,
        "batch_size": 32,
        "d_model": 16,
        "score": "additive",
        "align": "softmax",
    }
    return SimpleNamespace(**{**base, **kw})  # fmt: skip


def test_tokenize_splits_words_and_punctuation():
    assert tokenize("It's GOOD, really!") == ["it", "'", "s", "good", ",", "really", "!"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("UTF-8 text", ["utf-8", "text"]),
        ("in C++, C# or x86_64.", ["in", "c++", ",", "c#", "or", "x86_64", "."]),
        ("Python 3.11.2 by e-mail", ["python", "3.11.2", "by", "e-mail"]),
        ("end. Next - a--b a+b", ["end", ".", "next", "-", "a", "-", "-", "b", "a", "+", "b"]),
        ("(libc6-dev) _x_", ["(", "libc6-dev", ")", "x"]),
    ],
)
def test_tokenize_keeps_common_compounds_whole(text, words):
    assert tokenize(text) == words


def test_min_count_sets_which_training_words_become_unk(tmp_path):
    from attnkit.tasks.text_task import checked_splits

    rows = _texts(120)
    path = _jsonl(tmp_path / "d.jsonl", rows)
    train = checked_splits(path, read_examples(path), n_train=10**6, n_test=10**6)["train"]
    counts = {}
    for r in train:  # the texts are lower-case-able words and a final full stop
        for w in r["text"].lower().rstrip(".").split():
            counts[w] = counts.get(w, 0) + 1
    counts["."] = len(train)
    for k in (1, 2, 40):
        data = make_text_data(path, seq_len=12, n_train=10**6, n_test=10**6, min_count=k)
        assert sorted(data.words[2:]) == sorted(w for w, c in counts.items() if c >= k), k
    assert TextTask.resolve_settings(None).min_count == 2
    with pytest.raises(ValueError, match="setting min_count must be a positive int, got 0"):
        TextTask.resolve_settings({"min_count": 0})


def test_jsonl_and_csv_give_the_same_rows(tmp_path):
    rows = [{"text": "a b", "label": "x"}, {"text": "c, d", "label": 3}]
    csv_path = tmp_path / "d.csv"
    csv_path.write_text('text,label\na b,x\n"c, d",3\n', encoding="utf-8")
    got_json = read_examples(_jsonl(tmp_path / "d.jsonl", rows))
    assert got_json == read_examples(csv_path)
    assert [r["label"] for r in got_json] == ["x", "3"]


@pytest.mark.parametrize(
    ("content", "suffix", "message"),
    [
        ('{"text": "a"}\n', ".jsonl", "'label' must be"),
        ('{"text": "", "label": 1}\n', ".jsonl", "'text' must be a non-empty string"),
        ("not json\n", ".jsonl", r"d.jsonl:1: not JSON"),
        ("[1, 2]\n", ".jsonl", "expected an object"),
        ('{"text": "a", "label": 1, "split": "dev"}\n', ".jsonl", "'split' must be one of"),
        ("words,label\na,1\n", ".csv", "must name the columns text and label"),
        ("", ".jsonl", "holds no examples"),
        ("a", ".txt", "must end in .jsonl or .csv"),
    ],
)
def test_bad_files_are_refused_with_the_file_and_line(tmp_path, content, suffix, message):
    path = tmp_path / f"d{suffix}"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_examples(path)
    with pytest.raises(ValueError, match="is not a file"):
        read_examples(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    ("content", "line", "fields"),
    [
        ("text,label\ngood film,pos\nbad, really bad,neg\nfine,pos\n", 3, 3),
        ("text,label\ngood film,pos\nno label here\n", 3, 1),
        # a quoted text over two lines: the record ends on line 4
        ('text,label\n"two\nlines",pos\n"a, b\nc",neg,extra\n', 5, 3),
    ],
)
def test_a_ragged_csv_row_is_refused_naming_its_line(tmp_path, content, line, fields):
    path = tmp_path / "d.csv"
    path.write_text(content, encoding="utf-8")
    expected = f"d.csv:{line}: {fields} fields, but the header names 2 (text, label)"
    with pytest.raises(ValueError, match=re.escape(expected)) as err:
        read_examples(path)
    assert "double quotes" in str(err.value)


def test_data_with_a_single_label_or_an_empty_split_is_refused(tmp_path):
    rows = [{"text": f"film {i}", "label": "pos"} for i in range(30)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match="every training text has the label 'pos'; a classifier"):
        make_text_data(path, seq_len=4, n_train=99, n_test=99)
    rows = [{"text": f"film {i}", "label": ("pos", "neg")[i % 2], "split": "train"}
            for i in range(8)] + [{"text": "film", "label": "pos", "split": "test"}]  # fmt: skip
    path = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match="the validation split is empty \\(no row has split"):
        make_text_data(path, seq_len=4, n_train=99, n_test=99)
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "film", "label": "pos"}])
    with pytest.raises(ValueError, match="split is empty \\(1 row cannot be cut 80 / 10 / 10"):
        make_text_data(path, seq_len=4, n_train=99, n_test=99)


def test_splits_vocabulary_and_truncation(tmp_path):
    rows = _texts(100)
    data = make_text_data(_jsonl(tmp_path / "d.jsonl", rows), seq_len=6, n_train=50, n_test=5)
    sizes = {name: s["labels"].shape[0] for name, s in data.splits.items()}
    assert sizes == {"train": 50, "validation": 10, "test": 5}
    assert data.labels == ["neg", "pos"] and data.words[:2] == ["<pad>", "<unk>"]
    assert all(s["keep"].sum(-1).max() <= 6 for s in data.splits.values())
    # the same seed gives the same split; another seed another one
    again = make_text_data(tmp_path / "d.jsonl", seq_len=6, n_train=50, n_test=5)
    other = make_text_data(tmp_path / "d.jsonl", seq_len=6, n_train=50, n_test=5, seed=1)
    assert torch.equal(again.splits["test"]["tokens"], data.splits["test"]["tokens"])
    assert not torch.equal(other.splits["test"]["tokens"], data.splits["test"]["tokens"])


def test_named_splits_are_kept_and_unseen_labels_refused(tmp_path):
    rows = [{"text": "good film", "label": "pos", "split": "train"},
            {"text": "bad film", "label": "neg", "split": "train"},
            {"text": "good", "label": "pos", "split": "validation"},
            {"text": "bad", "label": "odd", "split": "test"}]  # fmt: skip
    with pytest.raises(ValueError, match="labels not in training"):
        make_text_data(_jsonl(tmp_path / "d.jsonl", rows), seq_len=4, n_train=9, n_test=9)
    rows[0].pop("split")
    with pytest.raises(ValueError, match="every row names its split or none"):
        make_text_data(_jsonl(tmp_path / "d.jsonl", rows), seq_len=4, n_train=9, n_test=9)


def test_macro_f1_equals_scikit_learn():
    g = torch.Generator().manual_seed(3)
    predicted, target = (
        torch.randint(0, 4, (200,), generator=g),
        torch.randint(0, 4, (200,), generator=g),
    )
    assert macro_f1(predicted, target, 4) == pytest.approx(
        f1_score(target.numpy(), predicted.numpy(), average="macro")
    )


def test_the_model_learns_a_keyword_rule_and_attends_to_the_keyword(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _texts(600))
    task = TextTask(_config(path))
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(6):
        order = torch.randperm(task.n_train(), generator=torch.Generator().manual_seed(epoch))
        for batch in order.split(32):
            loss = task.loss(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    metrics = task.final_metrics(model)
    assert set(metrics) == set(TextTask.metrics)
    assert metrics["accuracy"] > 0.95 and metrics["macro_f1"] > 0.95
    test = task.data.splits["test"]
    with torch.no_grad():
        _, weights, _ = model(test["tokens"], test["keep"])
    # the width-3 convolution carries the keyword to its neighbours: the weight on the keyword
    # and its two neighbours is well above their share under uniform weights
    cue_ids = torch.tensor([task.data.words.index(w) for w in POSITIVE + NEGATIVE])
    cue_at = torch.isin(test["tokens"], cue_ids).float().argmax(-1, keepdim=True)
    near = (torch.arange(test["tokens"].shape[1]) - cue_at).abs() <= 1
    near = near & test["keep"]
    mass = (weights * near).sum(-1).mean()
    share = (near.sum(-1) / test["keep"].sum(-1)).mean()
    assert mass > 1.8 * share
    maps = task.heatmaps(model, n=2)
    assert len(maps) == 2 and maps[0]["weights"].shape == maps[0]["gold"].shape


def test_validate_needs_data(tmp_path):
    with pytest.raises(ValueError, match="needs --data"):
        TextTask.validate(SimpleNamespace(data=None))
    path = _jsonl(tmp_path / "d.jsonl", _texts(20))
    with pytest.raises(ValueError, match="larger than the"):
        TextTask(_config(path, batch_size=64))
