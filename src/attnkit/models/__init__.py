"""Task models built only from attnkit parts: the published attention models of Brauwers
Table III (:mod:`attnkit.models.table3`) and the reusable architectures they share."""

from attnkit.models.captioning import ImageCaptioner
from attnkit.models.seq2seq import Seq2SeqAttention

__all__ = ["ImageCaptioner", "Seq2SeqAttention"]
