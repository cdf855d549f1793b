"""Short training runs of a task with and without attention supervision, for the tasks' tests."""

import torch

from attnkit import tasks
from attnkit.experiments.config import RunConfig


def kl_to_gold(name: str, *, steps: int, n_eval: int = 64, seed: int = 0, **settings):
    """Train task ``name`` for ``steps`` Adam steps from the same initial model and batches,
    once with ``supervise_attention`` 0 and once with 1.0; return the held-out KL(gold ‖ weights)
    of the first ``n_eval`` test examples (before, after the plain run, after the supervised
    run)."""

    def run(weight: float) -> tuple[float, float]:
        config = RunConfig(task=name, supervise_attention=weight, **settings).resolved()
        task = tasks.get(name)(config)
        torch.manual_seed(seed)
        model = task.build_model()
        index = torch.arange(n_eval)
        before = task.gold_divergence(model, "test", index)
        optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
        g = torch.Generator().manual_seed(seed)
        model.train()
        for _ in range(steps):
            batch = torch.randint(0, task.n_train(), (config.batch_size,), generator=g)
            optimizer.zero_grad()
            task.loss(model, batch).backward()
            optimizer.step()
        return before, task.gold_divergence(model, "test", index)

    start, plain = run(0.0)
    start_too, supervised = run(1.0)
    assert start == start_too  # the same initial model
    return start, plain, supervised
