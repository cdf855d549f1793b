"""Forgetting attention, the attention of the Forgetting Transformer (FoX; Lin, Nikishin, He and
Courville 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate", ICLR 2025,
arXiv 2503.02130): causal softmax attention whose logits are down-weighted by a data-dependent
forget gate, as a recurrent network's state is.

Per head, every position t has a scalar forget gate f_t = σ(w_f · x_t + b_f) ∈ (0, 1), and
query i attends key j ≤ i with (Lin et al. eqs. 3-6)

    o_i = Σ_{j ≤ i} F_ij exp(q_i·k_j / √d) v_j / Σ_{j ≤ i} F_ij exp(q_i·k_j / √d),
    F_ij = Π_{l=j+1}^{i} f_l,

i.e. softmax(QKᵀ/√d + D) V with the additive bias D_ij = Σ_{l=j+1}^{i} log f_l = c_i − c_j
(c_t = Σ_{l ≤ t} log f_l, a cumulative sum) and −∞ above the diagonal. A key's weight decays
with every position after it, at a rate the tokens choose; with f ≡ 1 it is ordinary causal
softmax attention. FoX needs no position embedding (the paper trains it without RoPE).

Where it differs from the paper: a per-head part does not see the layer input x_t, so the gate
reads the head's value v_t instead, f_t = σ(w_f,h · v_t + b_f,h) with w_f,h ∈ R^d per head
(as :class:`attnkit.linear_family.GatedLinearAttention` reads its key). Since v_t = W^V_h x_t,
this is the paper's gate with w_f restricted to the row space of the head's W^V_h. The value,
unlike the key, is never rotated or normalised by the layer's q/k chain or position scheme, so
the gate stays a function of the token alone.

Padding: a position no query may attend (key padding) does not decay, log f = 0 there, so key
padding anywhere (left, right, holes) equals truncation; as a query such a position is padding
too and its row is 0. Decoding with a KV cache recomputes the
cumulative sum over the cached values at each step (O(N) per step, less than the attention's
own O(N·d)); the queries are the last M of the N positions.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import arguments, masks
from attnkit import taxonomy as tx
from attnkit.core import attention
from attnkit.head import HeadAttention
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.output import AttentionOutput

__all__ = ["ForgettingAttention", "forgetting_bias"]


def forgetting_bias(log_forget: Tensor, m: int) -> Tensor:
    """D (…, M, N) for log forget gates log f (…, N) ≤ 0, the M queries being the last M
    positions: D_ij = Σ_{l=j+1}^{i'} log f_l = c_i' − c_j with i' = N − M + i for the keys
    j ≤ i' (Lin et al. eq. 6); 0 for later keys, which a causal mask excludes."""
    n = log_forget.shape[-1]
    c = log_forget.cumsum(-1)
    diff = c[..., n - m :, None] - c[..., None, :]
    return torch.where(masks.causal(m, n, device=c.device), diff, torch.zeros((), dtype=c.dtype))


@REGISTRY.register("forgetting")
class ForgettingAttention(HeadAttention):
    """Forgetting attention (FoX), a per-head part ``part(q, k, v, *, mask, bias,
    need_weights)`` with q (B, …, H, M, d), k (B, …, H, N, d), v (B, …, H, N, d) → context
    (B, …, H, M, d); weights (B, …, H, M, N), each row a distribution over the keys j ≤ i.

    Args:
        head_dim: d, the size of the values the forget gate reads (the layer's head size).
        num_heads: H, each with its own gate w_f (d,) and b_f.
        bias_init: b_f's initial value: f ≈ σ(bias_init) at first (0 gives ½, as the paper's
            code, which zero-initialises the gate's bias).
        device, dtype: of the gate's parameters.

    Causal by construction: query i (the (N − M + i)-th position) attends keys j ≤ i; a mask
    (key padding, causal, any (…, M, N)) and an additive bias are honoured on top. Use it in
    self-attention, ``ak.MultiHeadAttention(E, H, attention=ForgettingAttention(E // H, H))``,
    with no position scheme (the forget gate places the tokens).
    """

    # for_heads: the constructor arguments each size fills (attnkit.sizing.build)
    size_arguments: ClassVar[dict[str, str]] = {"head_dim": "head_dim", "num_heads": "num_heads"}

    # capabilities (attnkit.head.HeadAttention)
    causal_form: ClassVar[bool] = True
    causal: ClassVar[bool] = True
    decodes_with_cache: ClassVar[bool] = True  # the cumulative gates are recomputed per step
    accepts_bias: ClassVar[bool] = True
    mask_forms: ClassVar[frozenset[str]] = frozenset({"key", "padding", "causal", "full"})
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("q", "k", "v")}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        *,
        bias_init: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.bias_init = arguments.finite_float(bias_init, "bias_init")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.forget_weight = nn.Parameter(
            torch.randn(num_heads, head_dim, **kw) / math.sqrt(head_dim)
        )
        self.forget_bias = nn.Parameter(torch.full((num_heads,), self.bias_init, **kw))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}"

    def taxonomy_tags(self) -> list:
        return [tx.Scoring.SCALED_MULTIPLICATIVE, tx.AlignmentKind.GLOBAL]

    @classmethod
    def example(cls):
        q, k, v = (example_tensor(2, 2, 7, 4, seed=s) for s in (41, 42, 43))
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return cls(4, 2, bias_init=1.0), (q, k, v), {"mask": mask}

    def log_forget(self, v: Tensor) -> Tensor:
        """log f_t = log σ(w_f · v_t + b_f) (…, H, N) for values v (…, H, N, d), computed in
        at least float32."""
        work = torch.promote_types(v.dtype, torch.float32)
        w, b = self.forget_weight.to(work), self.forget_bias.to(work)
        return F.logsigmoid(torch.einsum("...hnd,hd->...hn", v.to(work), w) + b[:, None])

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None,
        bias: Tensor | None,
        need_weights: bool,
    ) -> AttentionOutput:
        who = type(self).__name__
        m, n = q.shape[-2], k.shape[-2]
        if v.dim() < 3 or v.shape[-3] != self.num_heads or v.shape[-1] != self.head_dim:
            raise ValueError(
                f"{who} has forget gates for {self.num_heads} heads reading values of "
                f"{self.head_dim} features: v must be (B, …, {self.num_heads}, N, "
                f"{self.head_dim}), got {tuple(v.shape)}"
            )
        if m > n:
            raise ValueError(
                f"{who} is causal self-attention: the {m} queries are the last of the N keys, "
                f"so N >= M, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        log_f = self.log_forget(v)
        causal = masks.causal(m, n, device=q.device)
        if mask is None:
            mask = causal
        else:  # a position no query may attend is padding: it does not decay, and as a
            # query it attends nothing (its row is 0)
            real = mask.any(-2)  # (…, N)
            log_f = torch.where(real, log_f, torch.zeros((), dtype=log_f.dtype))
            mask = mask & causal & real[..., n - m :, None]
        forget = forgetting_bias(log_f, m).to(q.dtype)
        bias = forget if bias is None else forget + bias
        return attention(q, k, v, mask=mask, bias=bias, need_weights=need_weights)
