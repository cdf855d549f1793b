"""Tasks for ``attnkit run``: embedded data sets with gold attention, generated locally (nothing
is downloaded at run time), each registered with its model, metrics, heatmaps and defaults.

``available()`` lists the registered names; ``get(name)`` returns the task class, failing
loudly (with the closest name) on an unknown one.
"""

from attnkit.tasks import (
    babi_task,
    copy_task,
    dates_lm_task,
    dates_task,
    digits_task,
    kv_recall_task,
    lengthgen_task,
    listops_task,
    mqar_task,
    pairs_task,
    rationale_task,
    recall_task,
    seq2seq_task,
    sort_task,
    text_task,
)
from attnkit.tasks.base import REGISTRY, Metric, Task, setting

available = REGISTRY.available
get = REGISTRY.get

__all__ = [
    "REGISTRY",
    "Metric",
    "Task",
    "available",
    "babi_task",
    "copy_task",
    "dates_lm_task",
    "dates_task",
    "digits_task",
    "get",
    "kv_recall_task",
    "lengthgen_task",
    "listops_task",
    "mqar_task",
    "pairs_task",
    "rationale_task",
    "recall_task",
    "seq2seq_task",
    "setting",
    "sort_task",
    "text_task",
]
