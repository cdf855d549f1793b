"""A drop-in for ``torch.nn.MultiheadAttention``: torch's constructor, parameter names, forward
signature and mask conventions, evaluated by :class:`attnkit.MultiHeadAttention` with any score ×
alignment (Brauwers eqs. 38-40)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnkit import arguments
from attnkit.alignments import Alignment
from attnkit.multihead import MultiHeadAttention
from attnkit.scores import Score

__all__ = ["TorchMultiheadAttention"]

# the state of torch.nn.MultiheadAttention (those its configuration creates)
_TORCH_PARAMETERS = frozenset(
    {
        "in_proj_weight",
        "q_proj_weight",
        "k_proj_weight",
        "v_proj_weight",
        "in_proj_bias",
        "bias_k",
        "bias_v",
        "out_proj.weight",
        "out_proj.bias",
    }
)


def _torch_mask(mask: Tensor, name: str, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """A torch mask -> (allowed, bias) in attnkit's convention.

    Torch's boolean masks say True = may NOT attend; its float masks are added to the scores.
    A float entry of -inf means "may not attend": it becomes False in ``allowed`` (and 0 in
    ``bias``) so that alignments other than softmax (sparsemax, entmax, ...) never see an
    infinite score, and a row with no key left gets weights 0 as everywhere in attnkit.
    """
    if mask.dtype == torch.bool:
        return ~mask, torch.zeros((), dtype=dtype, device=mask.device)
    if not mask.is_floating_point():
        raise TypeError(
            f"{name} must be boolean (True = may not attend) or floating (added to the "
            f"scores), got dtype {mask.dtype}"
        )
    mask = mask.to(dtype)
    allowed = ~torch.isneginf(mask)
    return allowed, torch.where(allowed, mask, torch.zeros((), dtype=dtype, device=mask.device))


def _padded(x: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """A nested tensor (N, L_i, D) -> the padded (N, max L_i, D) with zeros and the lengths."""
    if x.dim() != 3:
        raise ValueError(
            f"{name} is a nested tensor of {x.dim()} dims; nested inputs are (N, L_i, D), "
            "one sequence per batch item"
        )
    parts = x.unbind()
    sizes = sorted({part.shape[-1] for part in parts})
    if len(sizes) > 1:
        raise ValueError(
            f"{name} holds sequences with feature sizes {sizes}; the sequences of a nested "
            "input differ in length only"
        )
    lengths = torch.tensor([part.shape[0] for part in parts], device=x.device)
    return torch.nested.to_padded_tensor(x, 0.0), lengths


class TorchMultiheadAttention(MultiHeadAttention):
    """``torch.nn.MultiheadAttention`` with attnkit's score and alignment slots.

    The constructor, the parameters (``in_proj_weight`` — or ``q_proj_weight``,
    ``k_proj_weight``, ``v_proj_weight`` when kdim or vdim differ from embed_dim —,
    ``in_proj_bias``, ``out_proj``, ``bias_k``, ``bias_v``), the forward signature and the
    conventions are torch's, so the module replaces torch's anywhere, e.g. as ``self_attn`` of
    ``torch.nn.TransformerEncoderLayer``, and ``load_state_dict`` takes a torch module's state
    dict (and torch's takes this one's). With the default score and alignment the outputs and
    weights are torch's; ``score=``/``align=`` (or a whole per-head ``attention=`` part, see
    :class:`attnkit.MultiHeadAttention`) change how each head attends. Scores with parameters add
    their own entries (``attention.score.*``) to the state dict: load across with
    ``strict=False`` or use :meth:`from_torch`.

    Args:
        embed_dim: E, the query size and output size.
        num_heads: H; must divide E.
        dropout: dropout on the attention weights in training mode.
        bias: biases in the input and output projections.
        add_bias_kv: append a learned key ``bias_k`` and value ``bias_v`` (each (1, 1, E)) to
            the projected keys and values, one more key for every query to attend.
        add_zero_attn: append a key and a value of zeros (after ``bias_k``, per head).
        kdim, vdim: key and value sizes (default E).
        batch_first: inputs and outputs (N, L, E) when True, (L, N, E) when False (torch's
            default).
        device, dtype: of the parameters.
        score: a score module built for per-head inputs, or a registered name (built by the
            score's ``for_heads(E/H, H)``); default torch's scaled dot product.
        align: an alignment module or a registered name; default softmax.
        attention: a whole per-head attention part instead of score and alignment (it then
            handles dropout itself: ``dropout`` must be 0).

    The extra keys of ``add_bias_kv`` and ``add_zero_attn`` sit after the real keys, which only
    a content-based score and an alignment that ignores key positions can treat as torch does;
    other combinations, and query-free scores (one row of scores for all queries), are refused.

    It is an :class:`attnkit.MultiHeadAttention` (attnkit's head analyses and weight capture see
    it) called with torch's signature instead of attnkit's.

    Torch's fused fast paths (``torch._native_multi_head_attention`` and the fused encoder layer)
    read the projection weights and compute torch's own attention without calling ``forward``;
    ``_qkv_same_embed_dim`` is therefore always False, which makes torch's Transformer layers
    call this module. Whether the input projection is one packed matrix is ``packed``.
    ``torch.nn.TransformerEncoder`` may still pack a padded batch into nested tensors at
    inference (it decides when it is built, from torch's attention); this module takes nested
    inputs (N, L_i, ·) and returns nested outputs, so a swapped encoder computes what torch's
    does in every mode.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        attention: nn.Module | None = None,
    ) -> None:
        if attention is not None and dropout != 0.0:
            raise ValueError(
                f"dropout = {dropout!r} applies to the default score × alignment part; an "
                "attention= part handles dropout itself: pass dropout=0.0"
            )
        super().__init__(
            embed_dim,
            num_heads,
            score,
            align,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            dropout=dropout,
            attention=attention,
            device=device,
            dtype=dtype,
        )
        self.batch_first = arguments.boolean(batch_first, "batch_first")
        self.add_zero_attn = arguments.boolean(add_zero_attn, "add_zero_attn")
        if arguments.boolean(add_bias_kv, "add_bias_kv"):
            kw = {"device": device, "dtype": dtype}
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **kw))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **kw))
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)
        else:
            self.bias_k = self.bias_v = None
        self._check_part()

    @property
    def _qkv_same_embed_dim(self) -> bool:
        # Read by torch's MultiheadAttention-aware code to pick its fused fast path, which would
        # bypass forward (see the class docstring).
        return False

    @property
    def _extra_keys(self) -> int:
        return int(self.bias_k is not None) + int(self.add_zero_attn)

    def _check_part(self) -> None:
        score, align = self.score, self.align
        if score is not None and score.query_free:
            raise ValueError(
                f"score {type(score).__name__} is query-free (one row of scores for all "
                "queries); torch.nn.MultiheadAttention gives one output per query"
            )
        if not self._extra_keys:
            return
        option = "add_bias_kv" if self.bias_k is not None else "add_zero_attn"
        if score is not None and (not score.content_based or score.mixes_keys):
            raise ValueError(
                f"{option}=True appends keys after the sequence, but score "
                f"{type(score).__name__} depends on key positions or neighbours; use a "
                "content-based score (e.g. 'scaled_dot', 'additive') or drop the option"
            )
        if getattr(self.attention, "mixes_queries", False):
            raise ValueError(
                f"{option}=True appends keys after the sequence, but attention part "
                f"{type(self.attention).__name__} mixes the queries of a self-attention call "
                "(it reads the keys as the same tokens as the queries); drop the option"
            )
        if align is not None and (align.position_based or align.query_position_based):
            raise ValueError(
                f"{option}=True appends keys after the sequence, but alignment "
                f"{type(align).__name__} depends on key positions; drop the option or use a "
                "position-free alignment (e.g. 'softmax', 'sparsemax')"
            )

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Torch's projections, then bias_k/bias_v and the zero key/value appended (…, N+x, E)."""
        q, k, v = super()._project(query, key, value)
        extra_k, extra_v = [], []
        lead = (*k.shape[:-2], 1, k.shape[-1])
        if self.bias_k is not None:
            extra_k.append(self.bias_k.expand(lead))
            extra_v.append(self.bias_v.expand(lead))
        if self.add_zero_attn:  # zeros per head = zeros over all E features
            extra_k.append(k.new_zeros(lead))
            extra_v.append(v.new_zeros(lead))
        if extra_k:
            k, v = torch.cat([k, *extra_k], dim=-2), torch.cat([v, *extra_v], dim=-2)
        return q, k, v

    def _check_mask_and_bias(
        self,
        query: Tensor,
        key: Tensor,
        mask: Tensor | None,
        bias: Tensor | None,
        cached: int = 0,
    ) -> None:
        # the appended keys count like cached ones: masks cover N + extra keys
        super()._check_mask_and_bias(query, key, mask, bias, cached + self._extra_keys)

    def _masks(
        self,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        n: int,
        m: int,
        s: int,
        batched: bool,
        dtype: torch.dtype,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Torch's key_padding_mask and attn_mask -> attnkit's per-head (mask, bias), each
        broadcastable to (N, H, L, S + extra keys); the extra keys may always be attended."""
        for name, x in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if x is not None and not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
        parts = []
        if key_padding_mask is not None:
            want = (n, s) if batched else (s,)
            if key_padding_mask.shape != want:
                raise ValueError(
                    f"key_padding_mask must have shape {want} ({'(N, S)' if batched else '(S,)'}"
                    f"), got {tuple(key_padding_mask.shape)}"
                )
            parts.append((key_padding_mask, "key_padding_mask", (n, 1, 1, s)))
        if attn_mask is not None:
            h = self.num_heads
            shapes = {2: (m, s), 3: (n * h, m, s) if batched else (h, m, s)}
            if shapes.get(attn_mask.dim()) != attn_mask.shape:
                raise ValueError(
                    f"attn_mask must have shape {shapes[2]} (L, S) or {shapes[3]} "
                    f"({'(N·H, L, S)' if batched else '(H, L, S)'}), got {tuple(attn_mask.shape)}"
                )
            view = (1, 1, m, s) if attn_mask.dim() == 2 else (n, h, m, s)
            parts.append((attn_mask, "attn_mask", view))
        if not parts:
            return None, None
        mask: Tensor | None = None
        bias: Tensor | None = None
        any_float = False
        for x, name, view in parts:
            allowed, add = _torch_mask(x, name, dtype)
            allowed = allowed.reshape(view)
            mask = allowed if mask is None else mask & allowed
            if x.dtype != torch.bool:
                any_float = True
                add = add.reshape(view)
                bias = add if bias is None else bias + add
        if any_float:  # a float mask of 0 and -inf is a boolean mask: keep the plain forms
            if bias is not None and not bool(bias.ne(0).any()) and not bias.requires_grad:
                bias = None
            if not bool((~mask).any()):
                mask = None
        if self._extra_keys:
            if mask is not None:
                pad = mask.new_ones((*mask.shape[:-1], self._extra_keys))
                mask = torch.cat([mask, pad], dim=-1)
            if bias is not None:
                pad = bias.new_zeros((*bias.shape[:-1], self._extra_keys))
                bias = torch.cat([bias, pad], dim=-1)
        return mask, bias

    def forward(  # type: ignore[override]  # torch's signature, not MultiHeadAttention's
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Torch's multi-head attention call.

        Args:
            query: (L, N, E), or (N, L, E) with ``batch_first``, or unbatched (L, E). With
                ``batch_first``, query, key and value may be nested tensors (N, L_i, ·), one
                sequence per batch item (as ``torch.nn.TransformerEncoder`` passes its layers
                at inference): the sequences attend over their own keys, a nested query gives
                a nested output, the weights come padded to the longest sequences with zeros
                outside each one, and the masks must be None (the lengths are the padding).
            key: (S, N, kdim) / (N, S, kdim) / (S, kdim).
            value: (S, N, vdim) / (N, S, vdim) / (S, vdim).
            key_padding_mask: (N, S), or (S,) unbatched: boolean with True = ignore this key,
                or float, added to the scores.
            need_weights: also return the attention weights.
            attn_mask: (L, S) for every batch item and head, or (N·H, L, S) per item and head
                (item-major, as torch), (H, L, S) unbatched: boolean with True = may NOT attend,
                or float, added to the scores. Combined with ``key_padding_mask``.
            average_attn_weights: average the returned weights over the heads.
            is_causal: a hint that ``attn_mask`` is the causal mask (as in torch, the mask must
                be given; it is the mask that is applied).

        Returns:
            (attn_output, attn_weights): attn_output like query (last dim E); attn_weights
            (N, L, S') averaged over heads or (N, H, L, S') per head — (L, S') / (H, L, S')
            unbatched — with S' = S plus the keys added by ``add_bias_kv`` and
            ``add_zero_attn``; None when ``need_weights`` is False.

        Unlike torch, a query with no key to attend gets weights 0 and output ``out_proj``'s
        bias (attnkit's convention), not NaN.
        """
        need_weights = arguments.boolean(need_weights, "need_weights")
        average_attn_weights = arguments.boolean(average_attn_weights, "average_attn_weights")
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if query.is_nested or key.is_nested or value.is_nested:
            return self._nested_forward(
                query,
                key,
                value,
                key_padding_mask,
                need_weights,
                attn_mask,
                average_attn_weights,
                is_causal,
            )
        if arguments.boolean(is_causal, "is_causal") and attn_mask is None:
            raise ValueError(
                "is_causal=True is a hint that attn_mask is the causal mask and needs attn_mask "
                "(as in torch); build it with torch.nn.Transformer.generate_square_subsequent_"
                "mask(L) or ~attnkit.masks.causal(L, S)"
            )
        if query.dim() not in (2, 3):
            raise ValueError(
                f"query must be (L, N, E), (N, L, E) with batch_first, or unbatched (L, E), "
                f"got shape {tuple(query.shape)}"
            )
        batched = query.dim() == 3
        for name, x in (("key", key), ("value", value)):
            if x.dim() != query.dim():
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)} but query has {tuple(query.shape)}: "
                    f"{'batched inputs are 3-D' if batched else 'unbatched inputs are 2-D'}"
                )
        q, k, v = self._batch_first(query, key, value, batched)
        if k.shape[0] != q.shape[0]:
            raise ValueError(
                f"key has batch size {k.shape[0]} but query has {q.shape[0]} (shapes "
                f"{tuple(key.shape)} and {tuple(query.shape)}, batch_first={self.batch_first})"
            )
        n, m, s = q.shape[0], q.shape[1], k.shape[1]
        mask, bias = self._masks(key_padding_mask, attn_mask, n, m, s, batched, query.dtype)
        out = super().forward(q, k, v, mask=mask, bias=bias, need_weights=need_weights)
        context, weights = out.context, out.weights
        if need_weights:
            if weights is None:
                raise TypeError(
                    f"need_weights=True, but attention part {type(self.attention).__name__} "
                    "returned no weights; call with need_weights=False"
                )
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        else:
            weights = None
        if not batched:
            return context.squeeze(0), weights
        if not self.batch_first:
            context = context.transpose(0, 1)
        return context, weights

    def _nested_forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None,
        need_weights: bool,
        attn_mask: Tensor | None,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The call on nested tensors (N, L_i, ·), one sequence per batch item: each is padded
        to the longest, its padding masked as keys, and the output nested again like query.

        This is what ``torch.nn.TransformerEncoder`` hands its layers at inference when it
        packs a padded batch (``enable_nested_tensor`` with a ``src_key_padding_mask``).
        """
        if not self.batch_first:
            raise ValueError(
                "nested inputs are (N, L_i, E), batch first, but this module has "
                "batch_first=False; build it with batch_first=True or pass padded tensors"
            )
        for name, x in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if x is not None:
                raise ValueError(
                    f"{name} cannot be given with nested inputs: the lengths of the nested "
                    "sequences are their padding, and one mask shape cannot fit sequences of "
                    "different lengths; pass padded tensors with masks instead"
                )
        if key.is_nested != value.is_nested:
            raise ValueError(
                f"key and value must both be nested or both be padded, got key nested = "
                f"{key.is_nested} and value nested = {value.is_nested}"
            )
        padded: dict[int, tuple[Tensor, Tensor | None]] = {}
        for name, x in (("query", query), ("key", key), ("value", value)):
            if id(x) not in padded:  # self-attention pads once and keeps its packed projection
                padded[id(x)] = _padded(x, name) if x.is_nested else (x, None)
        (q, q_lengths), (k, k_lengths), (v, v_lengths) = (
            padded[id(x)] for x in (query, key, value)
        )
        if k_lengths is not None and v_lengths is not None:
            if not torch.equal(k_lengths, v_lengths):
                raise ValueError(
                    f"key and value must hold sequences of the same lengths, got "
                    f"{k_lengths.tolist()} and {v_lengths.tolist()}"
                )
            positions = torch.arange(k.shape[1], device=k_lengths.device)
            key_padding_mask = positions >= k_lengths[:, None]  # True = padding, as torch
        context, weights = self.forward(
            q, k, v, key_padding_mask, need_weights, None, average_attn_weights, is_causal
        )
        if q_lengths is None:
            return context, weights
        rows = q_lengths.tolist()
        context = torch.nested.as_nested_tensor(
            [context[i, :n] for i, n in enumerate(rows)], layout=query.layout
        )
        if weights is not None:  # padded: zeros for keys and queries outside the sequences
            outside = torch.arange(q.shape[1], device=q_lengths.device) >= q_lengths[:, None]
            outside = outside[:, None, :, None] if weights.dim() == 4 else outside[..., None]
            weights = weights.masked_fill(outside, 0.0)
        return context, weights

    def _batch_first(
        self, query: Tensor, key: Tensor, value: Tensor, batched: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(N, L, ·) views of the inputs, the same tensor where the inputs were the same, so
        that self-attention keeps its single packed projection."""
        if batched and self.batch_first:
            return query, key, value

        def move(x: Tensor) -> Tensor:
            return x.transpose(0, 1) if batched else x.unsqueeze(0)

        q = move(query)
        k = q if key is query else move(key)
        v = k if value is key else (q if value is query else move(value))
        return q, k, v

    @classmethod
    def from_torch(  # type: ignore[override]
        cls,
        module: nn.MultiheadAttention | TorchMultiheadAttention,
        *,
        score: str | Score = "scaled_dot",
        align: str | Alignment = "softmax",
        attention: nn.Module | None = None,
    ) -> TorchMultiheadAttention:
        """A TorchMultiheadAttention with ``module``'s configuration and a copy of its weights.

        ``module`` is a ``torch.nn.MultiheadAttention`` or a TorchMultiheadAttention (to change
        its score or alignment); only torch's parameters are copied: a score with parameters
        keeps its own initialisation. With the default score and alignment the result computes
        what a torch ``module`` computes.
        """
        if not isinstance(module, (nn.MultiheadAttention, TorchMultiheadAttention)):
            raise TypeError(
                "module must be a torch.nn.MultiheadAttention or an "
                f"attnkit.TorchMultiheadAttention, got {type(module).__name__}"
            )
        ref = module.out_proj.weight
        ours = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            device=ref.device,
            dtype=ref.dtype,
            score=score,
            align=align,
            attention=attention,
        )
        theirs = module.state_dict()
        with torch.no_grad():
            for name, p in ours.named_parameters():
                if name in _TORCH_PARAMETERS:
                    p.copy_(theirs[name])
        ours.train(module.training)
        return ours

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, batch_first={self.batch_first}, "
            f"add_bias_kv={self.bias_k is not None}, add_zero_attn={self.add_zero_attn}"
        )
