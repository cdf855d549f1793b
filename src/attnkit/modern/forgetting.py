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

Memory: D is never built whole. Softmax rows are independent, so the queries are taken in
blocks of ``block_size`` rows: each block builds its rows of D, c_i − c_j for its queries and
the keys up to its last one, and attends those keys only, so at most (…, block, N) scores exist
at a time. That is O(N·block) rather than O(N²), and about half the work of the dense (…, M, N)
computation, because the keys after a block are never read. With autograd, each block is
recomputed in the backward pass (activation checkpointing) instead of keeping its (…, block,
N) weights, so training holds O(N·block) too. ``block_size=None`` takes all M rows at once, as
the dense computation does.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from attnkit import arguments, kernels, masks
from attnkit import taxonomy as tx
from attnkit.head import HeadAttention
from attnkit.head_registry import REGISTRY
from attnkit.kernels.prepare import prepare_call
from attnkit.mechanisms import example_tensor
from attnkit.output import AttentionOutput

__all__ = ["DEFAULT_BLOCK_SIZE", "ForgettingAttention", "forgetting_bias"]

#: Query rows per block of :class:`ForgettingAttention` (at N = 4096 keys, a block's float32
#: scores take 4 MiB per head).
DEFAULT_BLOCK_SIZE = 256


def forgetting_bias(log_forget: Tensor, m: int) -> Tensor:
    """D (…, M, N) for log forget gates log f (…, N) ≤ 0, the M queries being the last M
    positions: D_ij = Σ_{l=j+1}^{i'} log f_l = c_i' − c_j with i' = N − M + i for the keys
    j ≤ i' (Lin et al. eq. 6); 0 for later keys, which a causal mask excludes."""
    n = log_forget.shape[-1]
    return _bias_rows(log_forget.cumsum(-1), n - m, n)


def _bias_rows(c: Tensor, first: int, last: int) -> Tensor:
    """Rows ``first`` … ``last − 1`` of D over the keys 0 … last − 1, (…, last − first,
    last), from the cumulative log gates c (…, N): c_i − c_j for j ≤ i, 0 after."""
    diff = c[..., first:last, None] - c[..., None, :last]
    causal = masks.causal(last - first, last, device=c.device)
    return torch.where(causal, diff, torch.zeros((), dtype=c.dtype))


def _rows(x: Tensor | None, q0: int, q1: int, m: int, keys: int) -> Tensor | None:
    """Rows q0 … q1 − 1 of a mask or bias broadcasting to (…, M, N), over the first ``keys``
    columns (a dimension of size 1 stays)."""
    if x is None:
        return None
    if x.dim() >= 2 and x.shape[-2] == m and m > 1:
        x = x[..., q0:q1, :]
    return x[..., :keys] if x.shape[-1] > 1 else x


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
        block_size: query rows per block (see the module docstring: the blocks bound the
            memory to O(N·block_size) and do not change the result); None: all rows at once.
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
    any_value_size: ClassVar[bool] = False  # its forget gates read values of head_dim
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("q", "k", "v")}
    takes_facts: ClassVar[bool] = True  # the blocks' calls take the caller's checked and finite

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        *,
        bias_init: float = 0.0,
        block_size: int | None = DEFAULT_BLOCK_SIZE,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = arguments.positive_int(head_dim, "head_dim")
        self.num_heads = arguments.positive_int(num_heads, "num_heads")
        self.bias_init = arguments.finite_float(bias_init, "bias_init")
        self.block_size = arguments.optional_positive_int(block_size, "block_size")
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.forget_weight = nn.Parameter(
            torch.randn(num_heads, head_dim, **kw) / math.sqrt(head_dim)
        )
        self.forget_bias = nn.Parameter(torch.full((num_heads,), self.bias_init, **kw))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, block_size={self.block_size}"

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
        checked: bool = False,
        finite: bool = False,
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
        real = None
        if mask is not None:  # a position no query may attend is padding: it does not decay,
            # and as a query it attends nothing (its row is 0)
            real = mask.any(-2)  # (…, N)
            log_f = torch.where(real, log_f, torch.zeros((), dtype=log_f.dtype))
        c = log_f.cumsum(-1)
        step = m if self.block_size is None else self.block_size

        def block(q0: int, q1: int, q, k, v, c, mask, real, bias) -> tuple[Tensor, ...]:
            keys = n - m + q1  # the block's last query sits at position keys − 1
            block_mask = masks.causal(q1 - q0, keys, device=q.device)
            if mask is not None:
                block_mask = block_mask & _rows(mask, q0, q1, m, keys)
                rows = real if real.shape[-1] == 1 else real[..., n - m + q0 : keys]
                block_mask = block_mask & rows[..., None]
            forget = _bias_rows(c, n - m + q0, keys).to(q.dtype)
            extra = _rows(bias, q0, q1, m, keys)
            # the facts of this call hold for each block (and its recomputation in the backward
            # pass): keys checked by the caller's door are not validated again, finite keys
            # are not looked at
            call = prepare_call(
                q[..., q0:q1, :], k[..., :keys, :], v[..., :keys, :], mask=block_mask,
                bias=forget if extra is None else forget + extra, need_weights=need_weights,
                checked=checked, finite=finite,
            )  # fmt: skip
            out = kernels.select(call).attend(call)
            if not need_weights:
                return (out.context,)
            return out.context, F.pad(out.weights, (0, n - keys))

        spans = [(q0, min(q0 + step, m)) for q0 in range(0, m, step)]
        inputs = (q, k, v, c, mask, real, bias)
        recompute = len(spans) > 1 and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in inputs
        )  # fmt: skip
        parts = [
            checkpoint(block, q0, q1, *inputs, use_reentrant=False)
            if recompute
            else block(q0, q1, *inputs)
            for q0, q1 in spans
        ]
        context = torch.cat([p[0] for p in parts], -2) if len(parts) > 1 else parts[0][0]
        if not need_weights:
            return AttentionOutput(context)
        weights = torch.cat([p[1] for p in parts], -2) if len(parts) > 1 else parts[0][1]
        return AttentionOutput(context, weights)
