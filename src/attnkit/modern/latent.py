"""Multi-head latent attention, MLA (DeepSeek-AI, "DeepSeek-V2", 2024, Sec. 2.1; used again in
DeepSeek-V3): keys and values are compressed jointly into a small latent vector per token, and
only that latent (with one small shared rotary key) is cached for decoding.

For the hidden state h_t (E) of token t, H heads of d_h key features, d_h^R rotary features and
d_v value features (DeepSeek-V2 eqs. 9-11, 14-19):

    c_t^KV = RMSNorm(W^DKV h_t)                  (d_c: the joint KV compression, eq. 9)
    k_t^C  = W^UK c_t^KV,  v_t^C = W^UV c_t^KV     (H·d_h and H·d_v, eqs. 10-11)
    k_t^R  = RoPE(W^KR h_t)                       (d_h^R: one key shared by all heads, eq. 15)
    c_t^Q  = RMSNorm(W^DQ h_t),  q_t^C = W^UQ c_t^Q,  q_t^R = RoPE(W^QR c_t^Q)   (eqs. 12-14)
        (without query compression q_t^C and q_t^R are projected from h_t directly)
    q_{t,i} = [q_{t,i}^C ; q_{t,i}^R],  k_{t,i} = [k_{t,i}^C ; k_t^R]            (eqs. 16-17)
    o_{t,i} = Σ_{j≤t} softmax_j(q_{t,i}ᵀ k_{j,i} / √(d_h + d_h^R)) v_{j,i}^C      (eq. 18)
    u_t = W^O [o_{t,1}; …; o_{t,H}]                                                (eq. 19)

The RMSNorms after the down-projections are those of the released models (not in the paper's
equations); W^DKV and W^KR are stored as one matrix (``w_dkv``, d_c + d_h^R rows) and W^UK, W^UV
as one (``w_ukv``, per head d_h then d_v rows), as the released checkpoints do. RoPE acts on
feature pairs (2i, 2i+1) (DeepSeek's interleaved layout; :func:`attnkit.positions.rope.rotate`).

Decoding caches only c_t^KV and k_t^R (:class:`LatentCache`): d_c + d_h^R numbers per token and
layer, against 2·H·d_h for multi-head attention (DeepSeek-V2 Table 1;
:func:`cache_bytes_per_token`). The keys and values need not be expanded from the cache either:
since

    q_{t,i}^Cᵀ k_{j,i}^C = (W_i^UKᵀ q_{t,i}^C)ᵀ c_j^KV,
    W^O_i v_{j,i}^C = (W^O_i W_i^UV) c_j^KV,

W^UK is absorbed into the query and W^UV into the output (DeepSeek-V2 Sec. 2.1.2), and every
head attends over the latents themselves: ``forward(..., absorbed=True)``, the same result as
the expanded form (``absorbed=False``) in exact arithmetic.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.core import Attention, AttentionOutput
from attnkit.kv_cache import _Owned
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.positions.rope import rotate
from attnkit.positions.rope_scaling import _cos_sin, _rotate, inverse_frequencies
from attnkit.scores.multiplicative import FixedScaleDot

__all__ = [
    "LatentCache",
    "LatentOutput",
    "MultiHeadLatentAttention",
    "cache_bytes_per_token",
]


class LatentOutput(NamedTuple):
    """What :class:`MultiHeadLatentAttention` returns.

    Attributes:
        output: (B, …, L, E), u_t of eq. 19.
        weights: (B, …, H, L, N) per-head weights, only with ``need_weights=True``.
    """

    output: Tensor
    weights: Tensor | None = None

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {} if self.weights is None else {"weights": self.weights}


class LatentCache(_Owned):
    """The decoding cache of one MLA layer: the latents c^KV (B, …, N, d_c) and the rotary keys
    k^R (B, …, N, d_h^R), the latter already rotated at their positions (a token's rotary key
    does not change once made). Grown by :meth:`append`; it belongs to the layer that uses it
    first."""

    def __init__(self) -> None:
        self.latent: Tensor | None = None
        self.rope_key: Tensor | None = None

    def __len__(self) -> int:
        """N, the number of cached positions."""
        return 0 if self.latent is None else self.latent.shape[-2]

    def append(self, latent: Tensor, rope_key: Tensor) -> tuple[Tensor, Tensor]:
        """Add the latents (…, M, d_c) and rotary keys (…, M, d_h^R) of M new positions; return
        all of them, cached ones first."""
        if self.latent is None or self.rope_key is None:
            self.latent, self.rope_key = latent, rope_key
            return latent, rope_key
        for name, new, old in (
            ("latent", latent, self.latent),
            ("rope_key", rope_key, self.rope_key),
        ):
            if new.shape[:-2] != old.shape[:-2] or new.shape[-1] != old.shape[-1]:
                raise ValueError(
                    f"LatentCache: new {name} of shape {tuple(new.shape)} does not extend the "
                    f"cached one of shape {tuple(old.shape)} (same dims except the length N)"
                )
        self.latent = torch.cat([self.latent, latent], dim=-2)
        self.rope_key = torch.cat([self.rope_key, rope_key], dim=-2)
        return self.latent, self.rope_key

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached latents and rotary keys."""
        return sum(
            t.numel() * t.element_size() for t in (self.latent, self.rope_key) if t is not None
        )


# Positions below which the angles are read from a table shared by the layers of one rotary
# size, base, dtype and device (beyond: formed per call).
_TABLE_LIMIT = 1 << 16
_ANGLE_TABLES: dict[tuple, tuple[Tensor, Tensor]] = {}


def _angles(
    rope_dim: int, base: float, offset: int, length: int, like: Tensor
) -> tuple[Tensor, Tensor]:
    """cos(p·θ_i) and sin(p·θ_i) (L, rope_dim/2), θ_i = base^{−2i/rope_dim}, in ``like``'s
    dtype and on its device, for the positions p = offset … offset + L − 1, formed as
    :func:`attnkit.positions.rope.rotate` forms them (in float64, then rounded). Below
    ``_TABLE_LIMIT`` they are rows of a table made once for the positions below a power of two
    (so a decoding step forms no angle) and remade larger when a later position is asked for."""
    end = offset + length
    if end <= _TABLE_LIMIT:
        key = (rope_dim, base, like.dtype, like.device)
        table = _ANGLE_TABLES.get(key)
        if table is None or table[0].shape[0] < end:
            size = max(64, 1 << (end - 1).bit_length())
            theta = inverse_frequencies(rope_dim, base).to(like.device)
            positions = torch.arange(size, device=like.device)
            table = _ANGLE_TABLES[key] = _cos_sin(positions, theta, 1.0, like.dtype)
        return table[0][offset:end], table[1][offset:end]
    theta = inverse_frequencies(rope_dim, base).to(like.device)
    positions = torch.arange(offset, end, device=like.device)
    return _cos_sin(positions, theta, 1.0, like.dtype)


def _gather_rows(x: Tensor, rows: Tensor) -> Tensor:
    """x (…, N, d) at the positions ``rows`` (…, T) -> (…, T, d)."""
    return x.gather(-2, rows.unsqueeze(-1).expand(*rows.shape, x.shape[-1]))


def cache_bytes_per_token(
    *,
    num_heads: int,
    head_dim: int,
    kv_rank: int,
    rope_dim: int,
    num_kv_heads: int | None = None,
    layers: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, int]:
    """Bytes of KV cache per token (DeepSeek-V2 Table 1), for ``layers`` layers in ``dtype``.

    - ``"mha"``: 2·H·d_h (a key and a value per head);
    - ``"gqa"``: 2·H_kv·d_h with ``num_kv_heads`` groups (default H/4 or 1);
    - ``"mqa"``: 2·d_h (one key and value shared by all heads);
    - ``"mla"``: d_c + d_h^R (the latent and the shared rotary key).

    Args:
        num_heads: H; head_dim: d_h; kv_rank: d_c; rope_dim: d_h^R; num_kv_heads: H_kv.
    """
    h = arguments.positive_int(num_heads, "num_heads")
    d = arguments.positive_int(head_dim, "head_dim")
    rank = arguments.positive_int(kv_rank, "kv_rank")
    rope = arguments.nonnegative_int(rope_dim, "rope_dim")
    groups = max(h // 4, 1) if num_kv_heads is None else num_kv_heads
    groups = arguments.positive_int(groups, "num_kv_heads")
    if h % groups:
        raise ValueError(f"num_kv_heads = {groups} does not divide num_heads = {h}")
    size = torch.empty((), dtype=dtype).element_size() * arguments.positive_int(layers, "layers")
    elements = {"mha": 2 * h * d, "gqa": 2 * groups * d, "mqa": 2 * d, "mla": rank + rope}
    return {name: n * size for name, n in elements.items()}


@REGISTRY.register("latent")
class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 Sec. 2.1), a whole layer: it owns its
    projections, takes hidden states x (B, …, L, E) and returns u (B, …, L, E).

    Args:
        embed_dim: E.
        num_heads: H.
        kv_rank: d_c, the size of the joint key-value latent.
        head_dim: d_h, each head's non-rotary query/key size (default E / H).
        rope_dim: d_h^R, the rotary part of the queries and of the shared key (default d_h / 2;
            even; 0 for none).
        v_head_dim: d_v, each head's value size (default d_h).
        q_rank: d_c', the size of the query latent (None: queries projected from x directly).
        bias: biases in the down-projections and the output projection (as the released
            models' ``attention_bias``).
        rope_base: RoPE's base (θ_i = base^{−2i/d_h^R}).
        rotary: rotate q^R and k^R (False: the d_h^R features are kept as they are, a
            position-free MLA whose k^R is still one key shared by all heads, as Kimi Linear's
            full-attention layers).
        eps: ε of the RMSNorms.
        device, dtype: of the parameters.

    ``mask`` (…, L, N) or (…, 1, N), True = may attend, applies to all heads; a decoder passes
    ``masks.causal(L, N)``. The tokens sit at positions ``len(cache)`` … ``len(cache) + L − 1``.
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("x",)}

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        kv_rank: int,
        *,
        head_dim: int | None = None,
        rope_dim: int | None = None,
        v_head_dim: int | None = None,
        q_rank: int | None = None,
        bias: bool = False,
        rope_base: float = 10000.0,
        rotary: bool = True,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embed_dim = arguments.positive_int(embed_dim, "embed_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.kv_rank = arguments.positive_int(kv_rank, "kv_rank")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim = {embed_dim} is not divisible by num_heads = {num_heads} "
                    "(give head_dim=)"
                )
            head_dim = embed_dim // num_heads
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        rope = max(2 * (self.head_dim // 4), 2) if rope_dim is None else rope_dim
        self.rope_dim = arguments.nonnegative_int(rope, "rope_dim")
        if self.rope_dim % 2:
            raise ValueError(f"rope_dim must be even (RoPE rotates pairs), got {rope_dim}")
        self.v_head_dim = arguments.positive_int(
            self.head_dim if v_head_dim is None else v_head_dim, "v_head_dim"
        )
        self.q_rank = arguments.optional_positive_int(q_rank, "q_rank")
        arguments.boolean(bias, "bias")
        self.rope_base = float(rope_base)
        if not self.rope_base > 1:
            raise ValueError(f"rope_base must be > 1, got {rope_base!r}")
        self.rotary = arguments.boolean(rotary, "rotary")
        kw = {"device": device, "dtype": dtype}
        h, dq = self.num_heads, self.head_dim + self.rope_dim
        if self.q_rank is None:
            self.w_q = nn.Linear(embed_dim, h * dq, bias=False, **kw)
        else:
            self.w_dq = nn.Linear(embed_dim, self.q_rank, bias=bias, **kw)
            self.q_norm = nn.RMSNorm(self.q_rank, eps=eps, **kw)
            self.w_uq = nn.Linear(self.q_rank, h * dq, bias=False, **kw)
        self.w_dkv = nn.Linear(embed_dim, self.kv_rank + self.rope_dim, bias=bias, **kw)
        self.kv_norm = nn.RMSNorm(self.kv_rank, eps=eps, **kw)
        self.w_ukv = nn.Linear(
            self.kv_rank, h * (self.head_dim + self.v_head_dim), bias=False, **kw
        )
        self.w_o = nn.Linear(h * self.v_head_dim, embed_dim, bias=bias, **kw)
        self.attention = Attention(FixedScaleDot(1 / math.sqrt(dq)), Softmax())

    @classmethod
    def example(cls):
        x = example_tensor(2, 7, 16, seed=41)
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)
        module = cls(16, 2, kv_rank=6, head_dim=4, rope_dim=2, v_head_dim=3, q_rank=5, bias=True)
        return module, (x,), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HEAD, tx.Scoring.SCALED_MULTIPLICATIVE]

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, kv_rank={self.kv_rank}, "
            f"head_dim={self.head_dim}, rope_dim={self.rope_dim}, v_head_dim={self.v_head_dim}, "
            f"q_rank={self.q_rank}" + ("" if self.rotary else ", rotary=False")
        )

    def _queries(
        self,
        x: Tensor,
        positions: Tensor | None,
        *,
        q_latent: Tensor | None = None,
        cos_sin: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """q^C (…, H, L, d_h) and rotated q^R (…, H, L, d_h^R) (eqs. 12-14), at ``positions``
        (L,) or by the angles ``cos_sin`` of :meth:`_angles`; ``q_latent``: c^Q when already
        formed."""
        q_c, q_r = self._projected(x, q_latent).split((self.head_dim, self.rope_dim), dim=-1)
        if not self.rotary:
            return q_c, q_r
        if cos_sin is None:
            return q_c, rotate(q_r, positions, self.rope_base)
        return q_c, _rotate(q_r, *cos_sin, "interleaved")

    def _projected(self, x: Tensor, q_latent: Tensor | None) -> Tensor:
        """[q^C ; q^R] (…, H, L, d_h + d_h^R), q^R not rotated."""
        if self.q_rank is None:
            q = self.w_q(x)
        else:
            q = self.w_uq(self.q_norm(self.w_dq(x)) if q_latent is None else q_latent)
        return q.unflatten(-1, (self.num_heads, -1)).transpose(-2, -3)

    def _angles(self, offset: int, length: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """cos(p·θ_i) and sin(p·θ_i) (L, d_h^R/2) in ``like``'s dtype and on its device for
        the positions p = offset … offset + L − 1 (:func:`_angles`)."""
        return _angles(self.rope_dim, self.rope_base, offset, length, like)

    def latents(
        self, x: Tensor, offset: int = 0, *, cos_sin: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """c^KV (…, L, d_c) and the rotated shared key k^R (…, L, d_h^R) of tokens x (…, L, E)
        at positions ``offset`` … (eqs. 9 and 15): what :class:`LatentCache` stores.
        ``cos_sin``: the angles of those positions (:meth:`_angles`), when already formed."""
        c, k_r = self.w_dkv(x).split((self.kv_rank, self.rope_dim), dim=-1)
        if not self.rotary:
            return self.kv_norm(c), k_r
        if cos_sin is None:
            cos_sin = self._angles(offset, x.shape[-2], x)
        return self.kv_norm(c), _rotate(k_r, *cos_sin, "interleaved")

    def _attention(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, need_weights: bool
    ) -> AttentionOutput:
        """The part's call on q, k, v this layer formed (their sizes agree by construction):
        by the part's direct entry (:meth:`attnkit.Attention.direct`) when it is the plain
        part and no weights are asked for, else by its :meth:`~attnkit.Attention.forward`."""
        part = self.attention
        if (
            not need_weights
            and type(part).forward is Attention.forward
            and type(part).direct is Attention.direct
        ):
            out = part.direct(q, k, v, mask=mask, bias=None)
            if out is not None:
                return out
        return part(q, k, v, mask=mask, need_weights=need_weights)

    def up_projections(self) -> tuple[Tensor, Tensor]:
        """W^UK (H, d_h, d_c) and W^UV (H, d_v, d_c), views of ``w_ukv``'s weight."""
        w = self.w_ukv.weight.unflatten(0, (self.num_heads, -1))
        return w.split((self.head_dim, self.v_head_dim), dim=1)

    def forward(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        need_weights: bool = False,
        cache: LatentCache | None = None,
        absorbed: bool = False,
    ) -> LatentOutput:
        """u (…, L, E) for hidden states x (…, L, E).

        Args:
            x: (B, …, L, E).
            mask: boolean (…, L, N) or (…, 1, N), N = cached + L.
            need_weights: return the per-head weights (B, …, H, L, N).
            cache: a :class:`LatentCache`: the new latents are appended, the queries attend over
                every cached position and sit after them.
            absorbed: attend over the latents with W^UK absorbed into the queries and W^UV
                into the output (the decoding form); otherwise keys and values are expanded.
        """
        offset = self._check_call(x, mask, need_weights, cache, absorbed)
        return self._attend(x, mask, need_weights, cache, absorbed, offset)

    def _check_call(
        self,
        x: Tensor,
        mask: Tensor | None,
        need_weights: bool,
        cache: LatentCache | None,
        absorbed: bool,
        cache_type: type = LatentCache,
        cache_name: str = "attnkit.modern.LatentCache",
    ) -> int:
        """Every check of a call at the door, the cache (a ``cache_type``) claimed; returns
        the number of cached positions."""
        if cache is not None and not isinstance(cache, cache_type):
            raise TypeError(f"cache must be an {cache_name} or None, got {type(cache).__name__}")
        checks.tensor(x, "x")
        arguments.boolean(need_weights, "need_weights")
        arguments.boolean(absorbed, "absorbed")
        if x.dim() < 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(
                f"x must be (B, …, L, {self.embed_dim}) for this {type(self).__name__}, got "
                f"shape {tuple(x.shape)}"
            )
        if cache is not None:
            cache.claim(self)
        offset = 0 if cache is None else len(cache)
        length = x.shape[-2]
        masks.check(mask, torch.Size((*x.shape[:-2], length, offset + length)))
        return offset

    def _attend(
        self,
        x: Tensor,
        mask: Tensor | None,
        need_weights: bool,
        cache: LatentCache | None,
        absorbed: bool,
        offset: int,
        *,
        q_latent: Tensor | None = None,
        cos_sin: tuple[Tensor, Tensor] | None = None,
        rows: Tensor | None = None,
    ) -> LatentOutput:
        """:meth:`forward` after its checks; ``q_latent`` (c^Q) and ``cos_sin`` (the angles of
        the positions, :meth:`_angles`) when the caller has formed them; ``rows`` (…, T): the
        only positions the queries read (all queries the same ones), ``mask`` then (…, L, T)
        over them."""
        if self.rotary and cos_sin is None:
            cos_sin = self._angles(offset, x.shape[-2], x)
        if absorbed or self.rotary:
            q_c, q_r = self._queries(x, None, q_latent=q_latent, cos_sin=cos_sin)
        else:  # [q^C ; q^R] as projected
            q_c, q_r = self._projected(x, q_latent), None
        c, k_r = self.latents(x, offset, cos_sin=cos_sin)
        if cache is not None:
            c, k_r = cache.append(c, k_r)
        if rows is not None:
            c, k_r = _gather_rows(c, rows), _gather_rows(k_r, rows)
        mask = None if mask is None else mask.unsqueeze(-3)  # the same for every head
        if absorbed:
            w_uk, w_uv = self.up_projections()
            q = torch.cat([torch.einsum("...hld,hdc->...hlc", q_c, w_uk), q_r], dim=-1)
            k = torch.cat([c, k_r], dim=-1).unsqueeze(-3)  # one latent "head" for all heads
            out = self._attention(q, k, c.unsqueeze(-3), mask, need_weights)
            context = torch.einsum("...hlc,hvc->...hlv", out.context, w_uv)
        else:
            kv = self.w_ukv(c).unflatten(-1, (self.num_heads, -1)).transpose(-2, -3)
            k_c, v = kv.split((self.head_dim, self.v_head_dim), dim=-1)
            k_r = k_r.unsqueeze(-3).expand(*k_c.shape[:-1], self.rope_dim)
            q = q_c if q_r is None else torch.cat([q_c, q_r], dim=-1)
            k = torch.cat([k_c, k_r], dim=-1)
            out = self._attention(q, k, v, mask, need_weights)
            context = out.context
        u = self.w_o(context.transpose(-2, -3).flatten(-2))
        return LatentOutput(u, out.weights if need_weights else None)
