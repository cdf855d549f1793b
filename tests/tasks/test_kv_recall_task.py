"""kv-recall: the answers are the values stored with the queried keys (checked by a loop), full
attention learns the task above chance, and the attention is chosen by registry name."""

import pytest
import torch

from attnkit import cli, tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.kv_recall_task import QUERY, VALUES, make_kv_recall


def test_answers_are_the_values_stored_with_the_queried_key():
    tokens, answers, where = make_kv_recall(50, 12, seed=3)
    assert tokens.shape == (50, 12, 2)
    for i in range(50):
        pairs = {int(k): int(v) for k, v in tokens[i, :-1].tolist()}
        assert len(pairs) == 11  # distinct keys
        key, marker = tokens[i, -1].tolist()
        assert marker == QUERY
        assert answers[i] == pairs[key]
        assert tokens[i, where[i], 0] == key
    assert set(answers.tolist()) <= set(range(VALUES))


def _train(attention: str, steps: int, seed: int = 0) -> float:
    config = RunConfig(task="kv-recall", quick=True, seq_len=6, n_train=512, n_test=400,
                       d_model=32, attention=attention, seed=seed).resolved()  # fmt: skip
    task = tasks.get("kv-recall")(config)
    torch.manual_seed(seed)
    model = task.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.train()
        loss = task.loss(model, torch.randint(0, 512, (32,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return task.evaluate(model, "test")["accuracy"]


def test_full_attention_learns_retrieval_above_chance():
    torch.set_num_threads(1)
    assert _train("full", 300) > 3 / VALUES  # chance 1/10


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["full", "linear", "performer"])
def test_longer_training_retrieves(attention):
    assert _train(attention, 1500) > 2 / VALUES


def test_attention_by_registry_name_and_refusals():
    from attnkit.efficient import LinearAttention

    config = RunConfig(task="kv-recall", quick=True, attention="linear").resolved()
    model = tasks.get("kv-recall")(config).build_model()
    found = [m for m in model.modules() if isinstance(m, LinearAttention)]
    assert len(found) == 2 and found[0] is not found[1]  # one part per layer
    assert "full" in tasks.get("kv-recall").attentions
    assert "performer" in tasks.get("kv-recall").attentions
    with pytest.raises(ConfigError, match="not offered"):
        RunConfig(task="kv-recall", attention="memn2n").resolved()
    config = RunConfig(task="kv-recall", quick=True, attention="synthesizer").resolved()
    model = tasks.get("kv-recall")(config).build_model()  # Tay's dense synthesizer per layer
    assert sum(type(m).__name__ == "Synthesizer" for m in model.modules()) == 2
    with pytest.raises(ConfigError, match="seq_len: task 'dates' has no sequence length"):
        RunConfig(task="dates", seq_len=10).resolved()


def test_compare_attention_reports_accuracy_time_and_memory(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["run", "kv-recall", "--quick", "--seq-len", "4", "--n-train", "64", "--n-test",
            "16", "--epochs", "1", "--d-model", "8", "--no-progress", "--compare",
            "attention=full,linear", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    table = (out / "compare.md").read_text().splitlines()
    head = table[0]
    assert "accuracy" in head and "train_seconds" in head and "train_peak_mib" in head
    assert [row.split("|")[1].strip() for row in table[2:]] == ["full", "linear"]
    for row in table[2:]:
        cells = [c.strip() for c in row.split("|")[2:-2]]
        assert all(float(c) >= 0 for c in cells)
    assert (out / "attention-linear" / "cost.json").is_file()


def test_gold_is_the_pair_holding_the_queried_key():
    config = RunConfig(task="kv-recall", n_train=16, n_test=20, batch_size=4, seq_len=12).resolved()
    task = tasks.get("kv-recall")(config)
    tokens, _ = task.splits["test"]
    gold = task.gold("test", torch.arange(20))
    assert gold.shape == (20, 1, 12)
    for i in range(20):
        key = int(tokens[i, -1, 0])
        expected = [int(tokens[i, p, 0]) == key and p < 11 for p in range(12)]
        assert gold[i, 0].tolist() == expected


def test_supervision_moves_the_readout_attention_to_the_queried_pair():
    from supervision_runs import kl_to_gold

    start, plain, supervised = kl_to_gold(
        "kv-recall", steps=40, n_train=256, n_test=64, batch_size=32, d_model=16, seq_len=16,
        lr=1e-2,
    )  # fmt: skip
    assert supervised < plain and supervised < 0.8 * start


def test_supervision_needs_full_attention_and_one_process_per_sequence():
    with pytest.raises(ConfigError, match="attention 'performer' does not give them"):
        RunConfig(task="kv-recall", attention="performer", supervise_attention=1.0).resolved()
    with pytest.raises(ConfigError, match="with context_parallel 2"):
        RunConfig(task="kv-recall", context_parallel=2, supervise_attention=1.0).resolved()


def test_the_settings_set_the_pairs_keys_and_values_of_the_data():
    config = RunConfig(task="kv-recall", quick=True, seq_len=12, n_train=40, n_test=8,
                       settings={"num_pairs": 5, "keys": 7, "values": 3}).resolved()  # fmt: skip
    task = tasks.get("kv-recall")(config)
    tokens, answers = task.train
    assert tokens.shape == (40, 12, 2)
    for i in range(40):
        stored = {int(k): int(v) for k, v in tokens[i, :5].tolist()}
        assert len(stored) == 5 and set(stored) <= set(range(7))  # 5 distinct keys of 7
        assert set(stored.values()) <= set(range(3))  # 3 values
        assert tokens[i, 5:-1].tolist() == [[7, 4]] * 6  # padding: key 7, value 3 + 1
        key, marker = tokens[i, -1].tolist()
        assert marker == 3 and answers[i] == stored[key]
    assert task.vocab == (8, 5) and task.build_model().out.out_features == 3
    default = tasks.get("kv-recall")(RunConfig(task="kv-recall", quick=True).resolved())
    assert default.train[0].shape[1] - 1 == 31  # no setting: seq_len - 1 pairs, no padding
    assert default.vocab == (32, VALUES + 1)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_pairs": 12}, "num_pairs 12 does not fit seq_len 12"),
        ({"num_pairs": 1}, "setting num_pairs must be an int >= 2"),
        ({"keys": 5}, "setting keys 5 is fewer than the 11 pairs"),
        ({"pairs": 5}, "task 'kv-recall' has no setting 'pairs'; did you mean 'num_pairs'?"),
    ],
)
def test_settings_that_do_not_fit_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(task="kv-recall", quick=True, seq_len=12, settings=settings).resolved()


def _hybrid(layers, **kw):
    settings = {"layers": layers, **kw.pop("settings", {})}
    return RunConfig(task="kv-recall", quick=True, seq_len=8, n_train=32, n_test=8,
                     d_model=8, settings=settings, **kw).resolved()  # fmt: skip


def test_a_plan_sets_each_encoder_layers_mixing():
    from attnkit.linear_family import Retention
    from attnkit.mixers import Mamba2Mixer

    config = _hybrid("1 retention : 1 mixer.mamba2 : 1 sliding:2", settings={"num_layers": 6})
    model = tasks.get("kv-recall")(config).build_model()
    layers = model.layers
    assert len(layers) == 6
    assert isinstance(layers[0].self_attention.module.attention, Retention)
    assert isinstance(layers[1].mixer, Mamba2Mixer) and layers[1].self_attention is None
    assert layers[2].window == 2 and layers[5].window == 2
    tokens = tasks.get("kv-recall")(config).train[0][:3]
    assert model(tokens).shape == (3, 10)


def test_a_plan_of_full_layers_is_the_pure_model():
    base = {"task": "kv-recall", "quick": True, "seq_len": 8, "n_train": 32, "n_test": 8,
            "d_model": 8}  # fmt: skip
    pure_config = RunConfig(**base).resolved()
    torch.manual_seed(0)
    pure = tasks.get("kv-recall")(pure_config).build_model()
    torch.manual_seed(0)
    planned = tasks.get("kv-recall")(_hybrid("full")).build_model()
    tokens = tasks.get("kv-recall")(pure_config).train[0][:3]
    assert torch.equal(pure(tokens), planned(tokens))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"settings": {"layers": "1 full : 1 nope"}}, r"unknown layer 'nope'; a layer is one "
         r"of: full, sliding:W, .*performer.*mixer\.mamba2"),
        ({"settings": {"layers": "1 full : 2 gla"}}, r"num_layers = 2 is not a multiple"),
        ({"settings": {"layers": "2 gla"}, "attention": "gla"}, r"both choose"),
        ({"settings": {"layers": "1 full : 1 gla"}, "context_parallel": 2},
         r"a plan of layers \(setting layers\) cannot be split over a ring"),
    ],
)  # fmt: skip
def test_bad_plans_are_refused_before_the_run(kw, message):
    with pytest.raises(ConfigError, match=message):
        _hybrid(kw.pop("settings")["layers"], **kw)


def test_a_hybrid_and_a_pure_stack_run(tmp_path):
    out = tmp_path / "cmp"
    argv = ["run", "kv-recall", "--quick", "--seq-len", "4", "--n-train", "32", "--n-test",
            "8", "--epochs", "1", "--d-model", "8", "--no-progress", "--compare",
            "set.layers=full,1 gated_deltanet : 1 sliding:2", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    table = (out / "compare.md").read_text().splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == [
        "full",
        "1 gated_deltanet : 1 sliding:2",
    ]
