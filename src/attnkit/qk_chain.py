"""The ordered chain of transforms a multi-head layer applies to its per-head queries and keys
between the projections and the attention part (``MultiHeadAttention(qk=...)``).

A layer projects q = x W^Q and k = x W^K, splits them into heads and, by default, places them by
its position scheme. Today's models order more steps there: Qwen3, Gemma 3 and OLMo 2 normalise
q and k (QK-norm, Henry et al. 2020; Dehghani et al. 2023 sec. 2.1) and *then* rotate them by
RoPE, so that the norm's gains act on the unrotated features. A chain names the order:

    ak.MultiHeadAttention(E, H, position="rope", qk=[ak.qk_chain.HeadNorm(E // H), "position"])

``"position"`` marks where the layer's position scheme runs (its bias and value term are kept
as without a chain); every other step is a :class:`QKTransform`, ``forward(q, k) -> (q, k)`` on
q (B, …, H, M, d) and k (B, …, H, N, d) — keys after grouped-query sharing, so head h holds key
head h // (H / H_kv). The default chain is ``("position",)``. Steps run per token, so a KV cache
(which keeps keys as projected, before the chain) gives the same keys at every step.

- :class:`HeadNorm`: RMSNorm or LayerNorm over each head's d features, one gain vector (d,)
  for every query head and one for every key head — Qwen3's and Gemma 3's ``q_norm``/``k_norm``.
- :class:`ProjectionNorm`: the norm over the whole projection, the H·d features of q and the
  H_kv·d of k at each position, with gains of those sizes — OLMo 2's ``q_norm``/``k_norm``.
  On the shared keys it is computed exactly: each key head appears H / H_kv times, which leaves
  the mean of squares over the heads unchanged, and its gains are repeated likewise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments

__all__ = ["POSITION", "HeadNorm", "ProjectionNorm", "QKTransform", "check_chain"]

#: The chain's marker for the layer's position scheme.
POSITION = "position"

_KINDS = ("rms", "layer")


class QKTransform(nn.Module):
    """One step of the q/k chain: ``forward(q, k) -> (q, k)`` on per-head q (B, …, H, M, d)
    and k (B, …, H, N, d). A step must act on each position alone (a KV cache re-applies it to
    the cached keys at every step).

    Capabilities (class data, False by default), read by grouped-query layers:

    - ``same_for_every_head``: the step does the same to every head and takes keys with fewer
      heads than the queries; each key/value head is then transformed once, not once per
      query head that reads it.
    - ``keys_alike_in_group``: the keys it gives the query heads that share a key/value head
      are equal (a KV cache of transformed keys then keeps one per key/value head); implied
      by ``same_for_every_head``. Without either, a grouped-query layer keeps the keys
      untransformed in its cache and transforms the cache again at every step."""

    same_for_every_head: ClassVar[bool] = False
    keys_alike_in_group: ClassVar[bool] = False

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError


def _normalise(x: Tensor, kind: str, eps: float, dims: tuple[int, ...]) -> Tensor:
    """x normalised over ``dims`` (no gain): x / RMS(x) for "rms", (x − mean) / std for
    "layer" (biased variance, as torch's norms), computed in at least float32."""
    if kind == "rms" and dims == (-1,) and x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (x.shape[-1],), eps=eps)  # (one fused op, the same formula)
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    if kind == "layer":
        work = work - work.mean(dims, keepdim=True)
    scale = torch.rsqrt(work.pow(2).mean(dims, keepdim=True) + eps)
    return (work * scale).to(x.dtype)


class _Norm(QKTransform):
    """What both norms share: the kind, ε, and a gain (and, for LayerNorm, a bias) for the
    queries and one for the keys, of ``q_size`` and ``k_size`` features."""

    def __init__(
        self, q_size: int, k_size: int, kind: str, eps: float, device: Any, dtype: Any
    ) -> None:
        super().__init__()
        if kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
        self.kind = kind
        self.eps = arguments.finite_float(eps, "eps", positive=True)
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.q_weight = nn.Parameter(torch.ones(q_size, **kw))
        self.k_weight = nn.Parameter(torch.ones(k_size, **kw))
        layer = kind == "layer"
        self.q_bias = nn.Parameter(torch.zeros(q_size, **kw)) if layer else None
        self.k_bias = nn.Parameter(torch.zeros(k_size, **kw)) if layer else None

    def _gain(self, p: Tensor | None) -> Tensor | None:
        """A gain or bias as it multiplies (adds to) the normalised per-head tensor."""
        return p

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        self._check(q, k)
        out = []
        for x, weight, bias in ((q, self.q_weight, self.q_bias), (k, self.k_weight, self.k_bias)):
            y = _normalise(x, self.kind, self.eps, self.dims) * self._gain(weight)
            b = self._gain(bias)
            out.append(y if b is None else y + b)
        return out[0], out[1]

    dims: tuple[int, ...] = (-1,)

    def _check(self, q: Tensor, k: Tensor) -> None:
        raise NotImplementedError


class HeadNorm(_Norm):
    """q̂ = γ_q ⊙ q / RMS(q) and k̂ = γ_k ⊙ k / RMS(k) over each head's d features (RMSNorm;
    LayerNorm with ``kind="layer"`` adds biases β_q, β_k), gains shared by the heads.

    Args:
        head_dim: d.
        kind: ``"rms"`` or ``"layer"``.
        eps: ε added to the mean square (variance).
        device, dtype: of the gains.
    """

    dims = (-1,)
    same_for_every_head = True  # (one gain for every head)

    def __init__(
        self,
        head_dim: int,
        *,
        kind: str = "rms",
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        super().__init__(head_dim, head_dim, kind, eps, device, dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, kind={self.kind!r}, eps={self.eps}"

    def _check(self, q: Tensor, k: Tensor) -> None:
        for name, x in (("q", q), ("k", k)):
            if x.shape[-1] != self.head_dim:
                raise ValueError(
                    f"HeadNorm has gains for heads of {self.head_dim} features, got {name} of "
                    f"shape {tuple(x.shape)}"
                )


class ProjectionNorm(_Norm):
    """q̂ = γ_q ⊙ q / RMS(q) over the H·d features of the whole query projection at each
    position, and k̂ likewise over the H_kv·d of the key projection (OLMo 2); LayerNorm with
    ``kind="layer"``. Gains γ_q (H·d) and γ_k (H_kv·d), laid out head by head as the
    projection's rows.

    Args:
        num_heads, head_dim: H and d of the queries.
        num_kv_heads: H_kv (default H).
        kind, eps, device, dtype: as :class:`HeadNorm`.
    """

    dims = (-3, -1)
    # the norm reads the key heads once each (repeated for their groups) and each key head's
    # gains are repeated for the query heads that share it
    keys_alike_in_group = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        *,
        num_kv_heads: int | None = None,
        kind: str = "rms",
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        num_heads = arguments.positive_int(num_heads, "num_heads")
        head_dim = arguments.positive_int(head_dim, "head_dim")
        kv = arguments.positive_int(num_heads if num_kv_heads is None else num_kv_heads,
                                    "num_kv_heads")  # fmt: skip
        if num_heads % kv:
            raise ValueError(f"num_kv_heads = {kv} does not divide num_heads = {num_heads}")
        size = num_heads * head_dim
        super().__init__(size, kv * head_dim, kind, eps, device, dtype)
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, kv

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"num_kv_heads={self.num_kv_heads}, kind={self.kind!r}, eps={self.eps}"
        )

    def _gain(self, p: Tensor | None) -> Tensor | None:
        """(H_p·d,) -> (H, 1, d) for the heads after sharing: each key head's gains repeated
        for the H / H_kv query heads that read it."""
        if p is None:
            return None
        p = p.view(-1, 1, self.head_dim)
        return p.repeat_interleave(self.num_heads // p.shape[0], dim=0)

    def _check(self, q: Tensor, k: Tensor) -> None:
        h, d = self.num_heads, self.head_dim
        for name, x in (("q", q), ("k", k)):
            if x.dim() < 3 or x.shape[-3] != h or x.shape[-1] != d:
                raise ValueError(
                    f"ProjectionNorm has gains for {h} heads of {d} features, got {name} of "
                    f"shape {tuple(x.shape)} (heads at dim -3)"
                )


def check_chain(chain: object, has_position: bool) -> tuple[QKTransform | str, ...]:
    """The chain as a tuple; raises TypeError for a step that is neither a QKTransform nor
    ``"position"``, and ValueError when ``"position"`` is missing (while the layer has a
    position scheme) or given twice."""
    if chain is None:
        return (POSITION,)
    if isinstance(chain, (str, nn.Module)) or not isinstance(chain, Sequence):
        raise TypeError(
            "qk must be a sequence of steps (attnkit.qk_chain.QKTransform modules and "
            f"'position'), got {type(chain).__name__}"
        )
    steps = tuple(chain)
    for step in steps:
        if not (step == POSITION or isinstance(step, QKTransform)):
            raise TypeError(
                f"a qk step must be an attnkit.qk_chain.QKTransform or {POSITION!r}, got "
                f"{step!r:.80}"
            )
    count = sum(1 for s in steps if isinstance(s, str))
    if count > 1:
        raise ValueError(f"qk names {POSITION!r} {count} times; the scheme runs once")
    if count == 0 and has_position:
        raise ValueError(
            f"qk must say where the position scheme runs: put {POSITION!r} in the chain (e.g. "
            f"qk=[HeadNorm(d), {POSITION!r}] normalises, then rotates)"
        )
    return steps
