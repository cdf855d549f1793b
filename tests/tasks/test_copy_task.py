"""The ``copy`` task: sequences, delimiter and scored output steps as the paper sets them up,
and its metrics on a model that copies perfectly by construction."""

from __future__ import annotations

import pytest
import torch

from attnkit import tasks
from attnkit.experiments.config import RunConfig
from attnkit.tasks.copy_task import WIDTH, make_copy


def test_sequences_delimiter_and_output_steps():
    x, y, out = make_copy(50, (1, 5), 11, seed=0)
    assert x.shape == (50, 11, WIDTH + 1) and y.shape == (50, 11, WIDTH)
    for i in range(50):
        n = int(x[i, :, WIDTH].argmax())  # the delimiter's step is the length
        assert 1 <= n <= 5 and x[i, :, WIDTH].sum() == 1
        assert out[i].tolist() == [n + 1 <= t <= 2 * n for t in range(11)]
        torch.testing.assert_close(y[i, n + 1 : 2 * n + 1], x[i, :n, :WIDTH])
        assert (x[i, n + 1 :, :WIDTH] == 0).all()  # nothing to read while writing
    with pytest.raises(ValueError, match="steps = 9 is too few"):
        make_copy(2, (1, 5), 9)


class _Oracle(torch.nn.Module):
    """Copies perfectly: at step t ≥ n + 1 it outputs input t − n − 1 (as ±logits)."""

    def forward(self, x):
        n = x[..., WIDTH].argmax(1)  # (B,)
        t = torch.arange(x.shape[1])
        src = (t[None] - n[:, None] - 1).clamp_min(0)
        bits = x[torch.arange(x.shape[0])[:, None], src, :WIDTH]
        return type("Run", (), {"outputs": 2 * bits - 1})()


def test_metrics_of_a_perfect_copier_and_of_a_constant_one():
    config = RunConfig(task="copy", n_train=16, n_test=40, epochs=1, batch_size=8).resolved()
    task = tasks.get("copy")(config)
    perfect = task.evaluate(_Oracle(), "test")
    assert perfect == {"bit_errors": 0.0, "bit_errors_long": 0.0, "sequence_accuracy": 1.0}

    class Zeros(torch.nn.Module):
        def forward(self, x):
            return type("Run", (), {"outputs": -torch.ones(*x.shape[:2], WIDTH)})()

    zeros = task.evaluate(Zeros(), "test")
    assert zeros["bit_errors"] > 2 and zeros["bit_errors_long"] > 10  # half the bits are ones
    model = task.build_model()
    loss = task.loss(model, torch.arange(8))
    loss.backward()
    assert torch.isfinite(loss) and len(task.heatmaps(model, n=1)) == 1


@pytest.mark.parametrize("task_name", ["copy", "associative-recall"])
def test_the_lstm_baseline_has_no_memory_and_learns_the_trained_lengths(task_name):
    from attnkit.tasks.copy_task import LSTMBaseline

    torch.manual_seed(0)
    config = RunConfig(
        task=task_name, attention="lstm", n_train=512, n_test=64, epochs=1, batch_size=32
    ).resolved()
    task = tasks.get(task_name)(config)
    model = task.build_model()
    assert isinstance(model, LSTMBaseline) and not hasattr(model, "memory0")
    assert task.heatmaps(model) == []
    before = task.evaluate(model, "test")["bit_errors"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = task.loss(model, torch.randint(0, 512, (32,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = task.evaluate(model, "test")
    assert set(after) == set(task.metrics)
    assert after["bit_errors"] < 0.8 * before  # it learns something without memory


def test_gold_addressing_writes_input_t_at_location_t_and_reads_it_back_at_output_t():
    config = RunConfig(task="copy", n_train=16, n_test=12, batch_size=4, d_model=8).resolved()
    task = tasks.get("copy")(config)
    x, _, _ = task.splits["test"]
    gold = task.gold("test", torch.arange(12))
    steps = x.shape[1]
    assert gold.shape == (12, 2 * steps, 1, 16)
    for i in range(12):
        n = next(t for t in range(steps) if x[i, t, WIDTH] == 1)  # the delimiter
        expected = torch.zeros(2 * steps, 16, dtype=torch.bool)
        for t in range(n):
            expected[t, t] = True  # write weighting of input step t
            expected[steps + n + 1 + t, t] = True  # read weighting of output step t
        assert torch.equal(gold[i, :, 0], expected)


def test_supervision_moves_the_addressing_towards_the_gold():
    from supervision_runs import kl_to_gold

    start, plain, supervised = kl_to_gold(
        "copy", steps=12, n_eval=16, n_train=128, n_test=16, batch_size=8, d_model=16
    )
    assert supervised < plain and supervised < 0.8 * start


def test_supervision_of_the_lstm_baseline_is_refused():
    from attnkit.experiments.config import ConfigError

    with pytest.raises(ConfigError, match="no memory and no attention to supervise"):
        RunConfig(task="copy", attention="lstm", supervise_attention=1.0).resolved()


def test_the_settings_set_the_lengths_width_and_memory():
    settings = {"max_train": 3, "long": 4, "width": 2, "memory": 6}
    config = RunConfig(task="copy", quick=True, n_train=40, n_test=8, d_model=8,
                       settings=settings).resolved()  # fmt: skip
    task = tasks.get("copy")(config)
    x, y, out = task.train
    assert x.shape == (40, 7, 3) and y.shape == (40, 7, 2)  # 2 · 3 + 1 steps, 2 bits
    lengths = x[..., 2].argmax(1)  # the delimiter's step
    assert set(lengths.tolist()) <= {1, 2, 3} and out.sum(1).tolist() == lengths.tolist()
    assert task.long[0].shape == (8, 9, 3) and (task.long[0][..., 2].argmax(1) == 4).all()
    assert task.build_model().memory0.shape[0] == 6  # memory locations
    with pytest.raises(ValueError, match=r"setting memory \(2\) must be >= max_train \(3\)"):
        RunConfig(task="copy", settings={"max_train": 3, "memory": 2}).resolved()
