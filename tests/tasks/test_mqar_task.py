"""mqar: the sequences hold the pairs and their queries (checked by a loop), every attention is
causal, the metrics read the query positions (an oracle scores 1), supervision adds
KL(gold ‖ weights), and exact attention learns the task."""

import pytest
import torch
from torch import nn

from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.mqar_task import VALUES, key_count, make_mqar, pair_count


def _config(**kw):
    settings = {"task": "mqar", "quick": True, "seq_len": 16, "n_train": 64, "n_test": 40,
                "d_model": 8, **kw}  # fmt: skip
    return RunConfig(**settings).resolved()


@pytest.mark.parametrize("seq_len", [16, 19])
def test_sequences_store_pairs_then_query_every_key(seq_len):
    tokens, answers, gold = make_mqar(30, seq_len, seed=1)
    p = pair_count(seq_len)
    k = key_count(p)
    assert p == seq_len // 4 and tokens.shape == (30, seq_len) and answers.shape == (30, p)
    for i in range(30):
        row = tokens[i].tolist()
        stored = {}
        for j in range(p):
            key, value = row[2 * j], row[2 * j + 1]
            assert 0 <= key < k and k <= value < k + VALUES
            stored[key] = value - k
        assert len(stored) == p  # distinct keys
        queried = [row[2 * p + 2 * q] for q in range(p)]
        assert sorted(queried) == sorted(stored)  # every key once
        for q, key in enumerate(queried):
            assert answers[i, q] == stored[key]
            assert row[2 * p + 2 * q + 1] == stored[key] + k  # the answer follows its query
            assert row[gold[i, q] - 1] == key and row[gold[i, q]] == stored[key] + k
        assert row[4 * p :] == [k + VALUES] * (seq_len - 4 * p)  # padding


@pytest.mark.parametrize("attention", tasks.get("mqar").attentions)
def test_every_attention_is_causal(attention):
    task = tasks.get("mqar")(_config(attention=attention))
    torch.manual_seed(0)
    model = task.build_model().eval()
    tokens = task.train[0][:2]
    changed = tokens.clone()
    changed[:, 9:] = torch.flip(changed[:, 9:], [1])
    with torch.no_grad():
        a, b = model(tokens)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_parts_built_per_layer():
    from attnkit.efficient import LinearAttention
    from attnkit.modern import MultiHeadLatentAttention

    model = tasks.get("mqar")(_config(attention="latent")).build_model()
    assert sum(isinstance(m, MultiHeadLatentAttention) for m in model.modules()) == 2
    model = tasks.get("mqar")(_config(attention="linear")).build_model()
    found = [m for m in model.modules() if isinstance(m, LinearAttention)]
    assert len(found) == 2 and all(m.causal for m in found)


class _Oracle(nn.Module):
    """Answers every query from the stored pairs (a loop over the tokens) and puts all of each
    head's weight on the value of the queried pair."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.wrong = wrong

    def forward(self, tokens, *, need_weights=False):
        b, n = tokens.shape
        p, k = pair_count(n), key_count(pair_count(n))
        logits = torch.zeros(b, n, VALUES)
        weights = torch.zeros(b, 2, n, n)
        for i in range(b):
            row = tokens[i].tolist()
            where = {row[2 * j]: 2 * j + 1 for j in range(p)}
            for q in range(2 * p, 4 * p, 2):
                value = row[where[row[q]]] - k
                logits[i, q, (value + self.wrong) % VALUES] = 1.0
                weights[i, 1, q, where[row[q]] - self.wrong] = 1.0
        return logits, weights


def test_metrics_read_the_query_positions():
    task = tasks.get("mqar")(_config(seq_len=22))
    assert task.evaluate(_Oracle(), "test") == {"accuracy": 1.0, "gold_argmax": 1.0}
    assert task.evaluate(_Oracle(wrong=True), "test") == {"accuracy": 0.0, "gold_argmax": 0.0}


def test_supervision_adds_kl_to_the_gold_value_position():
    plain = tasks.get("mqar")(_config())
    supervised = tasks.get("mqar")(_config(supervise_attention=0.5))
    torch.manual_seed(0)
    model = plain.build_model()
    index = torch.arange(4)
    tokens, _, gold = (t[index] for t in plain.train)
    _, weights = model(tokens, need_weights=True)
    p = pair_count(16)
    kl = 0.0
    for i in range(4):  # KL(one-hot ‖ a) = −log a at the gold key, per head and query row
        for h in range(weights.shape[1]):
            for q in range(p):
                kl -= torch.log(weights[i, h, 2 * p + 2 * q, gold[i, q]])
    expected = plain.loss(model, index) + 0.5 * kl / (4 * weights.shape[1] * p)
    torch.testing.assert_close(supervised.loss(model, index), expected)
    with pytest.raises(ConfigError, match="supervise_attention needs weights"):
        _config(attention="gla", supervise_attention=1.0)
    with pytest.raises(ConfigError, match="seq_len must be >= 8"):
        _config(seq_len=7)


def test_full_attention_learns_recall():
    torch.set_num_threads(1)
    task = tasks.get("mqar")(_config(n_train=512, n_test=200, d_model=16))
    torch.manual_seed(0)
    model = task.build_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        model.train()
        loss = task.loss(model, torch.randint(0, 512, (32,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert task.evaluate(model, "test")["accuracy"] > 4 / VALUES  # chance 1/32


def test_the_settings_set_the_pairs_keys_and_values_of_the_data():
    config = RunConfig(task="mqar", quick=True, seq_len=32, n_train=30, n_test=8, batch_size=8,
                       settings={"num_pairs": 3, "keys": 5, "values": 4}).resolved()  # fmt: skip
    task = tasks.get("mqar")(config)
    tokens, answers, gold = task.train
    assert answers.shape == (30, 3) and task.vocab == 5 + 4 + 1
    for i in range(30):
        row = tokens[i].tolist()
        stored = dict(zip(row[0:6:2], row[1:6:2], strict=True))
        assert len(stored) == 3 and set(stored) <= set(range(5))  # 3 distinct keys of 5
        assert all(5 <= v < 9 for v in stored.values())  # 4 values after the keys
        for q in range(3):
            key, value = row[6 + 2 * q], row[7 + 2 * q]
            assert value == stored[key] and answers[i, q] == value - 5
            assert row[int(gold[i, q])] == value
        assert row[12:] == [9] * 20  # padding after 4 · 3 tokens
    logits, _ = task.build_model()(tokens[:2])
    assert logits.shape == (2, 32, 4)
    with pytest.raises(ConfigError, match="num_pairs 9 does not fit seq_len 32"):
        RunConfig(task="mqar", quick=True, seq_len=32, settings={"num_pairs": 9}).resolved()


def _hybrid(layers, **kw):
    return _config(settings={"layers": layers, **kw.pop("settings", {})}, **kw)


def test_a_plan_sets_each_layers_mixing_and_every_layer_stays_causal():
    from attnkit.linear_family import GatedDeltaNet
    from attnkit.mixers import GatedDeltaNetMixer

    config = _hybrid("1 gated_deltanet : 1 sliding:3 : 1 mixer.gated_deltanet : 1 full",
                     settings={"num_layers": 4})  # fmt: skip
    task = tasks.get("mqar")(config)
    torch.manual_seed(0)
    model = task.build_model().eval()
    kinds = [layer.attention for layer in model.layers]
    assert isinstance(kinds[0].attention, GatedDeltaNet)
    assert isinstance(kinds[2], GatedDeltaNetMixer)
    assert [layer.window for layer in model.layers] == [None, 3, None, None]
    mask = model.layers[1].mask(6, torch.device("cpu"))  # causal, the last 3 positions
    want = torch.tensor([[0 <= i - j < 3 for j in range(6)] for i in range(6)])
    assert torch.equal(mask, want)
    tokens = task.train[0][:2]
    changed = tokens.clone()
    changed[:, 9:] = torch.flip(changed[:, 9:], [1])
    with torch.no_grad():
        a, b = model(tokens)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :9], b[:, :9], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_a_plan_of_the_run_attention_is_the_pure_stack():
    torch.manual_seed(0)
    pure = tasks.get("mqar")(_config(attention="gla")).build_model()
    torch.manual_seed(0)
    planned = tasks.get("mqar")(_hybrid("gla")).build_model()
    tokens = torch.randint(0, 60, (2, 16))
    assert torch.equal(pure(tokens)[0], planned(tokens)[0])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"settings": {"layers": "1 gla : 1 fulll"}}, r"unknown layer 'fulll'; mqar's layers "
         r"are: full, .*sliding:W, mixer\.gated_deltanet"),
        ({"settings": {"layers": "3 gla : 1 full"}}, r"num_layers = 2 is not a multiple of the "
         r"4 layers"),
        ({"settings": {"layers": "1 gla : 1 full"}, "attention": "gla"}, r"--attention gla and "
         r"setting layers '1 gla : 1 full' both choose"),
        ({"settings": {"layers": "1 full : 1 gla"}, "supervise_attention": 1.0},
         r"attention 'gla' does not give them \(the last layer's"),
        ({"settings": {"layers": "2 gla"}, "score": "additive"}, r"--score additive "
         r"contradicts --set layers='2 gla': no layer of the plan is exact attention"),
    ],
)  # fmt: skip
def test_bad_plans_are_refused_before_the_run(kw, message):
    with pytest.raises(ConfigError, match=message):
        _config(**kw)


def test_compare_a_hybrid_with_a_pure_stack(tmp_path):
    from attnkit import cli

    out = tmp_path / "cmp"
    argv = ["run", "mqar", "--quick", "--seq-len", "8", "--n-train", "32", "--n-test", "8",
            "--epochs", "1", "--d-model", "8", "--batch-size", "16", "--no-progress",
            "--compare", "set.layers=full,1 gated_deltanet : 1 full",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    table = (out / "compare.md").read_text().splitlines()
    assert [row.split("|")[1].strip() for row in table[2:]] == ["full", "1 gated_deltanet : 1 full"]
    assert (out / "set.layers-1_gated_deltanet___1_full" / "cost.json").is_file()
