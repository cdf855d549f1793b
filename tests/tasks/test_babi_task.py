"""The bAbI-style tasks: the end-to-end memory network learns them attending to the supporting
fact; the memory network reads bags of words with their age and learns from the gold facts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnkit import tasks
from attnkit.experiments.config import RunConfig
from attnkit.tasks.babi import VOCAB, make_babi
from attnkit.tasks.babi_task import BabiMemoryNetwork


def test_registered_with_quick_defaults():
    for name in ("babi", "babi-two-facts", "babi-yes-no", "babi-counting"):
        assert name in tasks.available()
    assert tasks.get("babi").defaults["quick"]["epochs"] <= 15


def test_memn2n_learns_the_task_and_attends_to_the_supporting_fact():
    """A short training run: far above chance (1/6) and most weight on the supporting fact."""
    torch.manual_seed(0)
    config = RunConfig(
        task="babi", score="dot", n_train=1000, n_test=300, epochs=6, batch_size=32, lr=1e-2,
        d_model=32,
    ).resolved()  # fmt: skip
    task = tasks.get("babi")(config)
    model = task.build_model()
    before = task.evaluate(model, "test")
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small batches: one thread is faster, as in `attnkit run`
    try:
        _train(task, model, optim, config, g)
    finally:
        torch.set_num_threads(threads)
    after = task.evaluate(model, "test")
    assert before["accuracy"] < 0.4
    assert after["accuracy"] > 0.9
    assert after["support_attention"] > 0.7 and after["support_argmax"] > 0.85
    maps = task.heatmaps(model, n=2)
    assert len(maps) == 2 and maps[0]["weights"].shape == maps[0]["gold"].shape


def _train(task, model, optim, config, g):
    """The loop of `attnkit run`, with the task's end of epoch (linear start)."""
    for epoch in range(config.epochs):
        model.train()
        for index in torch.randperm(task.n_train(), generator=g).split(config.batch_size):
            optim.zero_grad()
            task.loss(model, index).backward()
            optim.step()
        task.end_epoch(model, epoch + 1)


def test_memory_network_features_are_bags_of_words_and_ages():
    data = make_babi(5, kind="two-facts", seed=0)
    model = BabiMemoryNetwork(12, 8, 2, None)
    x, memories, keep = model.features(data.story, data.question, data.mask)
    v = len(VOCAB)
    for e in range(5):
        real = int(data.mask[e].any(-1).sum())
        assert keep[e].tolist() == [True] * real + [False] * (12 - real)
        for s in range(real):
            bag = torch.zeros(v)
            for w in data.story[e, s].tolist():
                if w:
                    bag[w] += 1
            assert torch.equal(memories[e, s, :v], bag)
            assert memories[e, s, v:].argmax() == real - 1 - s  # age: sentences written after it
            assert memories[e, s, v:].sum() == 1
        question = torch.zeros(v)
        for w in data.question[e].tolist():
            question[w] += 1
        assert torch.equal(x[e, :v], question) and not x[e, v:].any()


@pytest.mark.parametrize("kind", ["babi", "babi-two-facts"])
def test_memory_network_learns_from_the_gold_facts(kind):
    """Strong supervision: the hard addressing finds the supporting facts in order and answers."""
    torch.manual_seed(0)
    config = RunConfig(
        task=kind, attention="memory_network", n_train=1000, n_test=300, epochs=8,
        batch_size=32, lr=1e-2, d_model=32,
    ).resolved()  # fmt: skip
    task = tasks.get(kind)(config)
    model = task.build_model()
    assert isinstance(model, BabiMemoryNetwork)
    before = task.evaluate(model, "test")
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    _train(task, model, optim, config, torch.Generator().manual_seed(0))
    after = task.evaluate(model, "test")
    assert before["accuracy"] < 0.4
    assert after["accuracy"] > 0.9 and after["support_argmax"] > 0.9
    data = task.splits["test"]
    out = model(data.story, data.question, data.mask)
    found = out.weights.argmax(-1)  # (N, hops): hard addressing, in the question's order
    assert (found == data.supports).float().mean() > 0.85
    assert F.one_hot(found, out.weights.shape[-1]).float().equal(out.weights)


def test_memory_network_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="varying number"):
        RunConfig(task="babi-counting", attention="memory_network").resolved()
    with pytest.raises(ValueError, match="hard max"):
        RunConfig(task="babi", attention="memory_network", align="sparsemax").resolved()


def test_memn2n_learns_two_facts_with_linear_start():
    """babi-two-facts: linear start first, then the softmax is re-inserted and the hops find
    the facts (from the answers alone)."""
    torch.manual_seed(0)
    config = RunConfig(
        task="babi-two-facts", score="dot", n_train=2000, n_test=300, epochs=8,
        batch_size=32, lr=1e-2, d_model=32,
    ).resolved()  # fmt: skip
    task = tasks.get("babi-two-facts")(config)
    model = task.build_model()
    assert model.linear_start_active
    optim = torch.optim.Adam(model.parameters(), lr=config.lr)
    _train(task, model, optim, config, torch.Generator().manual_seed(0))
    assert not model.linear_start_active  # at the latest after half of the epochs
    after = task.evaluate(model, "test")
    assert after["accuracy"] > 0.8 and after["support_argmax"] > 0.75


def test_gold_of_where_is_a_person_is_their_last_move_read_from_the_words():
    config = RunConfig(task="babi", n_train=8, n_test=30, batch_size=4, d_model=8).resolved()
    task = tasks.get("babi")(config)
    data = task.splits["test"]
    gold = task.gold("test", torch.arange(30))
    assert gold.shape == (30, 1, data.story.shape[1])
    moves = {"moved", "went", "journeyed", "travelled"}
    for i in range(30):
        person = VOCAB[int(data.question[i, 2])]  # "where is <person>"
        words = [[VOCAB[w] for w in s.tolist() if w] for s in data.story[i]]
        last = max(s for s, w in enumerate(words) if w and w[0] == person and w[1] in moves)
        assert gold[i, 0].nonzero().flatten().tolist() == [last]


@pytest.mark.parametrize("name", ["babi", "babi-counting"])
def test_supervision_moves_every_hop_to_the_supporting_facts(name):
    from supervision_runs import kl_to_gold

    start, plain, supervised = kl_to_gold(
        name, steps=25, n_train=256, n_test=64, batch_size=32, d_model=16
    )
    # untrained hops are near uniform; without supervision they move away from the facts
    assert supervised < start and supervised < plain - 0.5


def test_supervision_is_refused_where_the_hop_weights_are_no_distribution_or_already_gold():
    from attnkit.experiments.config import ConfigError

    with pytest.raises(ConfigError, match="linear start"):
        RunConfig(task="babi-two-facts", supervise_attention=1.0).resolved()
    with pytest.raises(ConfigError, match="margin ranking loss"):
        RunConfig(task="babi", attention="memory_network", supervise_attention=1.0).resolved()
