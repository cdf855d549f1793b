"""The generated tasks plant what they say, checked by a loop."""

import pytest
import torch

from attnkit.training.synthetic import parent_sequences, signal_sequences


def test_parents_are_the_nearest_earlier_anchor():
    task = parent_sequences(20, 9, vocab=10, anchors=3, generator=torch.Generator().manual_seed(1))
    assert task.tokens.shape == task.parents.shape == (20, 9)
    for row, parents in zip(task.tokens.tolist(), task.parents.tolist(), strict=True):
        assert row[0] < 3 and parents[0] == -1
        for i in range(1, 9):
            anchors = [j for j in range(i) if row[j] < 3]
            assert parents[i] == max(anchors)


def test_one_signal_token_per_sequence():
    task = signal_sequences(30, 7, vocab=9, classes=3, generator=torch.Generator().manual_seed(2))
    for row, pos, label in zip(
        task.tokens.tolist(), task.position.tolist(), task.label.tolist(), strict=True
    ):
        assert [j for j, t in enumerate(row) if t < 3] == [pos]
        assert row[pos] == label


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: parent_sequences(2, 4, vocab=3, anchors=3), "anchors must be < vocab"),
        (lambda: parent_sequences(2, 4, anchor_rate=1.5), "anchor_rate must be in"),
        (lambda: parent_sequences(0, 4), "n must be a positive int"),
        (lambda: signal_sequences(2, 4, vocab=4, classes=4), "classes must be < vocab"),
    ],
)
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_generator_type_is_checked():
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        signal_sequences(2, 4, generator=0)
