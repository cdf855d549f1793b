"""The ``lengthgen`` task: strings and answers checked by integer arithmetic, metrics checked on
an oracle that answers by the rules and on one that gets the long strings wrong."""

from __future__ import annotations

import pytest
import torch

from attnkit import tasks
from attnkit.experiments.config import ConfigError, RunConfig
from attnkit.tasks.lengthgen_task import EQ, OPS, PAD, PLUS, VOCAB, L, make_lengthgen


def _answer(question: list[int]) -> list[int]:
    """The answer by the subtask's rule: digits as a decimal string, least significant first."""
    op, body = question[0], question[1:-1]
    assert question[-1] == EQ
    if op == OPS["copy"]:
        return body
    if op == OPS["reverse"]:
        return body[::-1]
    cut = body.index(PLUS)
    a, b = body[:cut], body[cut + 1 :]
    total = int("".join(map(str, a[::-1]))) + int("".join(map(str, b[::-1])))
    return [int(c) for c in str(total).zfill(len(a) + 1)[::-1]]


def test_strings_answers_and_lengths():
    tokens, is_answer, ops = make_lengthgen(90, (1, L), seed=0)
    sizes = set()
    for row, ans, op in zip(tokens.tolist(), is_answer.tolist(), ops.tolist(), strict=True):
        start = ans.index(True)
        end = start + sum(ans)
        question, answer = row[:start], row[start:end]
        assert question[0] == list(OPS.values())[op]
        assert answer == _answer(question)
        assert all(t == PAD for t in row[end:])
        sizes.add(len(answer) - (op == 2))
    assert sizes == set(range(1, L + 1))
    _, is_long, _ = make_lengthgen(9, (2 * L, 2 * L), seed=1)
    assert sorted(set(is_long.sum(1).tolist())) == [2 * L, 2 * L + 1]


class _Oracle(torch.nn.Module):
    """Next-token logits by the rules (one-hot); ``long_wrong`` misses strings over L digits."""

    def __init__(self, long_wrong=False):
        super().__init__()
        self.long_wrong = long_wrong

    def forward(self, tokens):
        logits = torch.zeros(*tokens.shape, VOCAB)
        for b, row in enumerate(tokens.tolist()):
            if EQ not in row:
                continue
            eq = row.index(EQ)
            answer = _answer(row[: eq + 1])
            for t, digit in enumerate(answer):
                if eq + t < len(row):
                    wrong = self.long_wrong and len(answer) > L + 1
                    logits[b, eq + t, (digit + wrong) % 10] = 1.0
        return logits


def _task():
    config = RunConfig(task="lengthgen", n_train=12, n_test=30, epochs=1, batch_size=4)
    return tasks.get("lengthgen")(config.resolved())


def test_metrics_of_the_oracle_and_of_one_failing_long_strings():
    task = _task()
    perfect = task.evaluate(_Oracle(), "test")
    assert perfect == dict.fromkeys(task.metrics, 1.0)
    short_only = task.evaluate(_Oracle(long_wrong=True), "test")
    assert short_only["accuracy"] == 1.0 and short_only["addition_accuracy"] == 1.0
    assert short_only["accuracy_2L"] == 0.0 and short_only["digit_accuracy_2L"] == 0.0
    assert task.evaluate(_Oracle(), "validation") == {"accuracy": 1.0}


@pytest.mark.parametrize("position", ["default", "learned", "shaw"])
def test_models_for_each_scheme_train(position):
    config = RunConfig(
        task="lengthgen", n_train=12, n_test=6, epochs=1, batch_size=4, d_model=8,
        score="scaled_dot", position=position,
    )  # fmt: skip
    task = tasks.get("lengthgen")(config.resolved())
    model = task.build_model()
    loss = task.loss(model, torch.arange(4))
    loss.backward()
    assert loss.isfinite()
    if position == "default":
        assert set(task.evaluate(model, "test")) == set(task.metrics)
        maps = task.heatmaps(model)
        assert len(maps) == 3 and maps[0]["gold"].sum() == 2 * L  # copy: one source per digit


def test_unknown_scheme_is_refused():
    with pytest.raises(ConfigError, match="unknown position scheme"):
        RunConfig(task="lengthgen", position="rop").resolved()
