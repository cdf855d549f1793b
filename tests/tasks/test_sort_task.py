"""The ``sort`` task: lists, targets and metrics, checked on a model that sorts by construction."""

from __future__ import annotations

import pytest
import torch

from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.queries.pointer import PointerOutput
from attnkit.tasks.sort_task import make_sort


def test_lists_and_targets():
    x, keep, targets = make_sort(60, (5, 20), seed=0)
    assert x.shape == (60, 20, 1) and keep.shape == targets.shape == (60, 20)
    lengths = keep.sum(-1)
    assert lengths.min() >= 5 and lengths.max() <= 20 and len(set(lengths.tolist())) > 5
    for i in range(60):
        n = int(lengths[i])
        assert keep[i].tolist() == [j < n for j in range(20)]
        values = x[i, :n, 0].tolist()
        assert targets[i, :n].tolist() == sorted(range(n), key=values.__getitem__)
        assert (x[i, n:] == 0).all() and (targets[i, n:] == 0).all()


class _Sorter(torch.nn.Module):
    """Points at the inputs in increasing order of value; ``wrong`` swaps the first two steps."""

    def __init__(self, wrong=False):
        super().__init__()
        self.wrong = wrong

    def forward(self, x, keep, targets=None):
        order = x[..., 0].masked_fill(~keep, float("inf")).argsort(-1)
        if self.wrong:
            order[:, [0, 1]] = order[:, [1, 0]]
        w = torch.nn.functional.one_hot(order, x.shape[1]).double()
        return PointerOutput(w, order)


def test_metrics_of_a_perfect_sorter_and_of_one_that_swaps_two():
    config = RunConfig(task="sort", n_train=16, n_test=50, epochs=1, batch_size=8).resolved()
    task = tasks.get("sort")(config)
    perfect = task.evaluate(_Sorter(), "test")
    assert perfect == {
        "sequence_accuracy": 1.0,
        "position_accuracy": 1.0,
        "sequence_accuracy_5": 1.0,
        "sequence_accuracy_20": 1.0,
    }
    swapped = task.evaluate(_Sorter(wrong=True), "test")
    keep = task.splits["test"][1]
    assert swapped["sequence_accuracy"] == 0.0
    assert swapped["position_accuracy"] == pytest.approx(1 - 2 * len(keep) / keep.sum().item())
    assert swapped["sequence_accuracy_5"] == 0.0


def test_stochastic_alignments_are_refused():
    with pytest.raises(ConfigError, match="deterministic"):
        RunConfig(task="sort", align="hard").resolved()


def test_heatmaps_mark_the_sorted_order():
    config = RunConfig(task="sort", n_train=8, n_test=8, epochs=1, batch_size=4).resolved()
    task = tasks.get("sort")(config)
    torch.manual_seed(0)
    maps = task.heatmaps(task.build_model(), n=2)
    for item, target in zip(maps, task.splits["test"][2][:2], strict=True):
        n = item["gold"].shape[0]
        assert item["gold"].argmax(-1).tolist() == target[:n].tolist()


def test_gold_points_at_the_ith_smallest_number_and_supervision_is_refused():
    config = RunConfig(task="sort", n_train=16, n_test=10, batch_size=4, d_model=8).resolved()
    task = tasks.get("sort")(config)
    x, keep, _ = task.splits["test"]
    gold = task.gold("test", torch.arange(10))
    for i in range(10):
        n = int(keep[i].sum())
        order = sorted(range(n), key=lambda j: float(x[i, j, 0]))
        expected = torch.zeros(x.shape[1], x.shape[1], dtype=torch.bool)
        for step, j in enumerate(order):
            expected[step, j] = True
        assert torch.equal(gold[i], expected)
    # the pointer distribution is the output: KL(gold ‖ weights) is the objective's NLL
    torch.manual_seed(0)
    model = task.build_model()
    index = torch.arange(4)
    kl = task.supervision_loss(model, index, "test")
    weights = task.supervised_weights(model, "test", index)
    picked = [weights[i, s, j] for i in range(4) for s, j in enumerate(gold[i].int().argmax(-1))
              if gold[i, s].any()]  # fmt: skip
    torch.testing.assert_close(kl, -torch.stack(picked).log().mean())
    with pytest.raises(ConfigError, match="pointer network's attention is its output"):
        RunConfig(task="sort", supervise_attention=1.0).resolved()


def test_the_settings_set_the_lengths_and_the_range_of_the_numbers():
    config = RunConfig(task="sort", quick=True, n_train=30, n_test=8, d_model=8, batch_size=8,
                       settings={"min_len": 7, "max_len": 7, "high": 10.0}).resolved()  # fmt: skip
    task = tasks.get("sort")(config)
    x, keep, targets = task.train
    assert x.shape == (30, 7, 1) and keep.all()  # every list has 7 numbers
    assert float(x.max()) > 1.0 and float(x.max()) < 10.0 and float(x.min()) >= 0.0
    for i in range(30):  # the targets sort the numbers (a loop, by Python's sorted)
        values = x[i, :, 0].tolist()
        assert targets[i].tolist() == sorted(range(7), key=values.__getitem__)
    assert sorted(task.fixed) == [5, 20]  # the metrics' fixed-length lists stay
    with pytest.raises(ConfigError, match=r"setting max_len \(4\) must be >= min_len \(5\)"):
        RunConfig(task="sort", settings={"max_len": 4}).resolved()
