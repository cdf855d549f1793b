"""Types of queries (Brauwers 3.3.1) as a tag: where an attention part's query comes from —
basic (e.g. a decoder state), specialized (built by another attention module) or self-attentive
— for :func:`attnkit.describe`."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from attnkit import taxonomy as tx

__all__ = ["QueryTagged"]


class QueryTagged(nn.Module):
    """Wraps an attention module and records where its query comes from, for ``describe``:
    ``"basic"`` (e.g. a decoder state), ``"specialized"`` (built by another attention module)
    or ``"self-attentive"``. Calls pass through unchanged."""

    _TYPES: ClassVar[dict[str, tx.QueryType]] = {
        "basic": tx.QueryType.BASIC,
        "specialized": tx.QueryType.SPECIALIZED,
        "self-attentive": tx.QueryType.SELF_ATTENTIVE,
    }

    def __init__(self, module: nn.Module, query: str) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if query not in self._TYPES:
            raise ValueError(f"query must be one of {sorted(self._TYPES)}, got {query!r}")
        self.module, self.query = module, query

    def taxonomy_tags(self) -> list:
        return [self._TYPES[self.query]]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
