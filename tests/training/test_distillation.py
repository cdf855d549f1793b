"""Attention distillation: the loss against loops, the teacher as fixed soft gold, and a
one-layer student that learns the teacher's parent head (never seeing a parent) and the task."""

import math

import pytest
import torch
from parent_tagger import Tagger, accuracy, parent_class, tag_loss

from attnkit.training.distillation import attention_distillation_loss, distill
from attnkit.training.graph_capture import stack_head_weights
from attnkit.training.head_supervision import parent_accuracy


def test_kl_and_mse_against_loops():
    torch.manual_seed(0)
    s = torch.randn(2, 3, 4, dtype=torch.float64).softmax(-1)
    t = torch.randn(2, 3, 4, dtype=torch.float64).softmax(-1)
    kl = [
        sum(float(t[b, i, j]) * math.log(float(t[b, i, j] / s[b, i, j])) for j in range(4))
        for b in range(2)
        for i in range(3)
    ]
    mse = [
        sum(float(t[b, i, j] - s[b, i, j]) ** 2 for j in range(4)) / 4
        for b in range(2)
        for i in range(3)
    ]
    assert float(attention_distillation_loss(s, t)) == pytest.approx(sum(kl) / 6)
    assert float(attention_distillation_loss(s, t, kind="mse")) == pytest.approx(sum(mse) / 6)
    assert float(attention_distillation_loss(t, t)) == pytest.approx(0.0, abs=1e-12)


def test_teacher_is_fixed_gold_and_masked_rows_do_not_count():
    s = torch.tensor([[0.5, 0.5], [0.9, 0.1]], requires_grad=True)
    t = torch.tensor([[1.0, 0.0], [0.0, 0.0]], requires_grad=True)  # second row: no mass
    attention_distillation_loss(s, t).backward()
    assert t.grad is None
    assert s.grad[1].abs().sum() == 0 and s.grad[0, 0] < 0
    with pytest.raises(ValueError, match="kind must be 'kl' or 'mse'"):
        attention_distillation_loss(s, t, kind="js")


def test_student_learns_the_teachers_attention_and_the_task(lisa_tagger):
    teacher, train, test = lisa_tagger.model, lisa_tagger.train, lisa_tagger.test
    name = "encoder.layers.0.self_attention.module"
    pairs, heads = {name: name}, [0]  # the student's only head learns the teacher's head 0
    labels = parent_class(train)
    g = torch.Generator().manual_seed(1)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        student = Tagger(layers=1, heads=1)
    with torch.no_grad():
        _, before = distill(student, teacher, test.tokens, pairs=pairs, heads=heads)
    optimiser = torch.optim.Adam(student.parameters(), lr=1e-2)
    for _ in range(80):
        i = torch.randint(0, len(train.tokens), (32,), generator=g)
        logits, kl = distill(student, teacher, train.tokens[i], pairs=pairs, heads=heads)
        loss = tag_loss(logits, labels[i]) + kl
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    with torch.no_grad():
        tags, after = distill(student, teacher, test.tokens, pairs=pairs, heads=heads)
        _, weights = stack_head_weights(
            student.encoder, student.inputs(test.tokens), layer=0, head=0
        )
    assert float(after) < 0.1 * float(before), (float(before), float(after))
    assert parent_accuracy(weights, test.parents) > 0.9
    assert accuracy(tags, parent_class(test)) > 0.9
