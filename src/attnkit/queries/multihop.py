"""Multi-hop attention (Brauwers 3.3.2, Fig. 10, eqs. 41-42)."""

from __future__ import annotations

from typing import ClassVar, Literal, NamedTuple

import torch
from torch import Tensor, nn

from attnkit import arguments, checks, masks
from attnkit import taxonomy as tx
from attnkit.arguments import sizes
from attnkit.core import Attention
from attnkit.features._pooling import key_mask, masked_mean
from attnkit.mechanisms import REGISTRY, example_tensor
from attnkit.scores import Additive

__all__ = ["MultiHop", "MultiHopOutput"]


class MultiHopOutput(NamedTuple):
    """Final context c⁽ˢ⁾ (B, d_v), every hop's context (B, S, d_v) and weights (B, S, n)."""

    context: Tensor
    contexts: Tensor
    weights: Tensor

    @property
    def representation(self) -> Tensor:
        """The final context c⁽ˢ⁾ (B, d_v)."""
        return self.context

    def named_weights(self) -> dict[str, Tensor]:
        return {"weights": self.weights}


@REGISTRY.register("multi_hop")
class MultiHop(nn.Module):
    """S rounds of attention that refine the query and the context:

    c⁽⁰⁾ = mean of the values; q⁽ˢ⁺¹⁾ = transform(q⁽ˢ⁾, c⁽ˢ⁾) (eq. 41) with transform =
    tanh(W_t x), x being q⁽ˢ⁾ (``transform="query"``), c⁽ˢ⁾ (``"context"``) or their
    concatenation (``"both"``); e_l = score(concat(q⁽ˢ⁺¹⁾, c⁽ˢ⁾), k_l) (eq. 42), additive by
    default; c⁽ˢ⁺¹⁾ = Σ_l a_l v_l.

    Args:
        d_q, d_k, d_v: sizes of the initial query, keys and values.
        hops: S ≥ 1.
        transform: what the new query is computed from.
        share_weights: one transform and score for all hops (as in [85]) or one per hop.
        d_w: hidden size of the additive scores.
        align: alignment of every hop.
    """

    def __init__(
        self,
        d_q: int,
        d_k: int,
        d_v: int,
        *,
        hops: int = 2,
        transform: Literal["query", "context", "both"] = "both",
        share_weights: bool = True,
        d_w: int = 64,
        align: str | nn.Module = "softmax",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes(d_q=d_q, d_k=d_k, d_v=d_v, d_w=d_w)
        arguments.boolean(share_weights, "share_weights")
        arguments.positive_int(hops, "hops")
        if transform not in ("query", "context", "both"):
            raise ValueError(f"transform must be 'query', 'context' or 'both', got {transform!r}")
        d_in = {"query": d_q, "context": d_v, "both": d_q + d_v}[transform]
        n = 1 if share_weights else hops
        self.hops, self.transform = hops, transform
        self.d_q, self.d_k, self.d_v = d_q, d_k, d_v
        kw = {"device": device, "dtype": dtype}
        self.transforms = nn.ModuleList([nn.Linear(d_in, d_q, **kw) for _ in range(n)])
        self.attentions = nn.ModuleList(
            [Attention(Additive(d_q + d_v, d_k, d_w, **kw), align) for _ in range(n)]
        )

    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {"mask": ("keys", "values")}

    @classmethod
    def example(cls) -> tuple[nn.Module, tuple, dict]:
        """(2 hops, (query (2, 3), keys (2, 6, 4), values (2, 6, 5)), a mask)."""
        shapes = ((2, 3), (2, 6, 4), (2, 6, 5))
        args = tuple(example_tensor(*shape, seed=s) for s, shape in enumerate(shapes))
        mask = masks.from_lengths(torch.tensor([6, 2]), 6)
        return cls(3, 4, 5, hops=2, d_w=6), args, {"mask": mask}

    def taxonomy_tags(self) -> list:
        return [tx.QueryMultiplicity.MULTI_HOP]

    def forward(
        self, query: Tensor, keys: Tensor, values: Tensor | None = None, mask: Tensor | None = None
    ) -> MultiHopOutput:
        """query (B, d_q); keys (B, n, d_k); values (B, n, d_v) (default keys); mask None,
        (B, n) or (B, 1, n) boolean, True = a real key."""
        query = checks.features(query, "query", self.d_q, what="d_q", rank=2)
        keys = checks.features(keys, "keys", self.d_k, what="d_k")
        values = keys if values is None else values
        values = checks.features(values, "values", self.d_v, what="d_v")
        checks.same_batch(("query", query), ("keys", keys), ("values", values))
        checks.part_matches(self, "MultiHop", "query", query)
        if values.shape[-2] != keys.shape[-2]:
            raise ValueError(
                f"values has {values.shape[-2]} rows (shape {tuple(values.shape)}) but keys has "
                f"{keys.shape[-2]} (shape {tuple(keys.shape)}); they must match"
            )
        mask = checks.feature_mask(mask, keys, "mask", "keys")
        keys = checks.without_padding(keys, mask)
        values = checks.without_padding(values, mask)
        q, c = query, masked_mean(values, mask)  # c⁽⁰⁾
        contexts, weights = [], []
        for s in range(self.hops):
            i = min(s, len(self.transforms) - 1)
            x = {"query": q, "context": c, "both": torch.cat([q, c], -1)}[self.transform]
            q = torch.tanh(self.transforms[i](x))  # eq. 41
            out = self.attentions[i](
                torch.cat([q, c], -1).unsqueeze(-2),
                keys,
                values,
                mask=key_mask(mask),
                need_weights=True,
            )  # eq. 42
            c = out.context.squeeze(-2)
            contexts.append(c)
            weights.append(out.weights.squeeze(-2))
        return MultiHopOutput(c, torch.stack(contexts, -2), torch.stack(weights, -2))
