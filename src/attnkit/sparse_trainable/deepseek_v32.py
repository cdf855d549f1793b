"""DeepSeek-V3.2's attention layer as released: multi-head latent attention (DeepSeek-V2 Sec. 2.1,
:class:`attnkit.modern.MultiHeadLatentAttention`) restricted, query by query, to the top-k keys
of a lightning indexer (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp", sec. 2.1, eqs. 1-2).

The indexer of the released layer (transformers' ``DeepseekV32Indexer``) reads the hidden state
h_t and the MLA's normalised query latent c_t^Q, with its own projections:

    q^I_{t,j} = RoPE_half(W^IQ_j c_t^Q)            (H^I heads of d^I; the first d_h^R features
    k^I_s     = RoPE_half(LayerNorm(W^IK h_s))      rotated, pairs (i, i + d_h^R/2))
    w^I_{t,j} = (W^IW h_t)_j / √H^I
    I_{t,s}   = Σ_j w^I_{t,j} · ReLU(q^I_{t,j} · k^I_s / √d^I)                    (eq. 1)

and each query attends with MLA over S_t = Top-k_s(I_{t,s}) among the keys its mask allows
(eq. 2); a query with at most k allowed keys reads all of them. The indexer is not trained by
the layer's output (it runs without autograd, as in transformers), so the gradients are those
of MLA under the selection mask.

How this differs from :class:`attnkit.sparse_trainable.DeepSeekSparseAttention`: that per-head
part's :class:`~attnkit.sparse_trainable.LightningIndexer` reads the head's q and k (a per-head
part never sees h_t), has no LayerNorm, RoPE or 1/√H^I, 1/√d^I scales, and trains itself by the
paper's KL loss; here the indexer is the released one (the paper's FP8 scoring and Hadamard
rotation of q^I and k^I are left out, as in transformers: the rotation preserves the dot
products). The score of eq. 1 is :meth:`LightningIndexer.scores` and the selection is the
partial top-k of :mod:`attnkit.sparse_trainable._select` (ties at the k-th score taken in key
order, where ``torch.topk`` may take any of them).

Decoding caches, per token, MLA's latent and rotary key and the indexer's key d^I
(:class:`SparseLatentCache`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.modern.latent import LatentCache, LatentOutput, MultiHeadLatentAttention
from attnkit.positions.rope_scaling import _cos_sin, _rotate, inverse_frequencies
from attnkit.sparse_trainable._select import top_set
from attnkit.sparse_trainable.dsa import LightningIndexer

__all__ = ["LatentIndexer", "SparseLatentAttention", "SparseLatentCache"]


class SparseLatentCache(LatentCache):
    """The decoding cache of one :class:`SparseLatentAttention`: MLA's latents and rotary keys
    (:class:`~attnkit.modern.LatentCache`) and the indexer's keys k^I (B, …, N, d^I)."""

    def __init__(self) -> None:
        super().__init__()
        self.index_key: Tensor | None = None

    def append_index_key(self, key: Tensor) -> Tensor:
        """Add the indexer keys (…, M, d^I) of M new positions; return all of them."""
        if self.index_key is None:
            self.index_key = key
        else:
            if (
                key.shape[:-2] != self.index_key.shape[:-2]
                or key.shape[-1] != self.index_key.shape[-1]
            ):
                raise ValueError(
                    f"SparseLatentCache: new index keys of shape {tuple(key.shape)} do not extend "
                    f"the cached ones of shape {tuple(self.index_key.shape)}"
                )
            self.index_key = torch.cat([self.index_key, key], dim=-2)
        return self.index_key

    @property
    def nbytes(self) -> int:
        extra = (
            0 if self.index_key is None else self.index_key.numel() * self.index_key.element_size()
        )
        return super().nbytes + extra


class LatentIndexer(nn.Module):
    """The released V3.2 lightning indexer (eq. 1 with the projections above).

    Args:
        embed_dim: E, the hidden size (keys and head weights are read from h).
        q_rank: d_c', the size of the query latent c^Q the queries are read from.
        num_heads: H^I.
        head_dim: d^I.
        rope_dim: d_h^R, the rotated leading features of q^I and k^I (even, ≤ d^I).
        topk: k, the keys kept per query.
        rope_base: RoPE's base.
        eps: ε of the key LayerNorm.
    """

    def __init__(
        self,
        embed_dim: int,
        q_rank: int,
        num_heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
        *,
        rope_base: float = 10000.0,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.q_rank = arguments.positive_int(q_rank, "q_rank")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.rope_dim = arguments.nonnegative_int(rope_dim, "rope_dim")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(
                f"rope_dim must be even and at most head_dim = {head_dim}, got {rope_dim}"
            )
        self.topk = arguments.positive_int(topk, "topk")
        self.rope_base = float(rope_base)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.w_q = nn.Linear(q_rank, num_heads * head_dim, bias=False, **kw)
        self.w_k = nn.Linear(embed_dim, head_dim, bias=False, **kw)
        self.k_norm = nn.LayerNorm(head_dim, eps=eps, **kw)
        self.w_weights = nn.Linear(embed_dim, num_heads, bias=False, **kw)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, rope_dim={self.rope_dim}, "
            f"topk={self.topk}"
        )

    def _angles(self, offset: int, length: int, like: Tensor) -> tuple[Tensor, Tensor]:
        positions = torch.arange(offset, offset + length, device=like.device)
        theta = inverse_frequencies(self.rope_dim, self.rope_base).to(like.device)
        return _cos_sin(positions, theta, 1.0, like.dtype)

    def keys(
        self, x: Tensor, offset: int = 0, *, cos_sin: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """k^I (…, L, d^I) of tokens x (…, L, E) at positions ``offset`` … (``cos_sin``: the
        cosines and sines (L, d_h^R/2) of those positions' angles, when already formed)."""
        if cos_sin is None:
            cos_sin = self._angles(offset, x.shape[-2], x)
        return _rotate(self.k_norm(self.w_k(x)), *cos_sin, "halves")

    def scores(
        self,
        x: Tensor,
        q_latent: Tensor,
        keys: Tensor,
        offset: int = 0,
        *,
        cos_sin: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """I (…, L, N) (eq. 1) for queries with hidden states x (…, L, E) and query latents
        c^Q (…, L, d_c') at positions ``offset`` …, over the keys k^I (…, N, d^I)
        (``cos_sin`` as for :meth:`keys`)."""
        if cos_sin is None:
            cos_sin = self._angles(offset, x.shape[-2], x)
        q = self.w_q(q_latent).unflatten(-1, (self.num_heads, self.head_dim))
        q = _rotate(q.transpose(-2, -3), *cos_sin, "halves").transpose(-2, -3)  # (…, L, H^I, d^I)
        scale = 1 / math.sqrt(self.head_dim)
        w = self.w_weights(x) * (scale / math.sqrt(self.num_heads))  # ReLU(s·a) = s·ReLU(a)
        return LightningIndexer.scores(q, w, keys)

    def top(self, scores: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Each query's top-k keys among those ``mask`` (broadcastable, True = allowed)
        allows: their indices (…, L, min(k, N)) in any order, and whether each is allowed
        (False where a row has fewer than k allowed keys)."""
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        index, values = top_set(scores, self.topk)
        return index, values > float("-inf")

    def select(self, scores: Tensor, mask: Tensor | None) -> Tensor:
        """The selection (…, L, N), True at each query's top-k keys among those ``mask``
        (broadcastable, True = allowed) allows."""
        index, available = self.top(scores, mask)
        chosen = torch.zeros_like(scores, dtype=torch.bool)
        return chosen.scatter(-1, index, available)


class SparseLatentAttention(MultiHeadLatentAttention):
    """DeepSeek-V3.2's attention: MLA over each query's top-k keys of :class:`LatentIndexer`.

    Takes :class:`MultiHeadLatentAttention`'s arguments (``q_rank`` required: the indexer reads
    the query latent) and the indexer's:

    Args:
        index_heads: H^I.
        index_head_dim: d^I.
        index_topk: k.

    ``forward`` is MLA's (mask, ``cache`` a :class:`SparseLatentCache`, ``absorbed``), with
    the mask narrowed to the selected keys; ``need_weights`` gives weights that are 0 off the
    selection.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kv_rank: int,
        *,
        q_rank: int,
        index_heads: int,
        index_head_dim: int,
        index_topk: int,
        **kwargs: Any,
    ) -> None:
        if q_rank is None:
            raise ValueError("q_rank must be given: the indexer reads the query latent c^Q")
        super().__init__(embed_dim, num_heads, kv_rank, q_rank=q_rank, **kwargs)
        self.indexer = LatentIndexer(
            embed_dim,
            q_rank,
            index_heads,
            index_head_dim,
            self.rope_dim,
            index_topk,
            rope_base=self.rope_base,
            device=kwargs.get("device"),
            dtype=kwargs.get("dtype"),
        )

    @classmethod
    def example(cls):
        module, args, kwargs = MultiHeadLatentAttention.example()
        del module
        layer = cls(16, 2, 6, head_dim=4, rope_dim=2, v_head_dim=3, q_rank=5, bias=True,
                    index_heads=3, index_head_dim=4, index_topk=3)  # fmt: skip
        return layer, args, kwargs

    @classmethod
    def from_transformers(cls, module: nn.Module) -> SparseLatentAttention:
        """The layer of transformers' ``DeepseekV32Attention`` ``module``, weights copied (same
        dtype and device). Its RoPE must be the default one (YaRN's scalings are refused)."""
        cfg = getattr(module, "config", None)
        if cfg is None or not hasattr(module, "indexer"):
            raise TypeError(
                f"module must be a transformers DeepseekV32Attention, got {type(module).__name__}"
            )
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"module's rope_parameters['rope_type'] is {rope.get('rope_type')!r}; only "
                "'default' RoPE can be copied"
            )
        weight = module.o_proj.weight
        layer = cls(
            cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank,
            head_dim=cfg.qk_nope_head_dim, rope_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, q_rank=cfg.q_lora_rank, bias=bool(cfg.attention_bias),
            rope_base=float(rope.get("rope_theta", 10000.0)),
            eps=module.kv_a_layernorm.variance_epsilon,
            index_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
            index_topk=cfg.index_topk, device=weight.device, dtype=weight.dtype,
        )  # fmt: skip
        layer.indexer.k_norm.eps = module.indexer.k_norm.eps
        names = {
            "q_a_proj": "w_dq", "q_a_layernorm": "q_norm", "q_b_proj": "w_uq",
            "kv_a_proj_with_mqa": "w_dkv", "kv_a_layernorm": "kv_norm", "kv_b_proj": "w_ukv",
            "o_proj": "w_o", "indexer.wq_b": "indexer.w_q", "indexer.wk": "indexer.w_k",
            "indexer.k_norm": "indexer.k_norm", "indexer.weights_proj": "indexer.w_weights",
        }  # fmt: skip
        state = {}
        for key, value in module.state_dict().items():
            prefix, _, leaf = key.rpartition(".")
            if prefix not in names:
                raise ValueError(f"module has a parameter {key!r} this layer does not know")
            state[f"{names[prefix]}.{leaf}"] = value
        layer.load_state_dict(state)
        return layer

    def selection(
        self, x: Tensor, mask: Tensor | None = None, cache: SparseLatentCache | None = None
    ) -> Tensor:
        """The keys each query of x (…, L, E) reads, (…, L, N) bool; with a cache, the new
        indexer keys are appended to it. Computed without autograd."""
        offset = 0 if cache is None else len(cache)
        cos_sin = self._angles(offset, x.shape[-2], x)
        with torch.no_grad():
            keys = self._index_keys(x, cache, offset, cos_sin)
            q_latent = self.q_norm(self.w_dq(x))
            scores = self.indexer.scores(x, q_latent, keys, offset, cos_sin=cos_sin)
            return self.indexer.select(scores, mask)

    def _index_keys(
        self,
        x: Tensor,
        cache: SparseLatentCache | None,
        offset: int,
        cos_sin: tuple[Tensor, Tensor],
    ) -> Tensor:
        """The indexer keys of every position: x's (appended to the cache) after the cached."""
        keys = self.indexer.keys(x, offset, cos_sin=cos_sin)
        return keys if cache is None else cache.append_index_key(keys)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        need_weights: bool = False,
        cache: LatentCache | None = None,
        absorbed: bool = False,
    ) -> LatentOutput:
        """MLA's forward (:meth:`MultiHeadLatentAttention.forward`) with ``mask`` narrowed to
        :meth:`selection`. The query latent c^Q and the angles of the positions are formed
        once for MLA and the indexer; with N ≤ k keys every query reads all those its mask
        allows, so the indexer's keys are made (for the cache) but no score is. A single query
        (a decoding step) without weights attends over its k keys gathered from the cache, with
        no mask over all N."""
        offset = self._check_call(
            x, mask, need_weights, cache, absorbed,
            SparseLatentCache, "attnkit.sparse_trainable.SparseLatentCache",
        )  # fmt: skip
        length = x.shape[-2]
        cos_sin = self._angles(offset, length, x)
        q_latent = self.q_norm(self.w_dq(x))
        rows = None
        with torch.no_grad():
            keys = self._index_keys(x, cache, offset, cos_sin)
            if keys.shape[-2] > self.indexer.topk:
                scores = self.indexer.scores(x, q_latent, keys, offset, cos_sin=cos_sin)
                if length == 1 and not need_weights:  # one query: attend its keys alone
                    index, available = self.indexer.top(scores, mask)
                    rows = index.squeeze(-2)
                    mask = None if bool(available.all()) else available
                else:
                    mask = self.indexer.select(scores, mask)
        return self._attend(
            x, mask, need_weights, cache, absorbed, offset, q_latent=q_latent,
            cos_sin=cos_sin, rows=rows,
        )  # fmt: skip
