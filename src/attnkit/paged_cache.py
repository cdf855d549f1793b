"""A paged key/value cache for batches of sequences of different lengths (the memory layout of
vLLM's PagedAttention: Kwon et al., "Efficient Memory Management for Large Language Model
Serving with PagedAttention", SOSP 2023).

A contiguous :class:`attnkit.kv_cache.LayerCache` stores a batch as one (B, H_kv, N, d) tensor:
every sequence takes the room of the longest, a finished sequence keeps its room until the whole
batch ends, and a new sequence cannot join. A paged cache cuts the token axis into pages of
``page_size`` tokens. Every layer holds one pool of pages shared by all sequences, and every
sequence holds a page table, the list of its pages in order (one table serves all layers, whose
pools are laid out alike): token p of a sequence lives in slot p mod page_size of page
table[p // page_size]. Pages are taken from the pool when a sequence grows past its last page and
given back when it is freed, so the memory held is that of the tokens cached, rounded up to a
page per sequence, and sequences join and leave the batch at any step (continuous batching).

Interface. :class:`PagedLayerCache` is a :class:`attnkit.kv_cache.LayerCache`, and
:class:`PagedKVCache` a :class:`attnkit.kv_cache.KVCache`, so :class:`attnkit.MultiHeadAttention`
and :class:`attnkit.transformer.TransformerDecoder` take them unchanged. Every call runs inside
``with cache.step(sequences, counts) as step:``, which says which sequences form the batch
(in batch order) and how many new tokens each brings. The new tokens come **left-padded** to the
longest count M: row b holds the ``counts[b]`` new tokens of its sequence in its last
``counts[b]`` places. :meth:`PagedLayerCache.append` writes the new keys and values into the
sequence's pages and returns the keys and values of every sequence gathered into a contiguous
(B, H_kv, T + M, d) view, with T = ``len(cache)`` the longest cached length in the batch.

Layout of the view and positions. Each sequence's L_b cached and n_b new keys are placed
**right-aligned** in the T + M columns: its token p sits in column T + M − (L_b + n_b) + p, and
its new queries in the last n_b of the query columns T … T + M − 1, where the attention layer
places them (``q_offset`` = T). The columns before a sequence's first token are padding, hidden
by ``step.mask`` (B, M, T + M), which also holds the causal mask; the padded query rows attend
over everything so that they stay finite (their outputs are to be ignored). The distance
between a sequence's query and key columns is the distance between the tokens, so a position
scheme that reads only i − j (RoPE, ALiBi, T5's buckets, Shaw's, Music Transformer's and
Transformer-XL's relative positions, no positions) sees every sequence at its own positions.
When the batch is ragged (some sequence has padding columns), a layer whose scheme may read
absolute positions (one that does not declare
:attr:`~attnkit.positions.PositionScheme.translation_invariant`, such as dynamic-NTK RoPE, which
reads the length), a sparse ``pattern`` or a ``score_mod`` is refused;
an absolute position embedding added to the token embeddings takes ``step.positions``, each new
token's position in its own sequence. With all sequences of equal length there is no padding
and the view is the contiguous cache.

Reading the pages. A layer whose part is a plain scaled-dot softmax
(:class:`attnkit.Attention` with :class:`~attnkit.scores.ScaledDot` and
:class:`~attnkit.alignments.Softmax`) attends over the pages in place
(:meth:`PagedLayerCache.attend_in_place`, called by :class:`attnkit.MultiHeadAttention`): the
columns of the view are read from the pools a block of ``block`` columns at a time, the position
scheme placed on each block at its columns, and the blocks combined by an online softmax, so the
keys and values of the batch are never copied into a (B, H_kv, T + M, d) view; a step reads
each cached key and value once and holds one block besides the pools. Every other layer (another
part, a scheme with a term on the values, a call that asks for the weights or passes a
``block_mask``/``score_mod``, hooks) gets the gathered view from :meth:`PagedLayerCache.append`,
as does every layer of a cache made with ``gather=True``: a copy of B · (T + M) · H_kv ·
(d + d_v) numbers at every call of every layer. Each call also builds its index tensors
(O(B · (T + M))) once for all layers. The cache is meant for inference (under
``torch.no_grad()``): the pools are written in place.

Sharing and eviction. :meth:`PagedKVCache.fork` starts a sequence on another's prefix by sharing
its pages (reference-counted; a step that writes into a shared page copies it first: copy on
write), :meth:`PagedKVCache.rollback` forgets the last k tokens of sequences (speculative
decoding) and :meth:`PagedKVCache.free` releases a finished sequence's pages. The pool is capped
by ``num_pages``: a step that needs a page when all are held is refused, naming the limit, and
changes nothing. Which sequence to give up is the caller's choice (a scheduler's): the cache
evicts nothing by itself, since dropping a live sequence's pages would change its outputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import TracebackType
from typing import ClassVar

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.alignments.softmax import Softmax
from attnkit.core import Attention
from attnkit.head import HeadAttention
from attnkit.kv_cache import KVCache, LayerCache
from attnkit.scores.multiplicative import ScaledDot

__all__ = ["PagedKVCache", "PagedLayerCache", "PagedStep"]


def _translation_invariant(layer: nn.Module) -> str | None:
    """None when shifting every query and key of ``layer`` by the same amount leaves its output
    unchanged; otherwise the reason it may not."""
    for name in ("pattern", "score_mod"):
        if getattr(layer, name, None) is not None:
            return f"it has a {name} (whose q_idx and kv_idx may be read as absolute places)"
    scheme = getattr(layer, "position", None)
    if scheme is None or scheme.translation_invariant:
        return None
    why = (
        "reads the length of the whole sequence"
        if scheme.reads_total_length
        else "does not declare translation_invariant = True (declare it on a scheme that reads "
        "only i - j)"
    )
    return f"its position scheme {type(scheme).__name__} {why}"


def _plain_softmax(layer: nn.Module) -> bool:
    """True when ``layer``'s attention is softmax(q kᵀ / √d) v with nothing else in the part
    (no soft-cap, a fixed temperature, no dropout at work, no pattern or score_mod): what
    :meth:`PagedLayerCache.attend_in_place` computes block by block."""
    part = getattr(layer, "attention", None)
    if type(part) is not Attention:
        return False
    score, align = part.score, part.align
    return (
        type(score) is ScaledDot
        and score.softcap is None
        and type(align) is Softmax
        and align.fixed_temperature is not None
        and not (part.training and part.dropout > 0)
        and getattr(layer, "pattern", None) is None
        and getattr(layer, "score_mod", None) is None
    )


class PagedStep:
    """One call of the layers on a batch of sequences of a :class:`PagedKVCache`, made by
    :meth:`PagedKVCache.step` and used as a context manager: on a normal exit the sequences'
    lengths grow by their counts (every layer must have appended once); on an exception
    nothing changes and the pages taken for the step are given back.

    Attributes:
        sequences: the sequence ids, in batch order. counts: the new tokens of each.
        cached: T, the longest cached length in the batch (``len`` of every layer's cache).
        width: M, the longest count: the new tokens come left-padded to (B, M).
        mask: (B, M, T + M) bool, True = may attend: causal, over each sequence's own keys;
            padded query rows may attend every earlier column (their outputs are meaningless).
        positions: (B, M) long, each new token's position in its own sequence (−1 at padding),
            for an absolute position embedding.
        ragged: whether some sequence has padding columns in the view.
    """

    def __init__(
        self,
        cache: PagedKVCache,
        sequences: tuple[int, ...],
        counts: tuple[int, ...],
        device: torch.device | str | None,
    ) -> None:
        self.cache = cache
        self.sequences = sequences
        self.counts = counts
        lengths = [cache.length_of(s) for s in sequences]
        self.cached = max(lengths, default=0)
        self.width = max(counts)
        size = cache.page_size
        m = self.width
        n = self.cached + m
        old = torch.tensor(lengths, dtype=torch.long, device=device)[:, None]  # (B, 1)
        new = torch.tensor(counts, dtype=torch.long, device=device)[:, None]
        shift = n - (old + new)  # the column of each sequence's token 0
        self.ragged = any(n - (ln + c) > 0 for ln, c in zip(lengths, counts, strict=True))
        tables = [cache._tables[s] for s in sequences]
        pages = max(1, *(len(t) for t in tables))
        table = torch.tensor(
            [t + [0] * (pages - len(t)) for t in tables], dtype=torch.long, device=device
        )  # (B, pages), padded with page 0 (never read: see valid)
        # the view: column c of row b holds the sequence's token c − shift_b
        place = torch.arange(n, device=device)[None, :] - shift  # (B, N)
        self.valid = place >= 0
        place = place.clamp(min=0)
        page = table.gather(1, place // size)
        self.gather = torch.where(self.valid, page * size + place % size, 0)
        # the new tokens: input row i of b is real from M − count_b on, token L_b + i − (M − n_b)
        row = torch.arange(m, device=device)[None, :]  # (1, M)
        real = row >= m - new
        self.positions = torch.where(real, old + row - (m - new), -1)
        batch, col = real.nonzero(as_tuple=True)
        token = self.positions[batch, col]
        self.write_rows, self.write_cols = batch, col
        self.write_slots = table[batch, token // size] * size + token % size
        query = self.cached + row[0][:, None]  # (M, 1): the column of each query
        causal = torch.arange(n, device=device)[None, :] <= query  # (M, N)
        self.mask = causal[None] & (self.valid[:, None, :] | ~real[:, :, None])
        self._appended: set[int] = set()

    def __enter__(self) -> PagedStep:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        missing = [i for i in range(len(self.cache)) if i not in self._appended]
        if exc_type is None and missing:
            self.cache._end(self, advance=False)
            raise ValueError(
                f"PagedKVCache.step: layers {missing} did not append in this step; every "
                "layer of the cache must run once per step (the page tables are shared)"
            )
        self.cache._end(self, advance=exc_type is None)


class PagedLayerCache(LayerCache):
    """One layer's pool of pages in a :class:`PagedKVCache`: keys (pages · page_size, H_kv, d)
    and values (pages · page_size, H_kv, d_v), made on the first append and grown with the
    cache's pool. Written and read only inside :meth:`PagedKVCache.step` (see the module
    docstring for the layout of the view); like every cache it belongs to one layer."""

    # sequences sit at other offsets of the batch view: keys are placed when read
    holds_placed_keys: ClassVar[bool] = False

    def __init__(self, cache: PagedKVCache, index: int) -> None:
        super().__init__()
        self._cache = cache
        self.index = index
        self.k_pool: Tensor | None = None
        self.v_pool: Tensor | None = None
        self._refusal: str | None = None

    def __len__(self) -> int:
        """T: inside a step the longest cached length in its batch (the place of the first new
        query in the view); outside, the longest length of the live sequences."""
        step = self._cache._step
        if step is not None:
            return step.cached
        return max(self._cache._lengths.values(), default=0)

    def claim(self, layer: nn.Module) -> None:
        super().claim(layer)
        self._refusal = _translation_invariant(layer)

    def check_part(self, part: HeadAttention | None, layer: nn.Module) -> None:
        """Refuse a part that does not declare ``decodes_with_cache`` (see
        :meth:`attnkit.kv_cache.LayerCache.check_part`) or that keeps its own decoding state
        (``takes_cache``): these pages hold keys and values."""
        super().check_part(part, layer)
        if part is not None and part.takes_cache:
            raise ValueError(
                f"a PagedLayerCache holds keys and values; {type(layer).__name__} holds "
                f"{type(part).__name__}, a part that declares takes_cache = True (it keeps its "
                "own decoding state): use its own cache"
            )

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new keys (B, H_kv, M, d) and values (B, H_kv, M, d_v) of the step, row b
        left-padded (its last counts[b] places are real), into the sequences' pages; return
        every sequence's keys and values gathered into (B, H_kv, T + M, ·), right-aligned."""
        step = self._check_step(k, v)
        self._write(k, v, step)
        keys = self._gather(self.k_pool, step, k.device)  # type: ignore[arg-type]
        values = self._gather(self.v_pool, step, v.device)  # type: ignore[arg-type]
        step._appended.add(self.index)
        return keys, values

    def rollback(self, k: int) -> None:
        """Refused: the page tables are shared by all layers, so the cache rolls back
        (:meth:`PagedKVCache.rollback`), never one layer."""
        raise ValueError(
            "a PagedLayerCache's positions are its sequences' page tables, shared by every "
            "layer: roll back the whole cache, PagedKVCache.rollback(k, sequences=...)"
        )

    def _check_step(self, k: Tensor, v: Tensor) -> PagedStep:
        """The open step, after checking that k and v are its new keys and values."""
        step = self._cache._step
        if step is None:
            raise ValueError(
                "a PagedLayerCache is read and written inside `with cache.step(sequences, "
                "counts):` (the step says which sequence each batch row is)"
            )
        if self.index in step._appended:
            raise ValueError(f"layer {self.index} of the paged cache appended twice in one step")
        b, m = len(step.sequences), step.width
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, Tensor) or x.dim() != 4 or x.shape[0] != b or x.shape[2] != m:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(
                    f"paged cache: new {name} must be (B, H_kv, M, ·) with B = {b} sequences "
                    f"and M = {m} new places in this step, got {got}"
                )
        if k.shape[1] != v.shape[1]:
            raise ValueError(
                f"paged cache: k {tuple(k.shape)} and v {tuple(v.shape)} differ in H_kv"
            )
        if step.ragged and self._refusal is not None:
            raise ValueError(
                "paged cache: this batch holds sequences of different lengths, whose keys sit "
                "at shifted places in the view, and the layer's output may change under such a "
                f"shift: {self._refusal}; decode sequences of equal lengths together, or "
                "each alone"
            )
        return step

    def attend_in_place(
        self,
        layer: nn.Module,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        query: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        offset: int,
    ) -> Tensor | None:
        """Write the step's new keys k (B, H_kv, M, d) and values v (B, H_kv, M, d_v) into the
        pages and attend the queries q (B, H, M, d) of ``layer`` (a
        :class:`attnkit.MultiHeadAttention`) over the pages in place: the T + M columns of the
        view are read a block of ``block`` columns at a time, straight from the pools, and
        combined by an online softmax (Milakov & Gimelshein 2018), so no (B, H_kv, T + M, d)
        copy of the keys and values is made. Returns the context (B, H, M, d_v), or None when
        the layer needs the gathered view: the cache was made with ``gather=True``, the part is
        not a plain scaled-dot softmax :class:`attnkit.Attention` (or it drops weights in
        training), or the position scheme adds a term on the values. ``mask`` and ``bias``
        are the caller's, over the T + M columns of the view; ``offset`` is T."""
        if self._cache.gather or not _plain_softmax(layer):
            return None
        step = self._check_step(k, v)
        self._write(k, v, step)
        part = layer.attention
        group = q.shape[-3] // k.shape[-3]
        n = step.cached + step.width
        scale = part.score.scale(q.shape[-1]) / part.align.fixed_temperature
        mask = layer._per_head(mask, query)
        bias = layer._per_head(bias, query)
        dev = q.device
        gather, valid = step.gather.to(dev), step.valid.to(dev)
        top = total = acc = None
        for c0 in range(0, n, self._cache.block):
            c1 = min(c0 + self._cache.block, n)
            cols = gather[:, c0:c1]
            hidden = ~valid[:, c0:c1, None, None]
            kb = self.k_pool[cols].masked_fill(hidden, 0).transpose(1, 2)  # type: ignore[index]
            vb = self.v_pool[cols].masked_fill(hidden, 0).transpose(1, 2)  # type: ignore[index]
            if group > 1:
                kb = kb.repeat_interleave(group, dim=1)
                vb = vb.repeat_interleave(group, dim=1)
            qb, kb, bb, value_term = layer._place(
                q, kb, None if bias is None else bias[..., c0:c1], query, offset, c0
            )
            if value_term is not None:
                return None  # nothing read yet: the gathered path writes the same slots again
            e = (qb @ kb.transpose(-1, -2)) * scale
            if bb is not None:
                e = e + bb
            if mask is not None:
                e = e.masked_fill(~mask[..., c0:c1], -math.inf)
            block_top = e.amax(-1, keepdim=True)
            new_top = block_top if top is None else torch.maximum(top, block_top)
            safe = torch.where(torch.isfinite(new_top), new_top, 0)
            w = torch.exp(e - safe)
            if top is None:
                total, acc = w.sum(-1, keepdim=True), w @ vb
            else:
                fix = torch.exp(top - safe)
                total = total * fix + w.sum(-1, keepdim=True)
                acc = acc * fix + w @ vb
            top = new_top
        step._appended.add(self.index)
        assert total is not None and acc is not None
        return torch.where(total > 0, acc / total.clamp(min=torch.finfo(acc.dtype).tiny), 0)

    def _pool(self, pool: Tensor | None, x: Tensor, name: str) -> Tensor:
        rows = self._cache.capacity * self._cache.page_size
        if pool is None:
            return x.new_zeros(rows, x.shape[1], x.shape[3])
        if pool.shape[1:] != (x.shape[1], x.shape[3]) or pool.dtype != x.dtype:
            raise ValueError(
                f"paged cache: new {name} of shape {tuple(x.shape)} and dtype {x.dtype} does not "
                f"fit the cached {name} (H_kv, d) = {tuple(pool.shape[1:])}, dtype {pool.dtype}"
            )
        if pool.device != x.device:
            raise ValueError(f"paged cache: new {name} is on {x.device}, the pool on {pool.device}")
        if pool.shape[0] < rows:  # the cache's pool grew: grow this layer's alike
            pool = torch.cat([pool, pool.new_zeros(rows - pool.shape[0], *pool.shape[1:])])
        return pool

    def _write(self, k: Tensor, v: Tensor, step: PagedStep) -> None:
        """Write the step's new keys and values into their slots (pages copied on write by
        the step were copied when it opened)."""
        self.k_pool = self._pool(self.k_pool, k, "k")
        self.v_pool = self._pool(self.v_pool, v, "v")
        dev = k.device
        rows, cols, slots = (
            t.to(dev) for t in (step.write_rows, step.write_cols, step.write_slots)
        )
        self.k_pool[slots] = k.transpose(1, 2)[rows, cols]  # (S, H_kv, d) into their slots
        self.v_pool[slots] = v.transpose(1, 2)[rows, cols]

    @staticmethod
    def _gather(pool: Tensor, step: PagedStep, dev: torch.device) -> Tensor:
        view = pool[step.gather.to(dev)]  # (B, N, H_kv, d)
        view = view.masked_fill(~step.valid.to(dev)[..., None, None], 0)
        return view.transpose(1, 2)

    def _copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy page ``src`` onto page ``dst`` for every (src, dst), in both pools."""
        size = self._cache.page_size
        for name in ("k_pool", "v_pool"):
            pool = getattr(self, name)
            if pool is None:
                continue
            rows = self._cache.capacity * size
            if pool.shape[0] < rows:
                pool = torch.cat([pool, pool.new_zeros(rows - pool.shape[0], *pool.shape[1:])])
                setattr(self, name, pool)
            for src, dst in pairs:
                pool[dst * size : (dst + 1) * size] = pool[src * size : (src + 1) * size]

    @property
    def nbytes(self) -> int:
        """Bytes held by this layer's pools (every page, used or free) and its cross-attention
        memory."""
        own = sum(t.numel() * t.element_size() for t in (self.k_pool, self.v_pool) if t is not None)
        return own + self.memory.nbytes


class PagedKVCache(KVCache):
    """A :class:`attnkit.kv_cache.KVCache` of :class:`PagedLayerCache` layers over one page
    table per sequence (module docstring).

    Args:
        layers: the number of layers.
        page_size: the tokens per page.
        num_pages: the most pages the pool may hold (each layer holds that many); None lets the
            pool grow, doubling, whenever no page is free. A step that needs a page when all
            ``num_pages`` are held is refused, naming the limit, and changes nothing.
        gather: read the pages as today's contiguous view at every call (the keys and values
            of the batch copied into (B, H_kv, T + M, d)) instead of in place; the in-place read
            serves layers whose part is a plain scaled-dot softmax (see
            :meth:`PagedLayerCache.attend_in_place`), the view every other layer.
        block: the columns of the view read at once by the in-place read (the memory it needs
            beyond the pools is that of a block of keys and values).

    Sequences are made by :meth:`add` (empty) or :meth:`fork` (sharing another's prefix),
    shortened by :meth:`rollback` and given back by :meth:`free`; every call of the layers
    runs inside :meth:`step`. Pages are reference-counted: a page held by several sequences
    (a shared prefix) is copied before a step writes into it (copy on write), and goes back to
    the pool when its last holder frees it.
    """

    def __init__(
        self,
        layers: int,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        gather: bool = False,
        block: int = 1024,
    ) -> None:
        super().__init__(layers)
        self.page_size = arguments.positive_int(page_size, "page_size")
        self.max_pages = arguments.optional_positive_int(num_pages, "num_pages")
        self.gather = arguments.boolean(gather, "gather")
        self.block = arguments.positive_int(block, "block")
        self.capacity = 0  # pages in each layer's pool
        self._free: list[int] = []  # free pages, the lowest last (taken first)
        self._refs: dict[int, int] = {}  # page -> the number of sequences holding it
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next = 0
        self._step: PagedStep | None = None
        # what the open step changed, to undo: (sequence, index in its table, new page, the
        # page it replaced (copy on write) or None (a page added at the end))
        self._taken: list[tuple[int, int, int, int | None]] = []
        self.layers = [PagedLayerCache(self, i) for i in range(layers)]

    # -- sequences -------------------------------------------------------------------------------

    def add(self) -> int:
        """A new, empty sequence; returns its id."""
        seq, self._next = self._next, self._next + 1
        self._tables[seq], self._lengths[seq] = [], 0
        return seq

    def fork(self, sequence: int, tokens: int | None = None) -> int:
        """A new sequence whose first ``tokens`` tokens (default: all of ``sequence``'s) are
        those of ``sequence``, sharing its pages (prefix sharing: a prompt cached once serves
        many continuations). Nothing is copied now; the first step that writes into a shared
        page (the last, partly filled one) copies it first. Returns the new id."""
        self._outside_step("fork")
        length = self.length_of(sequence)
        tokens = length if tokens is None else arguments.nonnegative_int(tokens, "tokens")
        if tokens > length:
            raise ValueError(
                f"tokens = {tokens}: sequence {sequence} holds only {length} tokens to share"
            )
        seq = self.add()
        shared = self._tables[sequence][: self.pages_for(tokens)]
        for page in shared:
            self._refs[page] += 1
        self._tables[seq], self._lengths[seq] = list(shared), tokens
        return seq

    def free(self, sequence: int) -> None:
        """Give ``sequence``'s hold on its pages back; a page no other sequence holds returns
        to the pool. Its id is gone."""
        self._known(sequence, "sequence")
        if self._step is not None and sequence in self._step.sequences:
            raise ValueError(f"sequence {sequence} is in the open step; free it after the step")
        self._release(self._tables.pop(sequence))
        del self._lengths[sequence]

    def rollback(self, k: int, *, sequences: Sequence[int] | None = None) -> None:
        """Forget the last ``k`` tokens of each of ``sequences`` (default: every live one), as
        if they had never been decoded (speculative decoding drops the rejected draft tokens);
        the pages past the new end are released. Raises ValueError, changing nothing, when a
        sequence holds fewer than k tokens."""
        self._outside_step("rollback")
        arguments.nonnegative_int(k, "k")
        seqs = self.sequences if sequences is None else list(sequences)
        for s in seqs:
            if self.length_of(s) < k:
                raise ValueError(
                    f"k = {k}: sequence {s} holds only {self._lengths[s]} tokens to roll back"
                )
        for s in seqs:
            self._lengths[s] -= k
            keep = self.pages_for(self._lengths[s])
            self._release(self._tables[s][keep:])
            del self._tables[s][keep:]

    def _release(self, pages: list[int]) -> None:
        for page in pages:
            self._refs[page] -= 1
            if not self._refs[page]:
                del self._refs[page]
                self._free.append(page)
        self._free.sort(reverse=True)

    def _outside_step(self, what: str) -> None:
        if self._step is not None:
            raise ValueError(f"PagedKVCache.{what}: a step is open; call it after the step")

    @property
    def sequences(self) -> list[int]:
        """The ids of the live sequences."""
        return list(self._lengths)

    def length_of(self, sequence: int) -> int:
        """The number of tokens cached for ``sequence``."""
        return self._lengths[self._known(sequence, "sequence")]

    def page_table(self, sequence: int) -> list[int]:
        """The pages of ``sequence`` in order (a copy)."""
        return list(self._tables[self._known(sequence, "sequence")])

    def references(self, page: int) -> int:
        """The number of live sequences holding ``page`` (0 for a free page)."""
        return self._refs.get(page, 0)

    @property
    def pages_in_use(self) -> int:
        """The pages held by live sequences (a shared page counts once)."""
        return len(self._refs)

    @property
    def free_pages(self) -> int:
        """The pages of the pool that no sequence holds."""
        return len(self._free)

    def _known(self, sequence: object, name: str) -> int:
        if not isinstance(sequence, int) or sequence not in self._lengths:
            raise ValueError(
                f"{name} must be the id of a live sequence of this cache (from add() or fork(), "
                f"not freed), got {sequence!r}; live: {self.sequences}"
            )
        return sequence

    # -- steps -----------------------------------------------------------------------------------

    def step(
        self,
        sequences: Sequence[int],
        counts: Sequence[int],
        *,
        device: torch.device | str | None = None,
    ) -> PagedStep:
        """Open a call of the layers on ``sequences`` (batch order), with ``counts[b]`` new
        tokens for sequence b, left-padded to the longest count; takes the pages they need and
        copies a shared page they will write into. ``device``: where the step's mask,
        positions and indices are made."""
        if self._step is not None:
            raise ValueError("a step of this cache is open already; steps do not nest")
        seqs = tuple(sequences)
        if not seqs:
            raise ValueError("sequences must name at least one sequence, got none")
        for s in seqs:
            self._known(s, "sequences[...]")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"sequences must be distinct, got {list(seqs)}")
        counts = tuple(counts)
        if len(counts) != len(seqs):
            raise ValueError(
                f"counts must give one count per sequence ({len(seqs)}), got {len(counts)}"
            )
        for c in counts:
            arguments.nonnegative_int(c, "counts[...]")
        if max(counts) < 1:
            raise ValueError(f"counts must bring at least one new token, got {list(counts)}")
        self._taken = []
        copies: list[tuple[int, int]] = []
        try:
            for s, c in zip(seqs, counts, strict=True):
                table, length = self._tables[s], self._lengths[s]
                first = length // self.page_size  # the page the first new token goes to
                if c and first < len(table) and self._refs[table[first]] > 1:
                    page = self._take()
                    copies.append((table[first], page))
                    self._taken.append((s, first, page, table[first]))
                    self._refs[table[first]] -= 1
                    table[first] = page
                while len(table) * self.page_size < length + c:
                    table.append(self._take())
                    self._taken.append((s, len(table) - 1, table[-1], None))
        except ValueError:
            self._give_back_taken()
            raise
        for layer in self.layers:
            layer._copy_pages(copies)
        self._step = PagedStep(self, seqs, counts, device)
        return self._step

    def _take(self) -> int:
        if not self._free:
            if self.max_pages is not None and self.capacity >= self.max_pages:
                raise ValueError(
                    f"num_pages = {self.max_pages}: every page of {self.page_size} tokens is in "
                    f"use ({self.pages_in_use} held by {len(self._lengths)} sequences); free "
                    "finished sequences or make the cache with more pages"
                )
            grown = max(2 * self.capacity, 1)
            if self.max_pages is not None:
                grown = min(grown, self.max_pages)
            self._free.extend(range(grown - 1, self.capacity - 1, -1))
            self.capacity = grown
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def _give_back_taken(self) -> None:
        for s, index, page, replaced in reversed(self._taken):
            table = self._tables[s]
            if replaced is None:
                del table[index]
            else:
                table[index] = replaced
                self._refs[replaced] += 1
            del self._refs[page]
            self._free.append(page)
        self._free.sort(reverse=True)
        self._taken = []

    def _end(self, step: PagedStep, *, advance: bool) -> None:
        if advance:
            for s, c in zip(step.sequences, step.counts, strict=True):
                self._lengths[s] += c
            self._taken = []
        else:
            self._give_back_taken()
        self._step = None

    def pages_for(self, tokens: int) -> int:
        """The pages a sequence of ``tokens`` tokens holds: ⌈tokens / page_size⌉."""
        return math.ceil(arguments.nonnegative_int(tokens, "tokens") / self.page_size)
