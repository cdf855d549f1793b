"""A pretrained encoder under the text task: found by name or folder, swapped with softmax it is
the original model (float64), the classifier is mean pooling and a linear layer, the uniform
ablation makes every layer uniform, and the task tokenizes with the model's tokenizer, trains,
and shows every layer's weights between the tokens; the shipped example file is what its script
writes, and fine-tunes MiniLM with no text cut at 32 tokens."""

import copy
import csv
import json
import runpy
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_checkpoint import HEADS, LAYERS, tiny_bert

from attnkit.evaluation import capture
from attnkit.integrations.transformers import swap_attention
from attnkit.tasks import text_pretrained as tp
from attnkit.tasks.text_task import TextTask, checked_splits, read_examples

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PACKAGE_TOPICS = EXAMPLES / "package_topics.csv"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


def _batch(tokenizer, texts):
    return tokenizer(texts, padding=True, return_tensors="pt")


def _swapped_equals_original(folder, tol):
    original = tp.load_encoder(folder)
    swapped = copy.deepcopy(original)
    score, align = tp.swap_specs(swapped.config, "scaled_dot", "softmax")
    swap_attention(swapped, score=score, align=align)
    original, swapped = original.double().eval(), swapped.double().eval()
    assert original.config._attn_implementation == "eager"
    batch = _batch(tp.load_tokenizer(folder), ["the film was good", "bad plot , and the film"])
    with torch.no_grad():
        expected = original(**batch).last_hidden_state
        got = swapped(**batch).last_hidden_state
    keep = batch["attention_mask"].bool()
    assert (got - expected)[keep].abs().max() <= tol
    return original, swapped, batch


def test_the_swap_with_softmax_is_the_original_model_in_float64(folder):
    original, swapped, batch = _swapped_equals_original(folder, 1e-10)
    # and another alignment is not: the comparison above can fail
    swap_attention(swapped, align="sparsemax")
    with torch.no_grad():
        moved = swapped(**batch).last_hidden_state - original(**batch).last_hidden_state
    assert moved.abs().max() > 1e-3


def test_the_minilm_swap_with_softmax_is_the_original_model_in_float64():
    try:
        folder = tp.pretrained_folder(tp.MINILM)
    except ValueError as err:
        pytest.skip(f"the [pretrained] extra is not installed: {err}")
    _swapped_equals_original(folder, 1e-10)


def test_a_name_that_is_neither_minilm_nor_a_checkpoint_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'nowhere' does not exist: give 'minilm'"):
        tp.pretrained_folder("nowhere")
    with pytest.raises(ValueError, match=r"holds no config\.json"):
        tp.pretrained_folder(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="its tokenizer cannot be loaded"):
        tp.load_tokenizer(tmp_path)


def test_the_classifier_is_a_linear_layer_on_the_mean_token_state(folder):
    torch.manual_seed(0)
    model = tp.PretrainedClassifier(tp.load_encoder(folder), 3).double().eval()
    batch = _batch(tp.load_tokenizer(folder), ["the film", "bad plot and the film was poor"])
    keep = batch["attention_mask"].bool()
    with torch.no_grad():
        logits, weights, log_prob = model(batch["input_ids"], keep)
        states = model.encoder(**batch).last_hidden_state
    assert weights is None and log_prob is None
    for i in range(2):
        n = int(keep[i].sum())
        mean = sum(states[i, j] for j in range(n)) / n
        expected = model.head.weight @ mean + model.head.bias
        torch.testing.assert_close(logits[i], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("align", ["sparsemax", {"name": "entmax", "learnable": True}])
def test_uniform_attention_makes_every_layer_uniform_and_puts_the_parts_back(folder, align):
    # a part without weights is shared by the layers; one with weights is held per layer
    model = tp.PretrainedClassifier(tp.load_encoder(folder), 2).eval()
    swap_attention(model.encoder, align=align)
    batch = _batch(tp.load_tokenizer(folder), ["the film was good", "bad plot"])
    keep = batch["attention_mask"].bool()
    expected = keep[:, None, None, :].expand(2, HEADS, keep.shape[1], -1).float()
    expected = expected / expected.sum(-1, keepdim=True)
    with torch.no_grad(), tp.uniform_attention(model), capture(model) as records:
        model(batch["input_ids"], keep)
    assert len(records) == LAYERS
    for calls in records.values():
        torch.testing.assert_close(calls[0], expected, rtol=0, atol=1e-6)
    with torch.no_grad(), capture(model) as records:
        model(batch["input_ids"], keep)
    for calls in records.values():
        assert not torch.allclose(calls[0], expected, atol=1e-3)


def _texts(path, n=160):
    g = torch.Generator().manual_seed(0)
    cues, filler = (("bad", "poor"), ("good", "fine")), ("the", "film", "was", "plot", "and")
    lines = []
    for _ in range(n):
        label = int(torch.randint(0, 2, (1,), generator=g))
        words = [filler[int(i)] for i in torch.randint(0, 5, (5,), generator=g)]
        words.insert(int(torch.randint(0, 6, (1,), generator=g)), cues[label][label % 2])
        lines.append(json.dumps({"text": " ".join(words), "label": ("neg", "pos")[label]}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _config(data, folder, **kw):
    base = dict(data=str(data), pretrained=str(folder), seq_len=12, n_train=10**6,
                n_test=10**6, seed=0, batch_size=16, score="scaled_dot", align="softmax",
                quick=False)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_the_task_uses_the_models_tokenizer_learns_and_shows_every_layer(folder, tmp_path):
    config = _config(_texts(tmp_path / "d.jsonl"), folder)
    TextTask.validate(config)
    task = TextTask(config)
    tokenizer = tp.load_tokenizer(folder)
    test = task.data.splits["test"]
    rows = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    # the same text, cut by the tokenizer itself
    first = tokenizer.convert_ids_to_tokens(test["tokens"][0, : int(test["keep"][0].sum())])
    assert first[0] == "[CLS]" and first[-1] == "[SEP]"
    assert " ".join(first[1:-1]) in {r["text"] for r in rows}
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(3):
        order = torch.randperm(task.n_train(), generator=torch.Generator().manual_seed(epoch))
        model.train()
        for batch in order.split(16):
            loss = task.loss(model, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
    metrics = task.final_metrics(model)
    assert set(metrics) == set(TextTask.metrics)
    assert metrics["accuracy"] > 0.9
    maps = task.heatmaps(model, n=2)
    n = int(test["keep"][0].sum())
    assert maps[0]["attention"].shape == (LAYERS, HEADS, n, n)
    assert maps[0]["x_labels"] == maps[0]["y_labels"] == first
    torch.testing.assert_close(
        torch.as_tensor(maps[0]["weights"]), torch.as_tensor(maps[0]["attention"][-1]).mean(0)
    )
    assert not maps[0]["gold"].any() and "gold" not in maps[0]["title"]
    # rows of real tokens are distributions over the real tokens
    torch.testing.assert_close(
        torch.as_tensor(maps[0]["attention"]).sum(-1), torch.ones(LAYERS, HEADS, n)
    )


def test_pretrained_settings_that_do_not_apply_are_refused(folder, tmp_path):
    data = _texts(tmp_path / "d.jsonl", 40)
    with pytest.raises(ValueError, match=r"seq_len 64 is longer .* \(40 positions\)"):
        TextTask.validate(_config(data, folder, seq_len=64))
    with pytest.raises(ValueError, match="min_count 1 contradicts --pretrained"):
        TextTask.validate(_config(data, folder, settings={"min_count": 1}))
    with pytest.raises(ValueError, match="align 'hard' samples its weights"):
        TextTask.validate(_config(data, folder, align="hard"))
    assert TextTask.run_defaults(_config(data, folder))["lr"] == 5e-5
    assert TextTask.run_defaults(_config(data, None, pretrained=None))["lr"] == 3e-3


def test_the_shipped_example_is_what_its_script_writes_in_four_balanced_topics(tmp_path):
    script = runpy.run_path(str(EXAMPLES / "make_package_topics.py"))
    script["main"]([str(tmp_path / "again.csv")])
    assert (tmp_path / "again.csv").read_bytes() == PACKAGE_TOPICS.read_bytes()
    with PACKAGE_TOPICS.open(encoding="utf-8", newline="") as f:
        records = list(csv.reader(f))
    assert records[0] == ["text", "label"]
    assert len({text for text, _ in records[1:]}) == 400  # every description differs
    assert Counter(label for _, label in records[1:]) == {
        "networking": 100, "graphics": 100, "databases": 100, "text": 100
    }  # fmt: skip
    rows = read_examples(PACKAGE_TOPICS)
    assert [(r["text"], r["label"]) for r in rows] == [tuple(r) for r in records[1:]]
    parts = checked_splits(PACKAGE_TOPICS, rows, n_train=10**6, n_test=10**6, seed=0)
    assert {k: len(v) for k, v in parts.items()} == {"train": 320, "validation": 40, "test": 40}


def test_the_shipped_example_fits_32_minilm_tokens_and_fine_tunes():
    try:
        folder = tp.pretrained_folder(tp.MINILM)
    except ValueError as err:
        pytest.skip(f"the [pretrained] extra is not installed: {err}")
    config = _config(PACKAGE_TOPICS, folder, seq_len=32, align="entmax15")
    TextTask.validate(config)
    task = TextTask(config)
    # no text is cut: each keeps as many tokens as the tokenizer gives it uncut
    tokenizer = tp.load_tokenizer(folder)
    rows = read_examples(PACKAGE_TOPICS)
    parts = checked_splits(PACKAGE_TOPICS, rows, n_train=10**6, n_test=10**6, seed=0)
    for name, split in parts.items():
        lengths = [len(tokenizer(r["text"])["input_ids"]) for r in split]
        assert task.data.splits[name]["keep"].sum(-1).tolist() == lengths
    assert task.data.labels == ["databases", "graphics", "networking", "text"]
    # a few steps on one batch of its texts lower that batch's loss
    torch.manual_seed(0)
    model = task.build_model()
    batch = torch.arange(16)
    model.eval()
    with torch.no_grad():
        before = float(task.loss(model, batch))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(3):
        model.train()
        loss = task.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        after = float(task.loss(model, batch))
    assert after < before - 0.1
