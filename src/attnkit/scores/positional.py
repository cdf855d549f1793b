"""Score functions that look at positions or neighbourhoods rather than single keys:
location-based (Luong; Galassi IV-B) and convolution-based (Galassi IV-B, Table IV)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments
from attnkit import taxonomy as tx
from attnkit.layers import HeadwiseLinear, resolve_activation
from attnkit.scores.base import REGISTRY, Score, expect_features

__all__ = ["Convolutional", "Location"]


@REGISTRY.register("location")
@arguments.renamed(heads="num_heads")
class Location(Score):
    """Location-based score (Luong): e = W_a q + b over positions, independent of key content.

    W_a ∈ R^{max_len×d_q}: the score of position l is row l of W_a applied to q. Key sequences
    longer than ``max_len`` are rejected.
    """

    scoring = tx.Scoring.LOCATION
    content_based: ClassVar[bool] = False

    def __init__(
        self,
        d_q: int,
        max_len: int,
        *,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_q = arguments.positive_int(d_q, "d_q")
        self.max_len = arguments.positive_int(max_len, "max_len")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        self.W_a = HeadwiseLinear(
            d_q, max_len, num_heads=num_heads, bias=True, device=device, dtype=dtype
        )

    # for_heads: d_q = head_dim, a row of W_a per position up to max_len, one W_a per head.
    size_arguments: ClassVar[dict[str, str]] = {
        "d_q": "head_dim", "max_len": "max_len", "num_heads": "num_heads"
    }  # fmt: skip

    @classmethod
    def for_heads(
        cls,
        head_dim: int,
        num_heads: int | None = None,
        *,
        embed_dim: int | None = None,
        max_len: int | None = None,
        **overrides: Any,
    ) -> Location:
        if max_len is None and "max_len" not in overrides:
            raise TypeError(
                "the location score needs max_len, which a multi-head module cannot choose: "
                f"build it, e.g. Location({head_dim}, max_len, num_heads={num_heads}), and pass "
                "the module"
            )
        return super().for_heads(
            head_dim, num_heads, embed_dim=embed_dim, max_len=max_len, **overrides
        )

    def check(self, q: Tensor | None, k: Tensor) -> None:
        assert q is not None
        expect_features(q, self.d_q, "q", "d_q")
        if k.shape[-2] > self.max_len:
            raise ValueError(
                f"k has N = {k.shape[-2]} keys (shape {tuple(k.shape)}) but this location score "
                f"was built for at most max_len = {self.max_len}"
            )

    def project_query(self, q: Tensor | None) -> Tensor | None:
        assert q is not None
        return self.W_a(q)

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        assert qp is not None
        e = qp[..., key_offset : key_offset + kp.shape[-2]]
        lead = torch.broadcast_shapes(e.shape[:-2], kp.shape[:-2])
        return e.expand(*lead, *e.shape[-2:])


@REGISTRY.register("convolutional")
@arguments.renamed(heads="num_heads")
class Convolutional(Score):
    """Convolution-based score (Galassi IV-B): the importance vector is a filter over key
    subsequences. Each window of ``width`` consecutive keys gets the energy
    act(Σ_t w_tᵀ k_{j+t} + b); a key's score is the mean energy of the ``width`` windows that
    contain it (the sequence is zero-padded at both ends). Query-free (self-attentive).

    A key's score reads its ``width - 1`` neighbours on either side (``mixes_keys``), so a mask
    cannot be applied to the scores afterwards: a query would still read, through its allowed
    keys' windows, keys it may not attend. Given the mask (``keep``), the score is evaluated per
    query row with the keys that row may not attend replaced by zeros (with ``torch.where``, so
    a NaN in such a key reaches nothing), exactly like the zero padding at the ends. A masked
    key's content therefore has no influence, and under a causal mask row t equals the score of
    the sequence cut after key t (what decoding step t sees). Masking a key in the middle is not
    the same as removing it: the gap keeps its neighbours apart.
    """

    scoring = tx.Scoring.CONVOLUTIONAL
    content_based: ClassVar[bool] = False
    mixes_keys: ClassVar[bool] = True
    query_free = True

    def __init__(
        self,
        d_k: int,
        width: int = 3,
        *,
        activation: str | Callable[[Tensor], Tensor] = "tanh",
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.d_k = arguments.positive_int(d_k, "d_k")
        self.width = arguments.positive_int(width, "width")
        self.num_heads = arguments.optional_positive_int(num_heads, "num_heads")
        self.act = resolve_activation(activation)
        h = 1 if num_heads is None else num_heads
        bound = 1.0 / math.sqrt(d_k * width)
        kw = {"device": device, "dtype": dtype}
        self.filter = nn.Parameter(torch.empty(h, d_k, width, **kw).uniform_(-bound, bound))
        self.b = nn.Parameter(torch.zeros(h, **kw))

    # for_heads: d_k = head_dim, the default width, one filter per head.
    size_arguments: ClassVar[dict[str, str]] = {"d_k": "head_dim", "num_heads": "num_heads"}

    def check(self, q: Tensor | None, k: Tensor) -> None:
        expect_features(k, self.d_k, "k", "d_k")

    def _taps(self, k: Tensor) -> Tensor:
        """P[…, l, t] = w_tᵀ k_l: key l's term in a window where it sits at tap t, (…, N, width)."""
        if self.num_heads is None:
            return torch.einsum("...nc,ct->...nt", k, self.filter[0])
        return torch.einsum("...hnc,hct->...hnt", k, self.filter)

    def _per_key(self, taps: Tensor, rows: bool = False) -> Tensor:
        """Key scores from the taps (…, N, width): the mean activated energy of the windows
        that contain each key, the sequence zero-padded by width - 1 at both ends. ``rows``:
        the taps carry a query-row dim before N (after the head dim)."""
        w, n = self.width, taps.shape[-2]
        padded = F.pad(taps, (0, 0, w - 1, w - 1))  # (…, N + 2(w-1), w)
        # energy of the window starting at key i - (w - 1), for i in [0, N + w - 1)
        energy = sum(padded[..., t : t + n + w - 1, t] for t in range(w))
        bias = self.b[0] if self.num_heads is None else self.b.view(-1, *(1,) * (1 + rows))
        act = self.act(energy + bias)
        return sum(act[..., s : s + n] for s in range(w)) / w  # (…, N)

    def project_key(self, k: Tensor) -> Tensor:
        """Per-key scores, as (…, N, 1) so keys stay along dim -2."""
        return self._per_key(self._taps(k)).unsqueeze(-1)

    def pairwise(self, qp: Tensor | None, kp: Tensor, key_offset: int = 0) -> Tensor:
        return kp.squeeze(-1).unsqueeze(-2)

    def masked(self, q: Tensor | None, k: Tensor, keep: Tensor) -> Tensor:
        """Scores (…, M, N) where row m reads only the keys ``keep[…, m, :]`` allows; the other
        keys count as zeros (their content, even NaN, has no influence)."""
        taps = self._taps(k).unsqueeze(-3)  # (…, 1, N, w)
        zero = torch.zeros((), dtype=taps.dtype, device=taps.device)
        return self._per_key(torch.where(keep.unsqueeze(-1), taps, zero), rows=True)
