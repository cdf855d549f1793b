"""The per-head attention part (DESIGN 8): one base class for everything that
:class:`attnkit.MultiHeadAttention` and the Transformer layers can hold in their attention slot.

A part maps per-head inputs q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) to an
:class:`attnkit.AttentionOutput` whose context is (B, …, M, d_v) (Brauwers eq. 4: c = Σ_l a_l v_l,
whatever the part's way of computing the a_l). What a part supports is class data, read by the
layers, the caches and the tests before a call is made; a call asking for something the part
does not declare is refused with the reason (:meth:`HeadAttention.refusal`), never run wrongly.

The shared validation of per-head inputs (:func:`check_head_inputs`) lives here, once: a caller
that validated at its own door (multi-head attention) says so in its call (``checked=True``) and
the part then only reads the sizes it needs; a caller whose inputs are its own finite activations
says so too (``finite=True``) and nothing is scanned for non-finite padding.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from attnkit import hooks, masks
from attnkit.inputs import broadcast_shapes
from attnkit.output import AttentionOutput
from attnkit.sizing import Sizes, build

__all__ = ["MASK_FORMS", "HeadAttention", "check_head_inputs", "mask_form"]

# The mask forms a part may honour, from the narrowest to the widest:
# - "key": the same for every query, (…, 1, N) — key padding;
# - "padding": key padding whose padded queries' rows are all False (key ∧ query padding), as
#   multi-head self-attention passes it to a part that ``mixes_queries``;
# - "causal": a causal mask (query i may attend keys j ≤ i), alone or with key padding;
# - "full": any boolean (…, M, N), e.g. a sparse pattern.
MASK_FORMS = ("key", "padding", "causal", "full")


def mask_form(mask: Tensor | None, m: int) -> str | None:
    """The form a mask certainly has from its shape alone: None (no mask), ``"key"`` (one row
    for all M queries) or ``"full"`` (M rows; whether they differ is not looked at)."""
    if mask is None:
        return None
    return "key" if mask.dim() < 2 or mask.shape[-2] == 1 or m == 1 else "full"


class HeadAttention(nn.Module):
    """Base of every per-head attention part (DESIGN 8).

    A subclass declares what it supports and implements :meth:`attend` (q, k, v, *, mask, bias,
    need_weights) returning an :class:`attnkit.AttentionOutput`: the base's :meth:`forward` is a
    template that does what every part needs around it (validation, refusals by capability,
    masked keys hidden, empty rows 0, weights reported to hooks); smaller holes say how the
    part reads a mask (:meth:`declared_mask`), how many positions it keeps in a state of its
    own (:meth:`state_positions`) and, for a part whose call may leave the keys out, how it
    makes them (:meth:`keys_and_values`). A part may instead override
    ``forward(q, k, v, *, mask=None, bias=None, need_weights=False, ...)`` and do those itself.
    Either takes only the keywords its capabilities name: ``q_offset`` with
    ``takes_q_offset``, ``cache`` with ``takes_cache``, ``block_mask`` with
    ``accepts_block_mask``, ``score_mod`` with ``accepts_score_mod``; the layers pass nothing
    else, except what they know about the call (below).

    A caller tells the part two facts as keywords of the template :meth:`forward`, both False
    by default (a minimal part need not know about them): ``checked`` — the caller validated
    q, k, v, the mask and the bias at its own door and shaped them itself (a layer's plan,
    :mod:`attnkit.call_plan`), so only the sizes are read —, and ``finite`` — k and v hold no
    NaN or infinity anywhere, padding included (a model's own activations), so nothing is
    scanned for non-finite masked keys. A part that wants them in :meth:`attend` (to skip the
    validation of an inner call, or a scan of its own) declares ``takes_facts``; a part that
    overrides ``forward`` is given them only when it declares ``takes_facts``.

    Capabilities (class data, or properties where they follow from construction such as
    ``self.causal``); the defaults claim nothing:

    Attributes:
        causal_form: the part can attend causally, query i over keys j ≤ i: by a causal mask
            (a part honouring ``"full"`` masks) or by a causal mode of its own (``causal=True``,
            or causal by construction; such an instance has ``causal = True``).
        decodes_with_cache: queries after a KV cache, attending over all cached keys step by
            step, equal their rows of the part's causal pass (a part that approximates over
            the whole sequence — landmarks, projections, hashing, sorting — does not).
        takes_cache: the part keeps its own decoding state and is given the layer's cache as
            the keyword ``cache`` (e.g. a :class:`attnkit.linear_family.RecurrentCache`).
        takes_q_offset: the result depends on where the queries sit (a relative distance, a
            matrix indexed by query position): the part takes ``q_offset``, the position of
            the first query (the number of cached positions when decoding).
        mixes_queries: a query's result depends on the other queries (landmarks computed from
            all queries); multi-head self-attention then names padded queries by an all-False
            row of the mask.
        accepts_bias: an additive float bias (…, M, N) on the scores is honoured.
        accepts_block_mask: a :class:`attnkit.kernels.BlockMask` is honoured.
        accepts_score_mod: a ``score_mod(e, b, h, q_idx, kv_idx)`` is honoured.
        returns_weights: the part returns its weights (B, …, M, N) with ``need_weights=True``
            and reports them to :mod:`attnkit.hooks` (True here: a part that never holds whole
            rows of weights says False, and such a call is refused).
        sharded: the part attends over a sequence split across a process group (context
            parallelism): k, v and the mask hold this rank's keys only, so a query without a
            key here may still have keys on other ranks; the template then leaves such rows to
            the part instead of setting them to 0.
        mask_forms: the boolean mask forms honoured, a subset of :data:`MASK_FORMS`. A mask of
            M rows outside them is refused by the part itself (it alone can tell an expanded
            key mask from one that varies over queries).
        normalized_weights: the weights are a distribution over the keys: each row of the
            weights (…, M, N) sums to 1, and is 0 for a query without keys (False here, which
            claims nothing: weights that approximate, that are differences, or that are over
            other things than the keys, such as areas or projected keys).
        any_value_size: the values may have another size than the queries and keys (d_v ≠ d),
            as for any part computing ``w @ v`` (True here); False for a part sized at
            construction for values of head_dim features (a gate or a norm over them), which
            refuses other values with a ValueError naming v.
        takes_facts: the part's own method (:meth:`attend`, or ``forward`` where the part
            overrides it) takes the keywords ``checked`` and ``finite``. :meth:`attend` is
            given ``finite=True`` whenever k and v hold no NaN or infinity: stated by the
            caller, or established by the template while excluding masked keys (with a mask,
            non-finite keys are zeroed).
        forward_takes_facts: derived, not declared: whether ``forward`` takes ``checked`` and
            ``finite`` (the template does; a part's own ``forward`` when it declares
            ``takes_facts``). Callers pass them only then.
    """

    causal_form: ClassVar[bool] = False
    decodes_with_cache: ClassVar[bool] = False
    takes_cache: ClassVar[bool] = False
    takes_q_offset: ClassVar[bool] = False
    mixes_queries: ClassVar[bool] = False
    accepts_bias: ClassVar[bool] = False
    accepts_block_mask: ClassVar[bool] = False
    accepts_score_mod: ClassVar[bool] = False
    returns_weights: ClassVar[bool] = True
    sharded: ClassVar[bool] = False
    mask_forms: ClassVar[frozenset[str]] = frozenset()
    normalized_weights: ClassVar[bool] = False
    any_value_size: ClassVar[bool] = True
    takes_facts: ClassVar[bool] = False
    forward_takes_facts: ClassVar[bool] = True  # (derived in __init_subclass__)
    # for_heads: which constructor argument takes which size (attnkit.sizing.build); what the
    # part is, for its messages
    size_arguments: ClassVar[dict[str, str]] = {}
    part_kind: ClassVar[str] = "attention part"
    # for the mechanism contract (attnkit.mechanisms): which forward argument is a padding
    # mask over which inputs. Derived from mask_forms unless a part declares it: a part that
    # honours key masks takes ``mask`` over k and v.
    mask_inputs: ClassVar[dict[str, tuple[str, ...]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the class that declares the mask_inputs this one inherits: derive them again unless
        # a part declared them (for itself and its subclasses)
        owner = next(c for c in cls.__mro__ if "mask_inputs" in c.__dict__)
        if owner is HeadAttention or owner.__dict__.get("_derived_mask_inputs", False):
            forms = cls.mask_forms  # a property when it follows from construction: unknown
            keys = isinstance(forms, frozenset) and "key" in forms
            cls.mask_inputs = {"mask": ("k", "v")} if keys else {}
            cls._derived_mask_inputs = True
        # the template's forward takes checked= and finite=; a part's own forward only when it
        # declares so
        template = next(c for c in cls.__mro__ if "forward" in c.__dict__) is HeadAttention
        cls.forward_takes_facts = template or cls.takes_facts

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        need_weights: bool = False,
        q_offset: int = 0,
        cache: Any = None,
        block_mask: Any = None,
        score_mod: Any = None,
        checked: bool = False,
        finite: bool = False,
    ) -> AttentionOutput:
        """Per-head attention: q (B, …, M, d), k (B, …, N, d), v (B, …, N, d_v) → context
        (B, …, M, d_v); weights (B, …, M, N) only with ``need_weights=True``.

        The template for a part that implements :meth:`attend` (DESIGN 9): it validates the
        inputs (or takes them as checked), refuses what the part does not declare (naming
        the capability), hides keys that every query is masked from (nothing non-finite in
        them reaches the output or the gradients), reads a mask whose rows are all equal as a
        key mask for a part that declares only ``"key"``, sets rows without any key to 0,
        reports the weights to :mod:`attnkit.hooks`, and calls :meth:`attend` with one
        keyword signature. A part may instead override ``forward`` and do all of this itself.

        ``checked`` and ``finite`` are what the caller knows about the call (the class's
        text): True only from a caller that validated the inputs at its door (``checked``:
        only the sizes are read here) or whose k and v are finite everywhere, padding included
        (``finite``: nothing is scanned for non-finite keys). A wrong statement is not caught.
        """
        who = type(self).__name__
        if type(self).attend is HeadAttention.attend:
            raise NotImplementedError(
                f"{who} must implement attend(q, k, v, *, mask, bias, need_weights) (or forward)"
            )
        try:  # a refusal before attend: the part's to give (raised here, or agreed on)
            for name, given in (
                ("need_weights", need_weights),
                ("checked", checked),
                ("finite", finite),
            ):
                if not isinstance(given, bool):
                    raise TypeError(f"{who}: {name} must be a bool, got {given!r}")
            k, v, own = self.keys_and_values(q, k, v)
            before = self.state_positions(cache) if self.takes_cache else 0
            lead = check_head_inputs(q, k, v, None if before else mask, bias, who, checked=checked)
            if before and mask is not None:  # over the state's positions and the keys given
                masks.check(mask, torch.Size((*lead, q.shape[-2], before + k.shape[-2])))
                if mask.shape[-1] != 1:
                    mask = mask[..., before:]  # the state's positions are the part's to read
            if mask is not None and mask.dim() == 1:
                mask = mask[None]  # (N,) is (1, N) under broadcasting: one row for every query
            mask = self.declared_mask(mask, q.shape[-2], who)
            self.check_supported(
                who,
                mask=mask,
                m=q.shape[-2],
                bias=bias is not None,
                block_mask=block_mask is not None,
                score_mod=score_mod is not None,
                q_offset=bool(q_offset),
                cache=cache is not None,
                weights=need_weights,
            )
            k, v, poisoned = self._exclude_masked_keys(k, v, mask, finite=finite)
        except (ValueError, TypeError) as error:
            return self.refused(
                error, q, k, v, mask=mask, bias=bias, need_weights=need_weights,
                q_offset=q_offset, cache=cache, block_mask=block_mask, score_mod=score_mod,
            )  # fmt: skip
        call: dict[str, Any] = {}
        if self.takes_facts:  # (with a mask, the keys left non-finite were zeroed just now)
            call.update(checked=checked, finite=finite or mask is not None)
        for flag, key, value in (
            ("takes_q_offset", "q_offset", q_offset),
            ("takes_cache", "cache", cache),
            ("accepts_block_mask", "block_mask", block_mask),
            ("accepts_score_mod", "score_mod", score_mod),
        ):
            if getattr(self, flag):
                call[key] = value
        call.update(own)
        listening = hooks.listening() and self.returns_weights
        out = self.attend(
            q, k, v, mask=mask, bias=bias, need_weights=need_weights or listening, **call
        )
        if not isinstance(out, AttentionOutput):
            raise TypeError(f"{who}.attend returned {type(out).__name__}, not an AttentionOutput")
        if poisoned is not None:  # a row that attends a non-finite key: non-finite, as w @ v
            nan = torch.full((), float("nan"), dtype=out.context.dtype, device=out.context.device)
            out = out._replace(context=torch.where(poisoned, nan, out.context))
        # a row without any key: context 0 (and weights 0), never NaN (a sharded part's row
        # may have keys on other ranks)
        if mask is not None and not self.sharded:
            empty = ~mask.any(-1).unsqueeze(-1)  # (…, M, 1)
            zero = torch.zeros((), dtype=out.context.dtype, device=out.context.device)
            out = out._replace(context=torch.where(empty, zero, out.context))
            if out.weights is not None:
                out = out._replace(weights=torch.where(empty, zero, out.weights))
        if out.weights is not None:
            hooks.report(self, out.weights)
        return out if need_weights else out._replace(weights=None)

    @staticmethod
    def _exclude_masked_keys(
        k: Tensor, v: Tensor, mask: Tensor | None, *, finite: bool = False
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """k and v with every key that a query may not attend made harmless for
        :meth:`attend`, and the query rows (…, M, 1) that attend a non-finite key (None when
        there is none).

        A key no query may attend is zeroed. A key holding a non-finite value (NaN padding
        after a sequence's end, later tokens under a causal mask) is zeroed too, so that a
        part's plain ``w @ v`` or ``q @ kᵀ`` gives 0 · 0, not 0 · NaN, where its weight is 0,
        and no gradient reaches it; the rows that do attend it are set non-finite afterwards,
        as the plain sum would make them. With ``finite`` (the caller states that k and v hold
        no NaN or infinity) they are not scanned."""
        if mask is None:
            return k, v, None
        hide = ~mask.any(-2)  # (…, N): keys no query may attend
        poisoned = None
        if not finite and not _sums_finite(k, v):
            bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (…, N)
            if bool(bad.any()):
                poisoned = (mask & bad.unsqueeze(-2)).any(-1, keepdim=True)  # (…, M, 1)
                hide = hide | bad
        hide = hide.unsqueeze(-1)
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        return torch.where(hide, zero, k), torch.where(hide, zero.to(v.dtype), v), poisoned

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
        need_weights: bool, **call: Any,
    ) -> AttentionOutput:  # fmt: skip
        """The part's own attention, called by the template :meth:`forward` on validated
        inputs: q (…, M, d), k (…, N, d), v (…, N, d_v); ``mask`` a boolean (…, M, N) in a
        form the part declares (a key mask has one row) or None; ``bias`` a float (…, M, N) or
        None (only for a part that declares ``accepts_bias``); weights to return when
        ``need_weights``. Keys masked for every query hold zeros; with a mask, so do keys that
        held a NaN or an infinity. ``call`` holds what the part declares it takes:
        ``q_offset``, ``cache``, ``block_mask``, ``score_mod``, and with ``takes_facts`` the
        facts ``checked`` (the inputs were validated by a caller's door, not only by this
        template: an inner call may take them as checked too) and ``finite`` (k and v hold no
        NaN or infinity anywhere)."""
        raise NotImplementedError

    def keys_and_values(self, q: Any, k: Any, v: Any) -> tuple[Any, Any, dict[str, Any]]:
        """The keys and values of a call, and keywords of the part's own for :meth:`attend`
        (called by the template :meth:`forward` before it validates the inputs).

        Here k and v as given and no keyword. A part whose call may leave the keys out
        overrides this to make them (the Reformer's shared QK: ``k=None`` gives the normalised
        queries, and :meth:`attend` is told so by a keyword)."""
        return k, v, {}

    def refused(self, error: Exception, q: Any, k: Any, v: Any, **call: Any) -> AttentionOutput:
        """What a call refused before :meth:`attend` gives (a ValueError or TypeError of the
        template :meth:`forward`: the inputs, the mask's form, a capability); q, k, v and the
        keywords in ``call`` are the call's as far as the template got. Here the error is
        raised.

        A part whose ranks must take every call together (a ``sharded`` one: a rank that
        raised alone would leave the others waiting for it in the group) overrides this to
        hand the error to the group, so that every rank raises it."""
        raise error

    def state_positions(self, cache: Any) -> int:
        """The positions before the keys given that the part holds in a state of its own in
        ``cache`` rather than in k and v (asked only of a part that ``takes_cache``); 0 here.

        A mask then covers those positions and the keys given, (…, M, state + N): the
        template :meth:`forward` validates it at that width and gives :meth:`attend` its last
        N columns (the positions in the state were masked when they were folded in)."""
        return 0

    def declared_mask(self, mask: Tensor | None, m: int, who: str) -> Tensor | None:
        """The mask as :meth:`attend` takes it, in a form the part declares (called by the
        template :meth:`forward` on a validated mask of at least two dims, or None).

        Here, for a part that does not declare ``"full"``, a mask of M rows becomes its first
        row when all rows are equal (a key mask expanded over the queries); key padding whose
        padded queries' rows are all False passes for a part that declares ``"padding"``, a
        causal mask (with key padding) for one that declares ``"causal"``; any other is
        refused with a ValueError. A part that reads masks in a way of its own (one causal by
        construction reads only the causal triangle) overrides this and refuses what it cannot
        honour itself."""
        if mask is None or mask_form(mask, m) != "full" or "full" in self.mask_forms:
            return mask
        if bool((mask == mask[..., :1, :]).all()):
            return mask[..., :1, :]
        rows = mask.any(-1, keepdim=True)  # (…, M, 1): queries with a key
        if "padding" in self.mask_forms and bool(
            (mask == (mask.any(-2, keepdim=True) & rows)).all()
        ):
            return mask  # key padding with the padded queries' rows all False
        if "causal" in self.mask_forms and m == mask.shape[-1]:
            causal = torch.ones(m, m, dtype=torch.bool, device=mask.device).tril()
            if bool((mask == (mask[..., -1:, :] & causal)).all()):
                return mask
        raise ValueError(
            f"{who}: the mask varies over queries (shape {tuple(mask.shape)}) in a way the "
            f"part does not declare (mask_forms: {', '.join(sorted(self.mask_forms))})"
        )

    def reasons_not_supported(
        self,
        *,
        mask: Tensor | None = None,
        m: int = 0,
        bias: bool = False,
        block_mask: bool = False,
        score_mod: bool = False,
        cache: bool = False,
        q_offset: bool = False,
        causal: bool = False,
        weights: bool = False,
    ) -> list[str]:
        """Every reason why a call asking for these is not supported (empty when it is).

        Args:
            mask: the boolean mask of the call, or None; ``m`` is the number of queries.
            bias, block_mask, score_mod: whether the call passes one.
            cache: whether the call decodes with a KV cache.
            q_offset: whether the queries sit after other positions (q_offset > 0).
            causal: whether the part is to attend causally inside a decoder's self-attention,
                which passes a causal mask: the part needs a causal form and to honour that
                mask.
            weights: whether the call asks for the weights (``need_weights=True``).
        """
        name = type(self).__name__
        out = []
        if causal and not self.causal_form:
            out.append(
                f"attention part {name} has no causal form (causal_form is False): it cannot "
                "attend causally, as a decoder's self-attention must"
            )
        elif causal and not {"causal", "full"} & set(self.mask_forms):
            out.append(
                f"attention part {name} honours no causal mask (mask_forms: "
                f"{', '.join(sorted(self.mask_forms)) or 'none'}), and a decoder's "
                "self-attention passes one with every call of more than one query; use it "
                "causally on its own (its causal mode) or pick a part whose mask_forms include "
                "'causal'"
            )
        form = mask_form(mask, m)
        if form is not None and not self.mask_forms:
            out.append(
                f"attention part {name} honours no mask (mask_forms is empty) but is given a "
                f"{'key padding' if form == 'key' else '(…, M, N)'} mask (a causal layer, such "
                "as a decoder's self-attention, always passes one); declare the mask forms the "
                "part honours as class data, e.g. mask_forms = frozenset({'key', 'padding', "
                "'causal', 'full'})"
            )
        for wanted, flag, what in (
            (bias, "accepts_bias", "an additive bias on its scores"),
            (block_mask, "accepts_block_mask", "a block mask (pattern= / block_mask=)"),
            (score_mod, "accepts_score_mod", "a score_mod"),
        ):
            if wanted and not getattr(self, flag):
                out.append(
                    f"attention part {name} does not declare {flag} = True, so it cannot honour "
                    f"{what}"
                )
        if cache and not self.decodes_with_cache:
            out.append(
                f"attention part {name} does not declare decodes_with_cache = True: attending "
                "over the cached keys step by step is not known to equal its causal pass (a "
                "part that approximates over the whole sequence, e.g. with landmarks, "
                "projections, hashing or sorting, gives other results per step)"
            )
        if weights and not self.returns_weights:
            out.append(
                f"attention part {name} does not return weights (returns_weights is False): it "
                "never holds whole rows of them"
            )
        if q_offset and not self.takes_q_offset and not self.decodes_with_cache:
            out.append(
                f"attention part {name} does not declare takes_q_offset = True: it cannot place "
                "queries after other positions"
            )
        return out

    def refusal(self, **call: Any) -> str | None:
        """Why a call asking for ``call`` (see :meth:`reasons_not_supported`) is not
        supported, or None when it is."""
        reasons = self.reasons_not_supported(**call)
        return "; ".join(reasons) if reasons else None

    def check_supported(self, who: str, **call: Any) -> None:
        """Raise ValueError naming ``who``, the part and the capability when :meth:`refusal`
        gives a reason."""
        reason = self.refusal(**call)
        if reason is not None:
            raise ValueError(f"{who}: {reason}")

    @classmethod
    def for_heads(
        cls, *, embed_dim: int, num_heads: int, head_dim: int, max_len: int, **overrides: Any
    ) -> HeadAttention:
        """The part built for H = ``num_heads`` heads of size d = ``head_dim`` over at most
        ``max_len`` keys, in a layer of width E = ``embed_dim``.

        The part declares which constructor argument takes which size in
        :attr:`size_arguments` (``{"head_dim": "head_dim", "max_span": "max_len"}``; as scores,
        alignments and position schemes do, :func:`attnkit.sizing.build`); ``overrides`` give
        any argument explicitly; every other argument keeps its default. A part whose
        constructor needs more than sizes overrides this method.

        Raises:
            TypeError: a required argument that no declared size fills, or an override the
                constructor does not take.
        """
        sizes = Sizes(embed_dim=embed_dim, num_heads=num_heads, head_dim=head_dim, max_len=max_len)
        return build(cls, sizes, overrides)

    @classmethod
    def example(cls) -> tuple[HeadAttention, tuple[Tensor, Tensor, Tensor], dict[str, Any]]:
        """A small instance (E = 8, H = 2, d = 4, at most 8 keys) with inputs q, k, v
        (2, 2, 7, 4), and for a part that honours key masks the key padding mask of lengths 7
        and 5 (2, 2, 1, 7): ``module(*args, **kwargs)`` runs it."""
        module = cls.for_heads(embed_dim=8, num_heads=2, head_dim=4, max_len=8)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2, 2, 7, 4, generator=g) for _ in range(3))
        if "mask" not in cls.mask_inputs:
            return module, (q, k, v), {}
        mask = masks.from_lengths(torch.tensor([7, 5]), 7)[:, None].expand(2, 2, 1, 7)
        return module, (q, k, v), {"mask": mask}


def _sums_finite(k: Tensor, v: Tensor) -> bool:
    """Whether the sums of k and of v are finite: then every entry is (a NaN or an infinite
    entry makes the sum non-finite), found by two float reductions instead of an elementwise
    scan; a sum that overflows only sends the caller to the exact scan."""
    k_sum, v_sum = (
        x.detach().sum(dtype=torch.promote_types(x.dtype, torch.float32)) for x in (k, v)
    )
    return bool(torch.isfinite(k_sum + v_sum))


def check_head_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    who: str,
    *,
    checked: bool = False,
) -> torch.Size:
    """Validate per-head inputs q (…, M, d), k (…, N, d), v (…, N, d_v), a boolean mask and a
    float bias broadcastable to (…, M, N); returns the broadcast leading dims.

    With ``checked`` (a caller that validated at its door and shaped the inputs itself, e.g. a
    layer's plan) only the leading dims are computed and an empty key set refused."""
    if checked:
        if k.shape[-2] == 0:
            raise ValueError(f"{who}: the key set is empty (k of shape {tuple(k.shape)})")
        return broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{who}: {name} must be a tensor, got {type(x).__name__}")
        if x.dim() < 2 or not x.is_floating_point():
            raise ValueError(
                f"{who}: {name} must be a floating tensor (…, L, d), got shape "
                f"{tuple(x.shape)} dtype {x.dtype}"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{who}: q has {q.shape[-1]} features but k has {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{who}: k of shape {tuple(k.shape)} and v of shape {tuple(v.shape)} need the same N"
        )
    if k.shape[-2] == 0:
        raise ValueError(f"{who}: the key set is empty (k of shape {tuple(k.shape)})")
    try:
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"{who}: batch dims of q {tuple(q.shape)}, k {tuple(k.shape)} and v "
            f"{tuple(v.shape)} do not broadcast"
        ) from None
    shape = torch.Size((*lead, q.shape[-2], k.shape[-2]))
    masks.check(mask, shape)
    if bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            raise TypeError(f"{who}: bias must be a floating tensor, got {bias!r:.60}")
        masks.check_unambiguous(bias, shape, name=f"{who}: bias")
        try:
            if broadcast_shapes(bias.shape, shape) != shape:
                raise RuntimeError
        except RuntimeError:
            raise ValueError(
                f"{who}: bias of shape {tuple(bias.shape)} does not broadcast to {tuple(shape)}"
            ) from None
    return lead
