"""attnkit predict and LoadedRun.predict: a trained run's model on new inputs; the text task's
report tables."""

import json

import pytest
import torch

import attnkit as ak
from attnkit import cli
from attnkit.experiments.config import RunConfig
from attnkit.experiments.runner import run
from attnkit.tasks.text_task import TextTask, checked_splits, read_examples


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("predict")
    data = TextTask.example_settings(root)["data"]
    config = RunConfig(task="text", data=data, quick=True, epochs=2, best_metric="accuracy")
    run_dir, _ = run(config, root / "run", progress=False, echo=lambda _: None, threads=1)
    return run_dir


def _test_rows(loaded):
    c = loaded.config
    rows = read_examples(c.data)
    return checked_splits(c.data, rows, n_train=c.n_train, n_test=c.n_test, seed=c.seed)["test"]


def test_predict_on_raw_texts_equals_the_model_on_the_test_split(text_run):
    loaded = ak.load_run(text_run)
    rows = _test_rows(loaded)
    out = loaded.predict([r["text"] for r in rows])
    split = loaded.task.data.splits["test"]
    with torch.no_grad():
        logits, weights, _ = loaded.model(split["tokens"], split["keep"])
    labels = loaded.task.data.labels
    assert [o["prediction"] for o in out] == [labels[i] for i in logits.argmax(-1).tolist()]
    probs = logits.softmax(-1)
    for i, o in enumerate(out):
        assert o["input"] == rows[i]["text"]
        assert list(o["probabilities"]) == labels
        assert list(o["probabilities"].values()) == pytest.approx(probs[i].tolist(), abs=1e-6)
        assert o["tokens"] == rows[i]["text"].lower().split()
        assert o["attention"] == pytest.approx(weights[i].reshape(-1)[: len(o["tokens"])].tolist())
        assert sum(o["attention"]) == pytest.approx(1.0, abs=1e-5)


def test_unseen_words_read_as_unk_and_bad_inputs_are_named(text_run):
    loaded = ak.load_run(text_run)
    (out,) = loaded.predict("good zyzzyva")
    assert out["tokens"] == ["good", "<unk>"]
    with pytest.raises(TypeError, match="inputs must be a string or a list of strings"):
        loaded.predict([1, 2])
    with pytest.raises(ValueError, match="input 1 is empty"):
        loaded.predict(["good", "  "])
    with pytest.raises(ValueError, match="at least one input"):
        loaded.predict([])


def test_cli_predict_prints_one_line_per_input_from_args_and_file(text_run, tmp_path, capsys):
    loaded = ak.load_run(text_run)
    texts = [r["text"] for r in _test_rows(loaded)][:3]
    file = tmp_path / "in.txt"
    file.write_text(texts[1] + "\n\n" + texts[2] + "\n", encoding="utf-8")
    assert cli.main(["predict", str(text_run), texts[0], "--file", str(file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = loaded.predict(texts)
    assert lines == [f"{o['prediction']}\t{o['input']}" for o in expected]
    assert cli.main(["predict", str(text_run), texts[0], "--json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    got = json.loads(line)
    assert got.keys() == expected[0].keys() and got["prediction"] == expected[0]["prediction"]
    assert got["tokens"] == expected[0]["tokens"]
    assert got["attention"] == pytest.approx(expected[0]["attention"], abs=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no inputs: give them after the run directory, or --file FILE"),
        (["--file", "missing.txt"], "--file 'missing.txt': no such file"),
    ],
)
def test_cli_predict_refusals_are_one_line(text_run, capsys, args, message):
    assert cli.main(["predict", str(text_run), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"attnkit predict: error: {message}"


def test_a_task_without_predict_is_named(tmp_path, capsys):
    config = RunConfig(task="dates", epochs=1, n_train=64, n_test=8, batch_size=32, d_model=8)
    run_dir, _ = run(config, tmp_path / "dates", progress=False, echo=lambda _: None, threads=1)
    assert cli.main(["predict", str(run_dir), "3 may 2020"]) == 2
    assert (
        "does not predict on new inputs (tasks that do: text, seq2seq)" in capsys.readouterr().err
    )


def test_the_text_report_has_the_confusion_matrix_of_the_test_split(text_run):
    loaded = ak.load_run(text_run)
    split = loaded.task.data.splits["test"]
    with torch.no_grad():
        predicted = loaded.model(split["tokens"], split["keep"])[0].argmax(-1)
    tables = loaded.task.report_tables(loaded.model)
    matrix = tables[0]["rows"]
    for a, label in enumerate(loaded.task.data.labels):
        counts = [int(((split["labels"] == a) & (predicted == b)).sum()) for b in range(2)]
        assert matrix[a] == [label, *counts]
    page = (text_run / "report.html").read_text()
    assert "Confusion matrix (test split)" in page and "Per-label precision" in page
