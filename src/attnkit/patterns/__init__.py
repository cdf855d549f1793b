"""Sparse attention patterns as mask functions (Soydaner 5.1; FlexAttention's ``mask_mod``),
composable with :func:`and_masks` / :func:`or_masks`, evaluated block-sparsely by the chunked
kernel through :func:`block_mask`:

    bm = ak.patterns.block_mask(ak.patterns.sliding_window(256), n)
    out = ak.attention(q, k, v, block_mask=bm)     # cost follows the window's density
"""

from attnkit.patterns.base import and_masks, block_mask, dense, or_masks
from attnkit.patterns.directional import backward, forward
from attnkit.patterns.global_tokens import bigbird, longformer
from attnkit.patterns.local_2d import local_2d, query_blocks
from attnkit.patterns.packing import (
    document_ids,
    packed,
    packed_block_mask,
    packed_mask,
    position_ids,
)
from attnkit.patterns.prefix import prefix_lm, prefix_lm_mask
from attnkit.patterns.sparse_transformer import fixed, strided
from attnkit.patterns.window import causal, dilated_window, sliding_window

__all__ = [
    "and_masks",
    "backward",
    "bigbird",
    "block_mask",
    "causal",
    "dense",
    "dilated_window",
    "document_ids",
    "fixed",
    "forward",
    "local_2d",
    "longformer",
    "or_masks",
    "packed",
    "packed_block_mask",
    "packed_mask",
    "position_ids",
    "prefix_lm",
    "prefix_lm_mask",
    "query_blocks",
    "sliding_window",
    "strided",
]
