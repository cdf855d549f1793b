"""The rationale task: the planted cues decide the label (the gold rationale is true by
construction), decoys only correlate, the model splits at its embeddings, and a short run
learns the task."""

import torch

from attnkit.experiments.config import RunConfig
from attnkit.tasks import rationale_task as rt


def test_the_planted_cues_decide_the_label_and_are_the_gold():
    data = rt.make_rationale(300, 50, seed=3)
    vocab = data.vocab
    cue_label = {vocab.ids[w]: label for label, words in enumerate(rt.CUES) for w in words}
    decoy_label = {vocab.ids[w]: label for label, words in enumerate(rt.DECOYS) for w in words}
    agree = total = 0
    for split in data.splits.values():
        for tokens, keep, gold, label in zip(
            split["tokens"], split["keep"], split["gold"], split["labels"], strict=True
        ):
            is_cue = torch.tensor([int(t) in cue_label for t in tokens])
            assert torch.equal(is_cue, gold) and 1 <= int(gold.sum()) <= 3
            assert all(cue_label[int(t)] == int(label) for t in tokens[gold])
            assert not bool((gold & ~keep).any()) and bool((tokens[~keep] == 0).all())
            assert rt.MIN_LEN <= int(keep.sum()) <= rt.MAX_LEN
            for t in tokens.tolist():
                if t in decoy_label:
                    total += 1
                    agree += decoy_label[t] == int(label)
    assert 0.6 < agree / total < 0.9  # decoys correlate with the label but do not decide it


def test_splits_are_reproducible_and_differ_by_seed():
    a, b = rt.make_rationale(20, 4, seed=1), rt.make_rationale(20, 4, seed=1)
    assert torch.equal(a.splits["test"]["tokens"], b.splits["test"]["tokens"])
    c = rt.make_rationale(20, 4, seed=2)
    assert not torch.equal(a.splits["train"]["tokens"], c.splits["train"]["tokens"])


def test_the_model_splits_at_the_embeddings_and_removes_items_not_kept():
    config = RunConfig(
        task="rationale", n_train=8, n_test=4, d_model=8, epochs=1, batch_size=4
    ).resolved()
    task = rt.RationaleTask(config)
    torch.manual_seed(0)
    model = task.build_model().eval()
    split = task.data.splits["test"]
    tokens, keep = split["tokens"], split["keep"]
    logits, weights, _ = model(tokens, keep)
    again, _, _ = model.from_embeddings(model.embed(tokens), keep)
    torch.testing.assert_close(logits, again)
    assert bool((weights[~keep] == 0).all())
    # removing the last real word == that sequence one word shorter
    n = int(keep[0].sum())
    shorter = keep.clone()
    shorter[0, n - 1] = False
    cut = tokens.clone()
    cut[0, n - 1] = 0
    removed, _, _ = model(tokens, shorter)
    truncated, _, _ = model(cut, shorter)
    torch.testing.assert_close(removed[0], truncated[0])


def test_a_short_run_learns_the_task_and_supervision_moves_attention_to_the_cues():
    def train(supervise):
        config = RunConfig(
            task="rationale", n_train=480, n_test=200, d_model=16, epochs=3, batch_size=32,
            lr=5e-3, supervise_attention=supervise,
        ).resolved()  # fmt: skip
        task = rt.RationaleTask(config)
        torch.manual_seed(0)
        model = task.build_model()
        opt = torch.optim.Adam(model.parameters(), lr=config.lr)
        g = torch.Generator().manual_seed(0)
        for _ in range(config.epochs):
            for index in torch.randperm(task.n_train(), generator=g).split(config.batch_size):
                opt.zero_grad()
                task.loss(model, index).backward()
                opt.step()
        return task.evaluate(model, "test")

    plain, supervised = train(0.0), train(1.0)
    assert plain["accuracy"] > 0.9
    assert supervised["attention_correctness"] > plain["attention_correctness"]
    assert supervised["attention_correctness"] > 0.8
