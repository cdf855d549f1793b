"""Multi-head attention (Brauwers eqs. 38-40; Vaswani et al.) with any score × alignment."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import (
    arguments,
    call_plan,
    checks,
    hook_points,
    inputs,
    layer_patterns,
    masks,
    qk_chain,
    slots,
)
from attnkit import taxonomy as tx
from attnkit.alignments import Alignment
from attnkit.core import Attention
from attnkit.head import HeadAttention
from attnkit.kernels.block_mask import BlockMask, MaskMod, ScoreMod
from attnkit.kv_cache import LayerCache, MemoryCache, check_positions
from attnkit.output import AttentionOutput
from attnkit.output_gate import GATE_KINDS, OutputGate
from attnkit.positions import PositionScheme
from attnkit.qk_chain import QKTransform
from attnkit.scores import REGISTRY as SCORES
from attnkit.scores import Score

__all__ = ["MultiHeadAttention"]

# A position scheme's term on the values (Shaw et al.'s a^V): weights (…, H, M, N) -> (…, H, M, d).
ValueTerm = Callable[[Tensor], Tensor]


class _NoCache:
    """The cache strategy of a call without a cache: the keys and values are the call's own."""

    offset = 0  # positions before the queries
    decoding = False  # a step after cached positions
    cache: LayerCache | None = None  # what a part that ``takes_cache`` is given

    def bind(self, layer: nn.Module) -> None:
        """Bind the cache to ``layer`` (a cache belongs to the layer that used it first)."""

    def project(
        self, layer: MultiHeadAttention, query: Tensor, key: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The per-head q (…, H, M, d), k and v (…, H_kv, N, d) of this call."""
        return layer._project_heads(query, key, value)

    def extend(self, k: Tensor, v: Tensor, new: int) -> tuple[Tensor, Tensor, int]:
        """The keys and values the queries attend, given this call's ``new`` ones, and the
        position of the first of them."""
        return k, v, 0


class _KVCached(_NoCache):
    """A :class:`attnkit.kv_cache.LayerCache`: the new keys and values are appended and the
    queries sit after the cached positions. A :class:`attnkit.linear_family.RecurrentCache`
    keeps a state instead, which the part reads (``takes_cache``); its keys are the new ones."""

    decoding = True

    def __init__(self, cache: LayerCache) -> None:
        self.cache = cache
        self.offset = len(cache)

    def bind(self, layer: nn.Module) -> None:
        self.cache.claim(layer)

    def extend(self, k: Tensor, v: Tensor, new: int) -> tuple[Tensor, Tensor, int]:
        k, v = self.cache.append(k, v)  # cached before the position scheme (see kv_cache)
        return k, v, self.offset + new - k.shape[-2]


class _MemoryCached(_NoCache):
    """A :class:`attnkit.kv_cache.MemoryCache`: the projections of a fixed memory, made on the
    first call and reused while the caller passes the same ``key`` and ``value`` tensors."""

    def __init__(self, memory: MemoryCache, key: Tensor, value: Tensor) -> None:
        self.memory, self.key, self.value = memory, key, value

    def bind(self, layer: nn.Module) -> None:
        self.memory.claim(layer)

    def project(
        self, layer: MultiHeadAttention, query: Tensor, key: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        memory = self.memory
        if memory.holds(self.key, self.value):
            q = layer._split_heads(layer._project_query(query))
            return q, memory.k, memory.v  # type: ignore[return-value]
        q, k, v = layer._project_heads(query, key, value)
        memory.store(self.key, self.value, k, v)
        return q, k, v


@arguments.renamed(d_model="embed_dim", heads="num_heads")
class MultiHeadAttention(nn.Module):
    """H heads, each attending in its own d = E/H dimensional projection (eqs. 38-40):
    head_h = Attention(Q W_h^Q, K W_h^K, V W_h^V), output = concat(head_1 … head_H) W^O.

    Args:
        embed_dim: E, the query size and output size.
        num_heads: H; must divide E unless ``head_dim`` is given.
        num_kv_heads: H_kv, the number of key/value heads (default H). With H_kv < H, heads
            share keys and values in H_kv groups of H/H_kv consecutive heads (grouped-query
            attention, Ainslie et al. 2023; H_kv = 1 is multi-query attention, Shazeer 2019):
            head h uses key/value head h // (H/H_kv). H_kv must divide H.
        head_dim: d, each head's size (default E/H). Giving it makes the head size independent
            of E and H ("fixed multi-head attention", Bhojanapalli et al. 2020): the heads
            concatenate to H·d and W^O maps H·d back to E.
        score: a score module built for per-head inputs (usually with ``num_heads=num_heads``), or a
            registered name, built by the score's ``for_heads(E/H, H)``: d_q = d_k = d_w = E/H
            and one parameter set per head where the score has parameters (the location score
            needs max_len and is passed as a module).
        align: an alignment module or a registered name of one that can be built from its
            name alone (a learnable temperature, a reinforced or structured alignment, …).
        kdim, vdim: key and value sizes (default E).
        bias: biases in the input and output projections.
        dropout: dropout on the weights in training mode.
        pattern: a sparse attention pattern, a mask function from :mod:`attnkit.patterns`
            (``sliding_window``, ``longformer``, ``bigbird``, ``strided``, ...), the same for
            every batch entry and head. Each call attends through its block mask over (M, N),
            built once per length (:mod:`attnkit.layer_patterns`), so the cost follows the
            pattern's density; with a KV cache the step's rows of the pattern are used.
        score_mod: ``score_mod(e, b, h, q_idx, kv_idx) -> e'`` applied to every call's per-head
            scores (B, H, M, N): h is the head, q_idx counts cached positions when decoding
            (e.g. ALiBi-style biases or soft-capping); an ``nn.Module`` is a submodule.
        kernel: the kernel of the score × alignment part built from ``score``/``align`` (a
            name from :func:`attnkit.kernels.available`; default: chosen per call), for calls
            that do not ask for the weights (:class:`attnkit.Attention`).
        qk: the ordered steps between the per-head projections and the attention part
            (:mod:`attnkit.qk_chain`): transforms of q and k and ``"position"``, where the
            position scheme runs; default ``("position",)``. ``[HeadNorm(d), "position"]``
            normalises q and k, then rotates them (Qwen3, Gemma 3); ``ProjectionNorm`` is
            OLMo 2's norm over the whole projection.
        gate: a sigmoid gate on the concatenated heads before W^O, read from the query tokens
            (gated attention, Qiu et al. 2025; Qwen3-Next): output = (concat(head_1 … head_H)
            ⊙ σ(query W_g + b_g)) W^O. ``"elementwise"`` gates each head's every channel,
            ``"headwise"`` each head by one scalar; an :class:`attnkit.output_gate.OutputGate`
            is used as given; None (default) is no gate.
        device, dtype: where and in which dtype the parameters are made, those of every part
            built from a name (score, alignment, position scheme) included; modules passed in
            are used as they are.

    Inputs are batch first: query (B, M, E), key (B, N, kdim), value (B, N, vdim); any number of
    leading dims works, and an unbatched query (M, E) with key (N, kdim) and value (N, vdim)
    gives an unbatched output. ``mask``/``bias`` follow attnkit's convention (True = may
    attend); a mask with as many dims as the query, e.g. (B, M, N) or (B, 1, N) from
    :func:`attnkit.masks.from_lengths`, applies to all heads; one with an extra dim is
    (B, H, M, N). The weights returned are per head: (B, H, M, N).

    With a dot-product score, softmax and no weights requested, attention runs through
    ``torch.nn.functional.scaled_dot_product_attention``.

    Attributes:
        inputs_finite: the callers state that query, key and value hold no NaN or infinity,
            padding included (a model's own activations, e.g. every layer that
            :class:`attnkit.models.decoder_lm.DecoderLM` builds): the per-head part is told so
            (``finite=True``) and no call looks for non-finite masked keys or clears them.
            False by default: a masked position's content, NaN included, reaches nothing. A
            wrong statement is not caught (NaN padding may then reach the output).
    """

    inputs_finite: bool = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        attention: HeadAttention | None = None,
        position: str | PositionScheme | None = None,
        pattern: MaskMod | None = None,
        score_mod: ScoreMod | None = None,
        qk: Sequence[QKTransform | str] | None = None,
        kernel: str | None = None,
        gate: str | OutputGate | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        # the plans of the kinds of call seen (attnkit.call_plan), dropped on any change
        self._plans: dict[tuple, call_plan.LayerPlan] = {}
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim = {embed_dim} is not divisible by num_heads = {num_heads} "
                    "(give head_dim= for a head size independent of embed_dim)"
                )
            head_dim = embed_dim // num_heads
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.num_kv_heads = arguments.positive_int(kv_heads, "num_kv_heads")
        if num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads = {self.num_kv_heads} does not divide num_heads = {num_heads}"
            )
        self.kdim = embed_dim if kdim is None else arguments.positive_int(kdim, "kdim")
        self.vdim = embed_dim if vdim is None else arguments.positive_int(vdim, "vdim")
        self.dropout = arguments.probability(dropout, "dropout")
        arguments.boolean(bias, "bias")
        kw = {"device": device, "dtype": dtype}
        e = embed_dim
        inner, kv_inner = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self._sizes = (inner, kv_inner, kv_inner)  # rows of W^Q, W^K, W^V
        # One packed matrix (3E × E without grouping or head_dim) when all inputs share E, as
        # torch does: self-attention then projects q, k and v with a single matmul.
        self.packed = self.kdim == e and self.vdim == e
        if self.packed:
            self.in_proj_weight = nn.Parameter(torch.empty(sum(self._sizes), e, **kw))
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(inner, e, **kw))
            self.k_proj_weight = nn.Parameter(torch.empty(kv_inner, self.kdim, **kw))
            self.v_proj_weight = nn.Parameter(torch.empty(kv_inner, self.vdim, **kw))
        self.in_proj_bias = nn.Parameter(torch.empty(sum(self._sizes), **kw)) if bias else None
        self.out_proj = nn.Linear(inner, e, bias=bias, **kw)
        self._reset_parameters()
        if attention is None:
            attention = Attention(
                self._build_score(score, device, dtype),
                checks.resolve_alignment(align, device=device, dtype=dtype),
                dropout=self.dropout,
                kernel=kernel,
            )
        elif kernel is not None:
            raise ValueError(
                "kernel= chooses the kernel of the score x alignment part this layer builds; "
                "with attention= give the part its own kernel (e.g. Attention(..., kernel=name))"
            )
        elif not (isinstance(score, str) and score == "scaled_dot") or not (
            isinstance(align, str) and align == "softmax"
        ):
            raise ValueError(
                "pass either attention= (a whole per-head attention part) or score=/align=, "
                "not both"
            )
        self.attention = slots.attention_part(attention)
        self.position = slots.position_scheme(
            position, head_dim=self.head_dim, num_heads=self.num_heads, **kw
        )
        chain = qk_chain.check_chain(qk, has_position=position is not None)
        # the chain's transforms as submodules (their parameters are the layer's), in order;
        # the position scheme's place in it
        self.qk = nn.ModuleList(s for s in chain if isinstance(s, nn.Module))
        self._position_step = (
            chain.index(qk_chain.POSITION) if qk_chain.POSITION in chain else len(chain)
        )
        for name, given in (("pattern", pattern), ("score_mod", score_mod)):
            if given is not None and not callable(given):
                raise TypeError(f"{name} must be callable or None, got {type(given).__name__}")
        layer_patterns.check_part(
            self.attention,
            block_mask=pattern is not None,
            score_mod=score_mod is not None,
            what="MultiHeadAttention",
        )
        self.pattern = pattern
        self.score_mod = score_mod
        self.gate = self._build_gate(gate, bias, **kw)

    def __setattr__(self, name: str, value: object) -> None:
        if name == "inputs_finite":
            arguments.boolean(value, "MultiHeadAttention.inputs_finite")
        super().__setattr__(name, value)
        plans = self.__dict__.get("_plans")
        if plans:
            plans.clear()  # a plan holds what was resolved from the attributes

    def _apply(self, fn, recurse: bool = True):  # .to(), .double(), .cuda(), ...
        self._plans.clear()
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state["_plans"] = {}  # (a copy resolves its own)
        return state

    @property
    def score(self) -> Score | None:
        """The score of the attention part, when it has one."""
        return getattr(self.attention, "score", None)

    @property
    def align(self) -> Alignment | None:
        """The alignment of the attention part, when it has one."""
        return getattr(self.attention, "align", None)

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HEAD]

    def _build_score(self, score: str | Score, device, dtype) -> Score:
        if not isinstance(score, str):
            return checks.resolve_score(score)
        # Each score says how it is built for H heads of size E/H (no keyword filtering).
        return SCORES.get(score).for_heads(
            self.head_dim, self.num_heads, device=device, dtype=dtype
        )

    def _build_gate(self, gate: str | OutputGate | None, bias: bool, **kw) -> OutputGate | None:
        if gate is None or isinstance(gate, OutputGate):
            if gate is not None and (gate.embed_dim, gate.num_heads, gate.head_dim) != (
                self.embed_dim,
                self.num_heads,
                self.head_dim,
            ):
                raise ValueError(
                    f"gate reads {gate.embed_dim} features and gates {gate.num_heads} heads of "
                    f"{gate.head_dim}; this layer has embed_dim={self.embed_dim}, "
                    f"num_heads={self.num_heads}, head_dim={self.head_dim}"
                )
            return gate
        if not isinstance(gate, str) or gate not in GATE_KINDS:
            raise ValueError(
                f"gate must be one of {', '.join(map(repr, GATE_KINDS))}, an OutputGate or "
                f"None, got {gate!r}"
            )
        return OutputGate(self.embed_dim, self.num_heads, self.head_dim, gate, bias=bias, **kw)

    def _reset_parameters(self) -> None:
        if self.packed:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b = self.in_proj_bias
        if self.packed and key is query and value is query:
            q, k, v = F.linear(query, self.in_proj_weight, b).split(self._sizes, dim=-1)
            return q, k, v
        bq, bk, bv = (None, None, None) if b is None else b.split(self._sizes)
        if self.packed:
            wq, wk, wv = self.in_proj_weight.split(self._sizes)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _project_query(self, query: Tensor) -> Tensor:
        b = self.in_proj_bias
        bq = None if b is None else b.split(self._sizes)[0]
        wq = self.in_proj_weight.split(self._sizes)[0] if self.packed else self.q_proj_weight
        return F.linear(query, wq, bq)

    def _split_heads(self, x: Tensor, heads: int | None = None) -> Tensor:
        """(…, L, heads·d) -> (…, heads, L, d); heads defaults to H."""
        heads = self.num_heads if heads is None else heads
        return x.unflatten(-1, (heads, self.head_dim)).transpose(-2, -3)

    @staticmethod
    def _per_head(x: Tensor | None, query: Tensor) -> Tensor | None:
        if x is None or x.dim() != query.dim():
            return x
        return x.unsqueeze(-3)  # (…, M, N) -> (…, 1, M, N): the same for every head

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        need_weights: bool = False,
        cache: LayerCache | None = None,
        memory_cache: MemoryCache | None = None,
        block_mask: BlockMask | None = None,
        score_mod: ScoreMod | None = None,
    ) -> AttentionOutput:
        """Multi-head attention; key defaults to query and value to key (self-attention).

        Args:
            query: (B, …, M, E); key: (B, …, N, kdim); value: (B, …, N, vdim).
            mask: boolean, True = may attend: (…, M, N) — e.g. (B, 1, N) from
                :func:`attnkit.masks.from_lengths` or (M, N) from :func:`attnkit.masks.causal`
                — the same for every head, or (B, …, H, M, N) per head.
            bias: float, in the inputs' dtype, shaped like ``mask``.
            need_weights: return the per-head weights (B, …, H, M, N) and scores.
            cache: a :class:`attnkit.kv_cache.LayerCache` for incremental decoding. The keys
                and values of this call are appended to it and the queries attend over all
                cached positions, N = cached + new; the queries sit after the cached positions
                (the position scheme gets ``q_offset`` = number cached). ``mask`` and ``bias``
                then cover all N keys, e.g. ``masks.causal(M, N)``. A cache belongs to the
                first layer that uses it (another layer is refused), and only an attention part
                that declares ``decodes_with_cache`` (a step equals its rows of the causal pass)
                takes one.
            memory_cache: a :class:`attnkit.kv_cache.MemoryCache` for attention over a fixed
                memory (a decoder's cross-attention): the key and value projections are made on
                the first call and reused while ``key`` and ``value`` are the same tensors (other
                tensors are refused). Not with ``cache``; it too belongs to one layer.
            block_mask: a :class:`attnkit.kernels.BlockMask` over (M, N) (e.g.
                :func:`attnkit.patterns.block_mask`), combined with ``mask``: the chunked kernel
                skips the tiles it leaves empty. Built without ``batch``/``heads`` it is the same
                for every head; with ``batch=B, num_heads=H`` its b and h are the batch and head.
                Not with ``cache`` (use the constructor's ``pattern``).
            score_mod: ``score_mod(e, b, h, q_idx, kv_idx) -> e'`` on the per-head scores
                (B, H, M, N), after the layer's own ``score_mod``; q_idx counts cached positions.
        """
        key = query if key is None else key
        value = key if value is None else value
        plan = None
        kind = None
        if block_mask is None and score_mod is None and memory_cache is None:
            kind = call_plan.call_kind(
                query, key, value, mask, bias, need_weights, cache, self.training
            )
        if kind is not None:
            plan = self._plans.get(kind)
        if plan is not None and call_plan.fits(
            self, query, key, value, mask, bias, 0 if cache is None else len(cache)
        ):
            # a call of a kind validated before, whose sizes fit: its plan is trusted
            step = _NoCache() if cache is None else _KVCached(cache)
            step.bind(self)
        else:
            step = self._validate(
                query, key, value, mask, bias, need_weights, cache, memory_cache, block_mask,
                score_mod,
            )  # fmt: skip
            if kind is not None and plan is None:
                plan = self._plans[kind] = call_plan.LayerPlan.resolve(self, need_weights)
        if query.dim() == 2:  # unbatched: the per-head parts take (B, …, H, L, d)
            query_b = query.unsqueeze(0)
            key_b = query_b if key is query else key.unsqueeze(0)  # self-attention stays so
            value_b = key_b if value is key else value.unsqueeze(0)
            mask, bias = (None if t is None else t.unsqueeze(0) for t in (mask, bias))
            out = self._attend(
                query_b, key_b, value_b, step, mask, bias, need_weights, block_mask, score_mod
            )
            return out.map(lambda t: t.squeeze(0))
        return self._attend(
            query, key, value, step, mask, bias, need_weights, block_mask, score_mod, plan
        )

    # The steps of a call: validation at the door (once), then — on inputs taken as given — the
    # projections, the cache strategy, the position scheme and the per-head part's call.

    def _validate(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        cache: LayerCache | None,
        memory_cache: MemoryCache | None,
        block_mask: BlockMask | None,
        score_mod: ScoreMod | None,
    ) -> _NoCache:
        """Every check of a call, made once, before anything is computed; returns the call's
        cache strategy, bound to this layer. The steps after it take their inputs as given, and
        the per-head part is told so (``checked=True``, :func:`attnkit.call_plan.part_facts`)."""
        arguments.boolean(need_weights, "need_weights")
        for name, given, kind in (
            ("cache", cache, LayerCache),
            ("memory_cache", memory_cache, MemoryCache),
        ):
            if given is not None and not isinstance(given, kind):
                raise TypeError(
                    f"{name} must be an attnkit.kv_cache.{kind.__name__} or None, got "
                    f"{type(given).__name__}"
                )
        self._check_inputs(query, key, value)
        checks.part_matches(self, "MultiHeadAttention", "query", query)
        cached = 0 if cache is None else len(cache)
        layer_patterns.check_call(
            block_mask, score_mod, query, cached=cached, has_pattern=self.pattern is not None
        )
        layer_patterns.check_part(
            self.attention,
            block_mask=block_mask is not None,
            score_mod=score_mod is not None,
            what="MultiHeadAttention.forward",
        )
        for name, given in (("mask", mask), ("bias", bias)):
            if given is not None and not isinstance(given, Tensor):
                raise masks.not_a_tensor(given, name)
        if mask is not None and mask.dim() > query.dim() + 1:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} has too many dims for query "
                f"{tuple(query.shape)}: use (…, M, N) or (…, H, M, N)"
            )
        if cache is not None:
            self._check_cacheable()
            if memory_cache is not None:
                raise ValueError("pass cache= (self-attention) or memory_cache= (a fixed memory)")
        self._check_mask_and_bias(query, key, mask, bias, cached)
        if cache is not None:
            step: _NoCache = _KVCached(cache)
        elif memory_cache is not None:
            step = _MemoryCached(memory_cache, key, value)
        else:
            step = _NoCache()
        step.bind(self)
        return step

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        """query (…, M, E), key (…, N, kdim) and value (…, N, vdim): tensors of one dtype on one
        device, whose batch dims broadcast."""
        for name, x, d in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            checks.tensor(x, name)
            if x.shape[-1] != d:
                raise ValueError(
                    f"{name} has {x.shape[-1]} features (shape {tuple(x.shape)}) but this "
                    f"MultiHeadAttention expects {d}"
                )
        for name, x in (("key", key), ("value", value)):
            if x.dtype != query.dtype:
                raise TypeError(f"{name} has dtype {x.dtype} but query has {query.dtype}")
            if x.device != query.device:
                raise ValueError(f"{name} is on {x.device} but query is on {query.device}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key of shape {tuple(key.shape)} and value of shape {tuple(value.shape)} must "
                "have the same batch dims and length N"
            )
        try:
            inputs.broadcast_shapes(query.shape[:-2], key.shape[:-2])
        except RuntimeError:
            raise ValueError(
                f"batch dims of query {tuple(query.shape)} and key {tuple(key.shape)} do not "
                "broadcast"
            ) from None

    def _attend(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        step: _NoCache,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        block_mask: BlockMask | None,
        score_mod: ScoreMod | None,
        plan: call_plan.LayerPlan | None = None,
    ) -> AttentionOutput:
        """Eqs. 38-40 on validated, batched inputs: project, extend by the cache, place by the
        position scheme, attend per head, concatenate the heads and project them back; with the
        call's ``plan``, the steps it found to have nothing to do are skipped."""
        q, k, v = step.project(self, query, key, value)
        q, k, v = hook_points.qkv(self, q, k, v)  # named points (attnkit.hooks)
        # a cache that attends over its pages in place (attnkit.paged_cache), unless the call
        # asks for what only the part gives (weights, hooked scores, block masks)
        read = getattr(step.cache, "attend_in_place", None) if step.decoding else None
        plain = not (need_weights or block_mask is not None or score_mod is not None)
        if read is not None and plain and not hook_points._ACTIVE:
            context = read(self, q, k, v, query, mask, bias, step.offset)
            if context is not None:
                return self._merge_heads(AttentionOutput(context), query)
        places = plan is None or plan.places
        # the part's direct route reads grouped keys and values as they are (SDPA's own
        # grouped-query mode), unless a step before it needs them per query head
        grouped = (
            plan is not None
            and plan.direct
            and self.num_kv_heads != self.num_heads
            and query.dim() == 3
            and self.attention.score.num_heads is None
            and (mask is None or mask.dim() <= query.dim())  # (not per head)
        )
        alike = plan is not None and plan.heads_alike  # (each key head placed once)
        if step.decoding and places and self._places_into(step.cache):
            q, k, v, bias, value_term = self._place_then_extend(
                q, k, v, bias, query, step, share=not grouped, alike=alike
            )
        else:
            k, v, k_offset = step.extend(k, v, key.shape[-2])
            per_query_head = places and not alike  # (the chain and scheme read keys per head)
            if per_query_head:
                k, v = self._share_kv_heads(k, v)
                grouped = False
            if places:
                q, k, bias, value_term = self._place(q, k, bias, query, step.offset, k_offset)
            else:
                bias, value_term = self._per_head(bias, query), None
            if not (grouped or per_query_head):
                k, v = self._share_kv_heads(k, v)  # (after placing: each key head placed once)
        if plan is not None and plan.plain_mask:
            mask, sparse = self._per_head(mask, query), {}
        else:
            mask, sparse = self._head_mask(mask, query, key, q, k, step, block_mask, score_mod)
        if plan is not None and plan.direct and value_term is None and not hook_points._ACTIVE:
            out = self.attention.direct(q, k, v, mask=mask, bias=bias, finite=plan.finite)
            if out is not None:
                return self._merge_heads(out, query)
        if grouped:
            k, v = self._share_kv_heads(k, v)
        facts = call_plan.part_facts(self) if plan is None else plan.facts
        out = self._call_part(q, k, v, mask, bias, need_weights, value_term, step, sparse, facts)
        return self._merge_heads(out, query)

    def _places_into(self, cache: LayerCache | None) -> bool:
        """Whether this layer's keys go into ``cache`` placed at their positions: the cache
        declares ``holds_placed_keys`` and the position scheme transforms each token by its own
        position alone, without a bias or a term on the values (the q/k chain's steps act on
        each position alone by their contract); with grouped heads, the query heads of a group
        get equal placed keys (:meth:`_keys_alike_in_group`)."""
        scheme = self.position
        return (
            cache is not None
            and cache.holds_placed_keys
            and scheme.per_token
            and not scheme.reads_total_length
            and not scheme.adds_bias
            and (self.num_kv_heads == self.num_heads or self._keys_alike_in_group())
        )

    def _heads_alike(self) -> bool:
        """Whether the q/k chain's steps and the position scheme do the same to every head."""
        return self.position.same_for_every_head and all(
            step.same_for_every_head for step in self.qk
        )

    def _keys_alike_in_group(self) -> bool:
        """Whether the query heads that share a key/value head get equal placed keys (then one
        per key/value head is cached)."""
        return self.position.same_for_every_head and all(
            step.same_for_every_head or step.keys_alike_in_group for step in self.qk
        )

    def _place_then_extend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        bias: Tensor | None,
        query: Tensor,
        step: _NoCache,
        *,
        share: bool = True,
        alike: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, ValueTerm | None]:
        """The new keys placed at their positions (after ``step.offset`` cached ones), then
        appended to a cache of placed keys: the cached keys are not placed again at every step.
        Placed per query head (as the chain and scheme see them), kept per key/value head; with
        ``alike`` (the chain and scheme do the same to every head) each key head is placed once.
        ``share``: the keys and values returned per query head (else per key/value head)."""
        if alike:
            q, placed, bias, value_term = self._place(q, k, bias, query, step.offset, step.offset)
        else:
            shared_k, _ = self._share_kv_heads(k, k[..., :0, :0])
            q, placed, bias, value_term = self._place(
                q, shared_k, bias, query, step.offset, step.offset
            )
            group = self.num_heads // self.num_kv_heads
            placed = placed if group == 1 else placed[..., ::group, :, :]
        k, v, _ = step.extend(placed, v, k.shape[-2])
        if share:
            k, v = self._share_kv_heads(k, v)
        return q, k, v, bias, value_term

    def _merge_heads(self, out: AttentionOutput, query: Tensor) -> AttentionOutput:
        """Concatenate the heads of the context (…, H, M, d_v), gate them by the query tokens
        (with a ``gate``) and project them back."""
        context = hook_points.emit(self, "context", out.context).transpose(-2, -3).flatten(-2)
        if self.gate is not None:
            context = self.gate(query, context)
        return out._replace(context=hook_points.emit(self, "output", self.out_proj(context)))

    def _project_heads(
        self, query: Tensor, key: Tensor, value: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q (…, H, M, d), k (…, H_kv, N, d), v (…, H_kv, N, d): Q W^Q, K W^K, V W^V by head."""
        if self.packed and key is query and value is query and self.num_kv_heads == self.num_heads:
            # self-attention: the one packed product, its heads split in one step
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)
            qkv = qkv.unflatten(-1, (3, self.num_heads, self.head_dim)).movedim(-3, 0)
            return tuple(qkv.transpose(-2, -3).unbind(0))  # type: ignore[return-value]
        q, k, v = self._project(query, key, value)
        kv_heads = self.num_kv_heads
        return self._split_heads(q), self._split_heads(k, kv_heads), self._split_heads(v, kv_heads)

    def _share_kv_heads(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Grouped-query attention: head h reads key/value head h // (H / H_kv)."""
        if self.num_kv_heads == self.num_heads:
            return k, v
        group = self.num_heads // self.num_kv_heads
        return k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)

    def _place(
        self, q: Tensor, k: Tensor, bias: Tensor | None, query: Tensor, offset: int, k_offset: int
    ) -> tuple[Tensor, Tensor, Tensor | None, ValueTerm | None]:
        """The position scheme on the queries (after ``offset`` earlier positions) and the keys
        (the first at ``k_offset``): q and k as it rewrites them, the caller's bias per head plus
        the scheme's, and the scheme's value term (a function of the weights) if it has one."""
        steps = list(self.qk)
        for step in steps[: self._position_step]:
            q, k = step(q, k)
        positioned = self.position(q, k, q_offset=offset, k_offset=k_offset)
        q, k = positioned.q, positioned.k
        for step in steps[self._position_step :]:
            q, k = step(q, k)
        bias = self._per_head(bias, query)
        if positioned.bias is not None:
            bias = positioned.bias if bias is None else bias + positioned.bias
        return q, k, bias, positioned.values

    def _head_mask(
        self,
        mask: Tensor | None,
        query: Tensor,
        key: Tensor,
        q: Tensor,
        k: Tensor,
        step: _NoCache,
        block_mask: BlockMask | None,
        score_mod: ScoreMod | None,
    ) -> tuple[Tensor | None, dict]:
        """The per-head mask and the ``block_mask`` / ``score_mod`` keywords of the part's call:
        the caller's mask per head, the layer's pattern (its rows when decoding) and the query
        rows of padding cleared for a part whose queries share computation."""
        mask = self._per_head(mask, query)
        mask, sparse = layer_patterns.arguments(
            self.pattern,
            self.score_mod,
            block_mask,
            score_mod,
            mask,
            q.shape[-2],
            k.shape[-2],
            offset=step.offset,
            decoding=step.decoding,
            device=q.device,
        )
        if mask is not None and key is query and self.attention.mixes_queries:
            mask = _pad_queries(mask, query.shape[-2])
        return mask, sparse

    def _call_part(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
        value_term: ValueTerm | None,
        step: _NoCache,
        sparse: dict,
        facts: dict[str, bool],
    ) -> AttentionOutput:
        """The per-head part on q, k, v (B, …, H, L, d), refused first if it does not declare
        what the call needs, told what the layer knows of the call (``facts``,
        :func:`attnkit.call_plan.part_facts`); the position scheme's value term is added to
        its context."""
        part = self.attention
        part.check_supported(
            "MultiHeadAttention.forward", mask=mask, m=q.shape[-2], bias=bias is not None
        )
        kwargs = {
            "mask": mask,
            "bias": bias,
            "need_weights": need_weights or value_term is not None,
            **({"q_offset": step.offset} if part.takes_q_offset else {}),
            **({"cache": step.cache} if part.takes_cache else {}),
            **sparse,
            **facts,
        }
        out = part(q, k, v, **kwargs)
        _check_part_output(out, q, k, v, type(part).__name__)
        out = hook_points.attention(self, out, q, v, mask, self.align, sparse.get("block_mask"))
        if value_term is None:
            return out
        if out.weights is None:
            raise TypeError(
                f"position scheme {type(self.position).__name__} adds a value term from the "
                f"weights, but attention part {type(self.attention).__name__} returned none"
            )
        out = out._replace(context=out.context + value_term(out.weights))
        if not need_weights:
            out = out._replace(weights=None, scores=None)
        return out

    def _check_cacheable(
        self, who: str = "MultiHeadAttention.forward", remedy: str | None = None
    ) -> None:
        """Refuse a KV cache where a step could not equal the whole sequence: an attention part
        decodes with a cache only when it declares so (``decodes_with_cache``: a step whose
        queries attend over all cached keys equals those rows of the causal pass). The error
        starts with ``who`` and ends with ``remedy`` (by default: call without the cache)."""
        part = self.attention
        reason = part.refusal(cache=True)
        remedy = "call without cache=" if remedy is None else remedy
        if reason is not None:
            raise ValueError(f"{who}: {reason}; {remedy}")
        check_positions(self, who, remedy)
        score = getattr(part, "score", None)
        if getattr(score, "mixes_keys", False):
            raise ValueError(
                f"{who}: score {type(score).__name__} mixes neighbouring keys (a key's score "
                "reads the keys around it), so a key's score changes as later keys arrive; "
                f"decoding with a KV cache is not offered for it; {remedy} (a causal mask "
                "passed to the whole sequence is honoured)"
            )
        align = getattr(self.attention, "align", None)
        if getattr(align, "query_position_based", False):
            raise ValueError(
                f"{who}: alignment {type(align).__name__} takes row m of the scores to be the "
                "query at position m, which a decoding step with a KV cache (queries after the "
                f"cached keys) is not; {remedy}"
            )

    def _check_mask_and_bias(
        self,
        query: Tensor,
        key: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        cached: int = 0,
    ) -> None:
        """Check mask and bias against the caller's shapes: (…, M, N), or (…, H, M, N) per
        head, so that an error names the shapes the caller passed; N counts ``cached`` keys."""
        lead = inputs.broadcast_shapes(query.shape[:-2], key.shape[:-2])
        m, n = query.shape[-2], key.shape[-2] + cached
        for name, x in (("mask", mask), ("bias", bias)):
            if x is None:
                continue
            per_head = isinstance(x, Tensor) and x.dim() == query.dim() + 1
            shape = torch.Size((*lead, self.num_heads, m, n) if per_head else (*lead, m, n))
            if name == "mask":
                masks.check(x, shape)
                if x.device != query.device:
                    raise ValueError(f"mask is on {x.device} but query is on {query.device}")
                continue
            x = checks.tensor(x, "bias", min_dim=0)
            if x.dtype != query.dtype:
                raise TypeError(
                    f"bias has dtype {x.dtype} but query has {query.dtype}; pass the bias in "
                    f"the inputs' dtype (bias.to({query.dtype}))"
                )
            if x.device != query.device:
                raise ValueError(f"bias is on {x.device} but query is on {query.device}")
            if not inputs.broadcasts_to(x.shape, shape):
                raise ValueError(
                    f"bias of shape {tuple(x.shape)} does not broadcast to {tuple(shape)} "
                    f"({'(B, …, H, M, N)' if per_head else '(B, …, M, N)'})"
                )

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """Build a MultiHeadAttention with the weights of ``module``, giving the same outputs.

        Our module is always batch first; ``module.batch_first`` only changes how the torch
        module is called. ``add_bias_kv`` and ``add_zero_attn`` are not supported.
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.add_zero_attn:
            raise ValueError("from_torch: add_bias_kv and add_zero_attn are not supported")
        ref = module.out_proj.weight
        ours = cls(
            module.embed_dim,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=module.in_proj_bias is not None,
            dropout=module.dropout,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            if ours.packed:
                ours.in_proj_weight.copy_(module.in_proj_weight)
            else:
                ours.q_proj_weight.copy_(module.q_proj_weight)
                ours.k_proj_weight.copy_(module.k_proj_weight)
                ours.v_proj_weight.copy_(module.v_proj_weight)
            if ours.in_proj_bias is not None:
                ours.in_proj_bias.copy_(module.in_proj_bias)
            ours.out_proj.load_state_dict(module.out_proj.state_dict())
        return ours

    def extra_repr(self) -> str:
        kv = self.num_kv_heads
        grouped = "" if kv == self.num_heads else f"num_kv_heads={kv}, "
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, {grouped}"
            f"head_dim={self.head_dim}, kdim={self.kdim}, vdim={self.vdim}, dropout={self.dropout}"
        )


def _pad_queries(mask: Tensor, m: int) -> Tensor:
    """A self-attention mask (…, M, N) with the query rows of padding cleared: a token that no
    query may attend is padding, as a query too. The M queries are the last M of the N tokens
    (the earlier ones are cached). For attention parts whose queries share computation
    (``mixes_queries``, e.g. landmarks built from all queries), so that padding equals
    truncation also for the real queries' results."""
    real = mask.any(-2, keepdim=True).transpose(-1, -2)  # (…, N, 1)
    return mask & real[..., real.shape[-2] - m :, :]


def _check_part_output(out: object, q: Tensor, k: Tensor, v: Tensor, who: str) -> None:
    """Raise unless a part returned an AttentionOutput whose context is (B, …, H, M, d_v) for
    q (B, …, H, M, d) and v (…, N, d_v): a context of another shape could be merged into the
    wrong heads or positions without an error (a (B, M, H, d_v) context when M = H)."""
    if not isinstance(out, AttentionOutput):
        raise TypeError(
            f"attention part {who} returned {type(out).__name__}, not an attnkit.AttentionOutput"
        )
    lead = inputs.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    want = (*lead, q.shape[-2], v.shape[-1])
    context = out.context
    if not isinstance(context, Tensor) or tuple(context.shape) != want:
        got = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
        raise ValueError(
            f"attention part {who} returned a context of shape {got}; for q {tuple(q.shape)} "
            f"and v {tuple(v.shape)} it must be (B, …, H, M, d_v) = {want}"
        )
