"""Multi-linear attention of the Tensorized Transformer (Ma, Zhang, Zhang, Duan, Hou, Song and
Zhou, "A Tensorized Transformer for Language Modeling", NeurIPS 2019; Soydaner 5.1): multi-head
attention compressed by a block-term tensor decomposition with factor matrices shared across the
blocks.

**Single-block attention (paper eq. 5–6).** With factor matrices Q, K, V ∈ R^{N×R} (the
sequence's queries, keys and values after one projection each) and a core tensor G ∈ R^{R×R×R},
the Tucker product

    Atten_TD(G; Q, K, V) = G •₁ Q •₂ K •₃ V = Σ_i Σ_j Σ_m G_ijm Q_i ∘ K_j ∘ V_m   ∈ R^{N×N×N}

(Q_i the i-th column of Q, ∘ the outer product). The core is diagonal, G_ijm = g_r if
i = j = m = r and 0 otherwise, its diagonal g trainable and normalised by a softmax, so
T[a, b, c] = Σ_r g_r Q_ar K_br V_cr.

**Multi-linear attention (eq. 7).** h blocks share the factor matrices Q = X_q W^q, K = X_k W^k,
V = X_v W^v and differ only in their cores G_1 … G_h:

    MultiLinear(G; Q, K, V) = SplitConcat((1/h)(T_1 + … + T_h)) W^O,
    T_j = Atten_TD(G_j; Q W^q, K W^k, V W^v).

With shared factors the mean of the blocks is one Tucker product with the mean core,
(1/h) Σ_j T_j = Atten_TD(diag((1/h) Σ_j g_j); Q, K, V). SplitConcat splits the N × N × N
tensor along its first (query) mode into N slices of N × N and concatenates each flattened:
row a of the N × N² result is vec(T̄[a]); W^O ∈ R^{N²×d_model} maps it to the model size, so the
layer has a fixed length N (``max_len``): shorter inputs are padded with zero factor rows,
which contribute nothing (padding equals truncation).

**Compression.** The paper's point: one projection of size d_model × R for each of Q, K and V
(R = d_model / h, one head's size) and h·R core entries, instead of the h heads' projections
d_model × d_model each. :func:`parameter_counts` gives both layers' counts at the same size;
W^O here has N²·d_model entries (the SplitConcat width), so the saving holds while N² is
small against d_model · h (e.g. N = 16, d_model = 512, h = 8: 0.22 of multi-head attention's
parameters).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, hooks, masks
from attnkit import taxonomy as tx
from attnkit.alignments import Softmax
from attnkit.mechanisms import REGISTRY, example_tensor

__all__ = [
    "MultiLinearAttention",
    "MultiLinearOutput",
    "ParameterCounts",
    "parameter_counts",
    "single_block_attention",
]


def single_block_attention(core: Tensor, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Atten_TD(G; Q, K, V) with a diagonal core (eq. 5–6): T[a, b, c] = Σ_r g_r Q_ar K_br V_cr.

    Args:
        core: g (…, R), the core's diagonal.
        q, k, v: (…, N, R) factor matrices.

    Returns:
        T (…, N, N, N).
    """
    return torch.einsum("...r,...ar,...br,...cr->...abc", core, q, k, v)


class ParameterCounts(NamedTuple):
    """Parameters of multi-linear attention and of multi-head attention at the same size (both
    with biases), and their ratio."""

    multi_linear: int
    multi_head: int
    ratio: float


def parameter_counts(
    embed_dim: int, num_blocks: int, max_len: int, rank: int | None = None
) -> ParameterCounts:
    """Parameter counts of :class:`MultiLinearAttention` (shared W^q, W^k, W^v of size
    embed_dim × R with biases, h·R core entries, W^O of size N² × embed_dim with bias) and of
    multi-head attention with h = ``num_blocks`` heads (4 embed_dim² weights and 4 embed_dim
    biases, as ``torch.nn.MultiheadAttention``).

    Args:
        embed_dim: d_model. num_blocks: h. max_len: N. rank: R (default d_model / h).
    """
    arguments.sizes(embed_dim=embed_dim, num_blocks=num_blocks, max_len=max_len)
    r = _rank(embed_dim, num_blocks, rank)
    multi_linear = 3 * (embed_dim * r + r) + num_blocks * r + max_len**2 * embed_dim + embed_dim
    multi_head = 4 * embed_dim**2 + 4 * embed_dim
    return ParameterCounts(multi_linear, multi_head, multi_linear / multi_head)


def _rank(embed_dim: int, num_blocks: int, rank: int | None) -> int:
    if rank is not None:
        return arguments.positive_int(rank, "rank")
    if embed_dim % num_blocks:
        raise ValueError(
            f"embed_dim = {embed_dim} is not divisible by num_blocks = {num_blocks}; give rank"
        )
    return embed_dim // num_blocks


class MultiLinearOutput(NamedTuple):
    """The layer's output (B, M, d_model) and, on request, ``core`` (B, h, R): each block's
    softmax-normalised core diagonal g_j (the weights of its R rank-one terms)."""

    output: Tensor
    core: Tensor | None = None

    @property
    def representation(self) -> Tensor:
        return self.output

    def named_weights(self) -> dict[str, Tensor]:
        return {} if self.core is None else {"core": self.core}


@REGISTRY.register("multi_linear")
class MultiLinearAttention(nn.Module):
    """Multi-linear attention (Ma et al. eq. 7), called as ``layer(query, key=None, value=None,
    *, mask=None, need_weights=False)`` with query (B, M, d_model), key and value (B, N,
    d_model), M, N ≤ ``max_len``, and a key padding mask (B, 1, N).

    Args:
        embed_dim: d_model.
        num_blocks: h, the number of cores (the heads of the multi-head attention it replaces).
        max_len: N, the fixed length of the SplitConcat.
        rank: R, the columns of the shared factor matrices (default d_model / h).
    """

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("key", "value")}

    def __init__(
        self,
        embed_dim: int,
        num_blocks: int,
        max_len: int,
        *,
        rank: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        arguments.sizes(embed_dim=embed_dim, num_blocks=num_blocks, max_len=max_len)
        self.embed_dim, self.num_blocks, self.max_len = embed_dim, num_blocks, max_len
        self.rank = _rank(embed_dim, num_blocks, rank)
        kw = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, self.rank, **kw)  # W^q, shared by the blocks
        self.k_proj = nn.Linear(embed_dim, self.rank, **kw)
        self.v_proj = nn.Linear(embed_dim, self.rank, **kw)
        # the cores' diagonals g_j = softmax(θ_j): random in (0, 1) at first, as the paper's
        self.core_logits = nn.Parameter(torch.rand(num_blocks, self.rank, **kw))
        self.out_proj = nn.Linear(max_len * max_len, embed_dim, **kw)  # W^O
        self.align = Softmax()

    @classmethod
    def example(cls):
        x = example_tensor(2, 5, 6, seed=40)
        mask = masks.from_lengths(torch.tensor([5, 3]), 5)
        return cls(6, 2, 5), (x, x, x), {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.MULTIPLICATIVE, tx.QueryMultiplicity.MULTI_HEAD]

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_blocks={self.num_blocks}, "
            f"max_len={self.max_len}, rank={self.rank}"
        )

    def parameter_count(self) -> int:
        """The number of this layer's parameters."""
        return sum(p.numel() for p in self.parameters())

    def cores(self) -> Tensor:
        """g (h, R): each block's core diagonal, softmax(θ_j) (eq. 6)."""
        return self.align(self.core_logits[:, None]).weights[:, 0]

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        need_weights: bool = False,
    ) -> MultiLinearOutput:
        arguments.boolean(need_weights, "need_weights")
        key = query if key is None else key
        value = key if value is None else value
        e, big_n = self.embed_dim, self.max_len
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != e:
                raise ValueError(
                    f"MultiLinearAttention(embed_dim={e}) needs {name} (B, L, {e}), got "
                    f"{getattr(x, 'shape', type(x).__name__)}"
                )
            if x.shape[1] > big_n:
                raise ValueError(
                    f"MultiLinearAttention(max_len={big_n}) got {name} of length {x.shape[1]}"
                )
        if key.shape[:2] != value.shape[:2] or key.shape[0] != query.shape[0]:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} need the same (B, N), "
                f"and the batch of query {tuple(query.shape)}"
            )
        m, n = query.shape[1], key.shape[1]
        key, keep = masks.padding_only(key, e, mask, f"MultiLinearAttention(embed_dim={e})")
        value = torch.where(keep[..., None], value, 0.0)
        q = F.pad(self.q_proj(query), (0, 0, 0, big_n - m))  # zero rows: no position
        k = F.pad(torch.where(keep[..., None], self.k_proj(key), 0.0), (0, 0, 0, big_n - n))
        v = F.pad(torch.where(keep[..., None], self.v_proj(value), 0.0), (0, 0, 0, big_n - n))
        g = self.cores().to(q.dtype)  # (h, R)
        t = single_block_attention(g.mean(0), q, k, v)  # (1/h) Σ_j T_j: (B, N, N, N)
        out = self.out_proj(t[:, :m].flatten(-2))  # SplitConcat, then W^O
        # an item with no key weighs nothing (its output is W^O's bias)
        core = g * keep.any(-1).to(g.dtype)[:, None, None]
        hooks.report(self, core, "core")
        return MultiLinearOutput(out, core if need_weights else None)
