"""The seq2seq task on a user's pairs: it learns, AER against a hand-computed example, predict,
the three models with other attentions, and resume after a kill."""

import json

import pytest
import torch

from attnkit.experiments import checkpoints
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.experiments.runner import run
from attnkit.experiments.training import Position, Trainer
from attnkit.tasks.seq2seq_task import Seq2SeqTask, TransformerSeq2Seq

SMALL = {"d_model": 32, "batch_size": 16, "lr": 1e-2, "quick": True}


@pytest.fixture(autouse=True)
def one_thread():
    """As attnkit run chooses for models this small: many threads only slow them down."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return Seq2SeqTask.example_settings(tmp_path_factory.mktemp("pairs"))["data"]


def _task(data, **kw):
    config = RunConfig(task="seq2seq", data=data, **{**SMALL, **kw}).resolved()
    torch.manual_seed(0)
    task = Seq2SeqTask(config)
    return task, task.build_model()


def _train(task, model, directory):
    optimizer = torch.optim.Adam(model.parameters(), lr=task.config.lr)
    trainer = Trainer(task.config, task, model, optimizer, directory, Position(),
                      say=lambda s: None, progress=False)  # fmt: skip
    trainer.fit()


def test_a_tiny_run_translates_well_above_the_untrained_model(data, tmp_path):
    task, model = _task(data, epochs=8)
    before = task.evaluate(model, "test")
    _train(task, model, tmp_path)
    after = task.evaluate(model, "test")
    assert before["bleu"] < 0.05 and before["exact_match"] == 0.0
    assert after["bleu"] > 0.5 and after["exact_match"] >= 0.3
    assert after["aer"] < before["aer"] - 0.2


def test_aer_of_the_argmax_links_against_a_hand_computed_example(tmp_path):
    """Source a b c, target x y z, gold 0-0 2-1 1?2. Attention rows (target over source) with
    argmax links A = {(0,0), (1,1), (1,2)} (source i, target j): |A| = 3, |S| = 2, A∩S =
    {(0,0)}, A∩P = {(0,0), (1,2)}: AER = 1 - (1 + 2) / (3 + 2) = 0.4."""
    lines = [
        {"source": "a b c", "target": "x y z", "alignment": "0-0 2-1 1?2", "split": "test"},
        *({"source": "a b c", "target": "x y z", "split": s} for s in ("train", "validation")),
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    task, model = _task(str(path), batch_size=1)
    rows = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.2, 0.5, 0.3], [0.4, 0.3, 0.3]])
    task._forced = lambda *a, **kw: (None, rows.unsqueeze(0))  # the 4th row: </s>, not scored
    assert task.evaluate(model, "test")["aer"] == pytest.approx(0.4)


def test_predict_gives_the_greedy_translation_and_its_argmax_alignment(data, tmp_path):
    task, model = _task(data, epochs=2)
    _train(task, model, tmp_path)
    test = task.data.splits["test"]
    sources = [" ".join(e.source) for e in test["examples"][:5]]
    out = task.predict(model, [*sources, "the zebra sees a car"])
    tokens, weights = task._greedy(model, test["src"][:5], test["src_mask"][:5], 12)
    for b, o in enumerate(out[:5]):
        words = task.data.decode_target(tokens[b].tolist())
        assert o["prediction"] == " ".join(words) and o["output_tokens"] == words
        n = len(test["examples"][b].source)
        w = weights[b, : len(words), :n]
        torch.testing.assert_close(torch.tensor(o["attention"]), w, atol=1e-5, rtol=0)
        links = [f"{int(w[j].argmax())}-{j}" for j in range(len(words))]
        assert o["alignment"] == " ".join(links)
    assert out[5]["tokens"] == ["the", "<unk>", "sees", "a", "car"]


@pytest.mark.parametrize(
    ("attention", "score", "align"),
    [
        ("transformer", None, "sparsemax"),
        ("luong", "dot", "softmax"),
        ("bahdanau", None, "entmax15"),
    ],
)
def test_every_model_trains_with_another_attention(data, tmp_path, attention, score, align):
    kw = {"score": score} if score else {}
    task, model = _task(data, epochs=1, n_train=32, attention=attention, align=align, **kw)
    assert isinstance(model, TransformerSeq2Seq) == (attention == "transformer")
    first = {k: v.clone() for k, v in model.state_dict().items()}
    _train(task, model, tmp_path)
    assert any(not torch.equal(first[k], v) for k, v in model.state_dict().items())
    metrics = task.evaluate(model, "test")
    assert set(metrics) == {"bleu", "exact_match", "meteor", "entropy", "aer"}
    assert 0 <= metrics["aer"] <= 1 and 0 <= metrics["bleu"] <= 1
    (item,) = task.heatmaps(model, n=1)
    example = task.data.splits["test"]["examples"][0]
    assert item["weights"].shape == (len(example.target), len(example.source))
    assert item["gold"].sum() == len(example.possible)


def test_each_model_has_its_papers_score_by_default(data):
    scores = {
        a: RunConfig(task="seq2seq", data=data, attention=a, quick=True).resolved().score
        for a in ("bahdanau", "luong", "transformer")
    }
    assert scores == {"bahdanau": "additive", "luong": "general", "transformer": "scaled_dot"}
    assert RunConfig(task="seq2seq", data=data, quick=True).resolved().attention == "default"


def test_refusals_name_the_key(data):
    with pytest.raises(ConfigError, match="task 'seq2seq' needs --data FILE"):
        RunConfig(task="seq2seq", quick=True).resolved()
    with pytest.raises(ConfigError, match="align 'hard' samples its weights"):
        RunConfig(task="seq2seq", data=data, align="hard", quick=True).resolved()


class Killed(BaseException):
    """Stands for the process dying: nothing in the runner catches it."""


def test_a_run_killed_mid_run_resumes_to_the_same_metrics(data, tmp_path, monkeypatch):
    config = RunConfig(task="seq2seq", data=data, epochs=2, n_train=64, **SMALL)
    quiet = {"progress": False, "echo": lambda _: None, "threads": 1}
    _, metrics = run(config, tmp_path / "whole", **quiet)
    calls = []

    def written(_):
        calls.append(1)
        if len(calls) == 7:  # inside the second epoch's checkpoint
            raise Killed

    monkeypatch.setattr(checkpoints, "_written", written)
    with pytest.raises(Killed):
        run(config, tmp_path / "killed", **quiet)
    monkeypatch.undo()
    _, resumed = run(None, resume=tmp_path / "killed", **quiet)
    assert resumed == metrics
    assert "aer" in metrics and (tmp_path / "killed" / "heatmap_0.png").is_file()
