"""The ``associative-recall`` task: lists of items, a query, and the item after it as target."""

from __future__ import annotations

import pytest
import torch

from attnkit import tasks
from attnkit.experiments.config import RunConfig
from attnkit.tasks.recall_task import ITEM, WIDTH, _steps, make_recall


def test_the_answer_is_the_item_after_the_query():
    x, y, out = make_recall(40, (2, 4), _steps(4), seed=0)
    for i in range(40):
        flags = x[i, :, WIDTH].nonzero().flatten().tolist()  # one item flag per item
        queries = x[i, :, WIDTH + 1].nonzero().flatten().tolist()  # opening and closing flags
        assert 2 <= len(flags) <= 4 and len(queries) == 2
        items = [x[i, f + 1 : f + 1 + ITEM, :WIDTH] for f in flags]
        query = x[i, queries[0] + 1 : queries[0] + 1 + ITEM, :WIDTH]
        matches = [k for k, item in enumerate(items[:-1]) if torch.equal(item, query)]
        assert matches  # the query is one of the items that have a successor
        answer = y[i, out[i]].reshape(ITEM, WIDTH)
        assert any(torch.equal(answer, items[k + 1]) for k in matches)
        assert out[i].nonzero().flatten().tolist() == list(
            range(queries[1] + 1, queries[1] + 1 + ITEM)
        )
    with pytest.raises(ValueError, match="too few for lists of 4 items"):
        make_recall(2, (2, 4), _steps(4) - 1)


def test_registered_and_trains_one_step():
    config = RunConfig(
        task="associative-recall", n_train=16, n_test=8, epochs=1, batch_size=8
    ).resolved()
    task = tasks.get("associative-recall")(config)
    model = task.build_model()
    loss = task.loss(model, torch.arange(8))
    loss.backward()
    assert torch.isfinite(loss) and model.memory0.grad.abs().sum() > 0
    assert set(task.evaluate(model, "test")) == set(task.metrics)


def test_the_settings_set_the_list_lengths_item_size_and_width():
    settings = {"max_train": 3, "long": 5, "item": 1, "width": 3, "memory": 8}
    config = RunConfig(task="associative-recall", quick=True, n_train=20, n_test=4, d_model=8,
                       settings=settings).resolved()  # fmt: skip
    task = tasks.get("associative-recall")(config)
    x, y, out = task.train
    assert x.shape == (20, _steps(3, 1), 5) and y.shape[-1] == 3  # 3 bits, 2 flag channels
    assert (out.sum(1) == 1).all()  # an answer of one vector
    items = x[..., 3].sum(1)  # item flags: the list lengths
    assert set(items.tolist()) <= {2.0, 3.0}
    assert (task.long[0][..., 3].sum(1) == 5).all()
    assert task.build_model().memory0.shape[0] == 8
    with pytest.raises(ValueError, match="setting long must be >= 2"):
        RunConfig(task="associative-recall", settings={"long": 1}).resolved()
