"""StreamingLLM decoding (Xiao, Tian, Chen, Han and Lewis, "Efficient Streaming Language Models
with Attention Sinks", ICLR 2024): a KV cache that keeps the first ``sinks`` tokens ("attention
sinks") and a rolling window of the last ``window`` tokens, so that a model decodes any number of
tokens with constant memory.

Trained models put much attention on the first tokens whatever they are (they are visible to
every later query, so softmax's surplus mass lands there); evicting them, as a plain sliding
window does, breaks the model once the text outgrows the window. Keeping them (4 in the paper)
next to the window restores it (paper Sec. 3.2, Fig. 1d).

Positions (paper Sec. 3.2, "positional encoding"): positions are assigned by place *in the
cache*, not in the original text. The cache stores keys before the position scheme (as
:class:`attnkit.kv_cache.LayerCache` does), and :class:`attnkit.MultiHeadAttention` applies the
scheme afresh at every step to the keys in cache order, at positions 0 … N − 1, with the new
queries after them (``q_offset`` = the cache's length). With RoPE the kept tokens' keys are
rotated after retrieval: when the cache holds tokens [0, 1, 2, 3, 6, 7, 8] and token 9 is decoded,
they sit at positions 0 … 6 and token 9 at 7, as in the paper's example.

:class:`StreamingCache` is such a cache: :meth:`StreamingCache.append` returns the cached keys and
the new ones (every key the new queries attend over) and then keeps only the sinks and the last
``window`` positions, so its length never exceeds ``sinks + window``. Within one call of M > 1
tokens (a prompt), each query should still see only the sinks and its own window:
:meth:`StreamingCache.step_mask` gives that mask for the next call.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from attnkit import arguments
from attnkit.kv_cache import LayerCache

__all__ = ["StreamingCache", "streaming_mask"]


def streaming_mask(
    m: int, cached: int, *, sinks: int, window: int, device: torch.device | str | None = None
) -> Tensor:
    """(M, cached + M) mask for M new queries after ``cached`` keys: query i (the new token at
    cache place ``cached + i``) may attend the first ``sinks`` keys and the ``window`` keys
    before it and itself — the last ``window + 1`` places up to its own — and no later key."""
    arguments.nonnegative_int(m, "m")
    arguments.nonnegative_int(cached, "cached")
    arguments.nonnegative_int(sinks, "sinks")
    arguments.nonnegative_int(window, "window")
    i = torch.arange(cached, cached + m, device=device)[:, None]
    j = torch.arange(cached + m, device=device)[None, :]
    return (j <= i) & ((j < sinks) | (j >= i - window))


class StreamingCache(LayerCache):
    """A :class:`attnkit.kv_cache.LayerCache` that keeps the first ``sinks`` positions and the
    last ``window`` positions (StreamingLLM): at most ``sinks + window`` keys and values whatever
    the number of tokens decoded.

    Args:
        sinks: the number of first tokens kept (4 in the paper).
        window: the number of most recent tokens kept.

    ``seen`` counts the tokens appended in all. Pass it as ``cache=`` to
    :class:`attnkit.MultiHeadAttention` (with ``position="rope"`` for the paper's positions).
    """

    # positions between the sinks and the window are dropped
    keeps_every_position: ClassVar[bool] = False

    # the window re-places its keys at their positions in the cache
    holds_placed_keys: ClassVar[bool] = False

    def __init__(self, sinks: int = 4, window: int = 1020) -> None:
        super().__init__()
        self.sinks = arguments.nonnegative_int(sinks, "sinks")
        self.window = arguments.positive_int(window, "window")
        self.seen = 0

    @property
    def capacity(self) -> int:
        """sinks + window: the most positions the cache holds between calls."""
        return self.sinks + self.window

    def step_mask(self, m: int, device: torch.device | str | None = None) -> Tensor:
        """The (M, len(self) + M) mask of the next call with M tokens: each sees the sinks, the
        ``window`` places before it and itself (every key when M = 1 and the cache is in
        steady state)."""
        return streaming_mask(m, len(self), sinks=self.sinks, window=self.window, device=device)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Return every cached key and value followed by the M new ones (what the new queries
        attend over), then evict all but the first ``sinks`` and the last ``window``."""
        keys, values = super().append(k, v)
        self.seen += k.shape[-2]
        n = keys.shape[-2]
        if n > self.capacity:
            keep = torch.cat([torch.arange(self.sinks), torch.arange(n - self.window, n)]).to(
                keys.device
            )
            # index_select copies: the cache never holds a view of the full-length tensors
            self.k = keys.index_select(-2, keep)
            self.v = values.index_select(-2, keep)
        return keys, values
