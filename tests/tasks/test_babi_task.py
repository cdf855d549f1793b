"""The ``babi`` task: the generated stories answer their questions through the supporting fact,
and the end-to-end memory network learns them, attending to that fact."""

from __future__ import annotations

import torch

from attnkit import tasks
from attnkit.experiments.config import RunConfig
from attnkit.tasks.babi_task import PEOPLE, PLACES, VOCAB, WORD, make_babi


def test_the_supporting_fact_answers_the_question():
    data = make_babi(200, seed=3)
    for e in range(200):
        asked = int(data.question[e, 2])
        assert VOCAB[asked] in PEOPLE
        real = [s for s in range(data.story.shape[1]) if data.mask[e, s].any()]
        assert real == list(range(len(real))) and len(real) >= 2  # left-aligned, ≥ 2 sentences
        mentions = [s for s in real if int(data.story[e, s, 0]) == asked]
        assert mentions and int(data.support[e]) == mentions[-1]  # the person's last move
        assert int(data.answer[e]) == int(data.story[e, mentions[-1], -1])
        assert VOCAB[int(data.answer[e])] in PLACES
    assert (data.mask == (data.story != WORD["<pad>"])).all()


def test_generation_is_reproducible_and_seeded():
    a, b, c = make_babi(20, seed=1), make_babi(20, seed=1), make_babi(20, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a.story, c.story)


def test_registered_with_quick_defaults():
    assert "babi" in tasks.available()
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
    for _ in range(config.epochs):
        model.train()
        for index in torch.randperm(task.n_train(), generator=g).split(config.batch_size):
            optim.zero_grad()
            task.loss(model, index).backward()
            optim.step()
