"""Attention over a sequence split across processes: ring attention (context parallelism).

:func:`ring_attention` evaluates exact attention, every score × every streaming alignment, on a
sequence whose parts live on the ranks of a ``torch.distributed`` process group;
:func:`shard` / :func:`unshard` cut a sequence into the ranks' parts and join them back;
:class:`RingAttention` is the per-head part that gives :class:`attnkit.MultiHeadAttention`
context parallelism through its ``attention=`` slot, with position schemes applied by global
positions (:mod:`attnkit.distributed.positions`); :func:`context_parallel` turns a model built
from those layers into its ring twin, sharing the parameters; :func:`ring_groups` makes the
process groups of the rings with a timeout.

The modern parts run over the ring too: the gated linear family with its recurrent states
composed across the ranks (:func:`ring_recurrence`, :class:`RingLinearAttention`), attention
sinks as a streaming alignment (:class:`StreamingSinkSoftmax`, in :class:`RingAttention`), and
multi-head latent attention passing its latents (:class:`RingLatentAttention`);
:func:`context_parallel` picks the form for each part (:mod:`attnkit.distributed.forms`).
"""

from attnkit.distributed.attention import RingAttention
from attnkit.distributed.groups import ring_groups
from attnkit.distributed.latent import RingLatentAttention
from attnkit.distributed.layout import LAYOUTS, shard, unshard
from attnkit.distributed.linear_ring import (
    RingLinearAttention,
    reasons_not_recurrent,
    ring_recurrence,
)
from attnkit.distributed.parallel import context_parallel
from attnkit.distributed.positions import RingAbsolute, RingPositions, global_positions
from attnkit.distributed.ring import reasons_not_supported, ring_attention
from attnkit.distributed.sinks import StreamingSinkSoftmax
from attnkit.distributed.transport import RingError

__all__ = [
    "LAYOUTS",
    "RingAbsolute",
    "RingAttention",
    "RingError",
    "RingLatentAttention",
    "RingLinearAttention",
    "RingPositions",
    "StreamingSinkSoftmax",
    "context_parallel",
    "global_positions",
    "reasons_not_recurrent",
    "reasons_not_supported",
    "ring_attention",
    "ring_groups",
    "ring_recurrence",
    "shard",
    "unshard",
]
