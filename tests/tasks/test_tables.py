"""A classifier's report tables: the confusion matrix counted item by item, and precision,
recall and F1 per label and averaged, from their definitions."""

import torch

from attnkit.tasks.tables import classification_tables


def test_the_confusion_matrix_and_the_per_label_scores_follow_their_definitions():
    labels = ["neg", "neu", "pos"]
    target = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2])
    predicted = torch.tensor([0, 1, 1, 1, 2, 2, 2, 0, 2])
    confusion, scores = classification_tables(target, predicted, labels)
    assert confusion["header"] == ["true \\ predicted", *labels]
    # row: the true label, column: the predicted one
    assert confusion["rows"] == [["neg", 1, 1, 0], ["neu", 0, 2, 1], ["pos", 1, 0, 3]]
    assert scores["header"] == ["label", "precision", "recall", "F1", "support"]
    # precision tp / predicted, recall tp / true: neg 1/2, 1/2; neu 2/3, 2/3; pos 3/4, 3/4
    expected = {"neg": (1 / 2, 1 / 2), "neu": (2 / 3, 2 / 3), "pos": (3 / 4, 3 / 4)}
    support = {"neg": 2, "neu": 3, "pos": 4}
    for row in scores["rows"][:3]:
        p, r = expected[row[0]]
        f1 = 2 * p * r / (p + r)
        assert row[1:] == [f"{p:.4f}", f"{r:.4f}", f"{f1:.4f}", str(support[row[0]])]
    macro, weighted = scores["rows"][3:]
    mean_p = (1 / 2 + 2 / 3 + 3 / 4) / 3
    weighted_p = (2 * 1 / 2 + 3 * 2 / 3 + 4 * 3 / 4) / 9
    assert macro[0] == "(macro average)" and macro[1] == f"{mean_p:.4f}" and macro[4] == "9"
    assert weighted[0] == "(weighted average)" and weighted[1] == f"{weighted_p:.4f}"


def test_a_label_never_predicted_scores_zero_precision():
    confusion, scores = classification_tables(
        torch.tensor([0, 1]), torch.tensor([0, 0]), ["a", "b"]
    )
    assert confusion["rows"] == [["a", 1, 0], ["b", 1, 0]]
    assert scores["rows"][1][1:4] == ["0.0000", "0.0000", "0.0000"]
