"""Tables for a task's run report (:meth:`attnkit.tasks.base.Task.report_tables`): each a dict
with a ``title``, an optional ``note``, a ``header`` and its ``rows``."""

from __future__ import annotations

from attnkit.evaluation.classification import precision_recall_f1

__all__ = ["classification_tables"]


def classification_tables(target, predicted, labels: list[str]) -> list[dict]:
    """Report tables (:meth:`attnkit.tasks.base.Task.report_tables`) of a classifier on held-out
    items: the confusion matrix (row: true label, column: predicted label, cell: number of
    items) and each label's precision, recall, F1 and support, with the macro and weighted
    averages (:func:`attnkit.evaluation.classification.precision_recall_f1`).

    Args:
        target, predicted: 1-D integer tensors of label ids, one per item.
        labels: the label names, by id.
    """
    ids = list(range(len(labels)))
    t, p = [int(x) for x in target.tolist()], [int(x) for x in predicted.tolist()]
    counts = [[0] * len(ids) for _ in ids]
    for a, b in zip(t, p, strict=True):
        counts[a][b] += 1
    per = precision_recall_f1(t, p, average=None, labels=ids)
    rows = [
        [labels[c], f"{per.precision[c]:.4f}", f"{per.recall[c]:.4f}", f"{per.f1[c]:.4f}",
         str(per.support[c])]
        for c in ids
    ]  # fmt: skip
    for average in ("macro", "weighted"):
        a = precision_recall_f1(t, p, average=average, labels=ids)
        rows.append([f"({average} average)", f"{a.precision:.4f}", f"{a.recall:.4f}",
                     f"{a.f1:.4f}", str(a.support)])  # fmt: skip
    return [
        {
            "title": "Confusion matrix (test split)",
            "note": "Rows: the true label; columns: the predicted label; cells: test items.",
            "header": ["true \\ predicted", *labels],
            "rows": [[labels[c], *counts[c]] for c in ids],
        },
        {
            "title": "Per-label precision, recall and F1 (test split)",
            "header": ["label", "precision", "recall", "F1", "support"],
            "rows": rows,
        },
    ]
