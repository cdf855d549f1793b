"""The one mask convention: boolean, ``True`` = may attend, broadcastable to (B, …, M, N).

This is the convention of ``torch.nn.functional.scaled_dot_product_attention``. Additive float
biases are a separate ``bias`` argument of :func:`attnkit.attention`. A row with no key allowed
gives weights 0 and context 0 (never NaN).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from attnkit import arguments

__all__ = [
    "causal",
    "causal_shared",
    "check",
    "check_unambiguous",
    "combine",
    "from_lengths",
    "is_made_causal",
    "window",
]

# id -> (weak reference, version) of the square causal masks made by causal(), unchanged since
_MADE_CAUSAL: dict[int, tuple[weakref.ref, int]] = {}


def from_lengths(lengths: Tensor, n: int) -> Tensor:
    """Padding mask from sequence lengths.

    Args:
        lengths: (B,) integer lengths, each in [0, n].
        n: padded length N.

    Returns:
        (B, 1, N) boolean mask, True for the first ``lengths[b]`` keys; broadcasts over M.
    """
    arguments.nonnegative_int(n, "n")
    if not isinstance(lengths, Tensor):
        try:
            lengths = torch.as_tensor(lengths)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(
                f"lengths must be a 1-D integer tensor or a list of ints, got {lengths!r}"
            ) from None
    if (
        lengths.dim() != 1
        or lengths.dtype.is_floating_point
        or lengths.dtype.is_complex
        or (lengths.dtype == torch.bool)
    ):
        raise TypeError(
            f"lengths must be a 1-D integer tensor, got shape {tuple(lengths.shape)} "
            f"dtype {lengths.dtype}"
        )
    if lengths.numel() and (int(lengths.min()) < 0 or int(lengths.max()) > n):
        raise ValueError(f"lengths must lie in [0, n={n}], got {lengths.tolist()}")
    positions = torch.arange(n, device=lengths.device)
    return (positions[None, :] < lengths[:, None]).unsqueeze(-2)


def causal(m: int, n: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """(M, N) mask: query i may attend keys j <= i + (N - M) (aligned at the end, as SDPA)."""
    arguments.nonnegative_int(m, "m")
    n = m if n is None else arguments.nonnegative_int(n, "n")
    # tril_ in place: several times faster than tril, which makes a second (M, N) tensor
    mask = torch.ones(m, n, dtype=torch.bool, device=device).tril_(diagonal=n - m)
    if m == n and not torch.compiler.is_compiling():
        try:
            version = mask._version
        except RuntimeError:  # an inference tensor keeps no version: not remembered
            return mask
        key = id(mask)
        ref = weakref.ref(mask, lambda _, key=key: _MADE_CAUSAL.pop(key, None))
        _MADE_CAUSAL[key] = (ref, version)
    return mask


def causal_shared(
    m: int,
    n: int | None = None,
    *,
    device: torch.device | str | None = None,
    shared: dict | None = None,
) -> Tensor:
    """:func:`causal` (M, N), made once per sizes and device for everyone who passes the same
    ``shared`` dict (a new one each call with None): the layers of one stack's forward
    (:class:`attnkit.transformer.TransformerDecoder`) pass theirs, so that they hold one mask
    instead of an (M, N) tensor each. For callers that never change the mask in place (the
    library's own layers); one changed in place since is not handed out again."""
    if shared is None:
        return causal(m, n, device=device)
    n = m if n is None else n
    key = (m, n, torch.device("cpu") if device is None else torch.device(device))
    kept = shared.get(key)
    if kept is not None:
        try:
            unchanged = kept[0]._version == kept[1]
        except RuntimeError:  # an inference tensor keeps no version (and is not changed here)
            unchanged = True
        if unchanged:
            return kept[0]
    mask = causal(m, n, device=device)
    try:
        version = mask._version
    except RuntimeError:
        version = None
    shared[key] = (mask, version)
    return mask


def is_made_causal(mask: Tensor) -> bool:
    """Whether ``mask`` is a square mask made by :func:`causal` and not changed since (its
    version counter says so), or a view of one that only adds leading dims of size 1 (such as
    ``mask[None, None]``), so that it is the causal mask without looking at its values. False
    says nothing: the mask may still be causal."""
    base = mask if mask._base is None else mask._base
    kept = _MADE_CAUSAL.get(id(base))
    if kept is None or kept[0]() is not base:
        return False
    if base is not mask and not (
        mask.shape[-2:] == base.shape
        and mask.stride()[-2:] == base.stride()
        and mask.storage_offset() == base.storage_offset()
        and all(size == 1 for size in mask.shape[:-2])
    ):
        return False
    try:
        return base._version == kept[1]
    except RuntimeError:
        return False


def window(m: int, n: int, size: int, *, device: torch.device | str | None = None) -> Tensor:
    """(M, N) band mask: query i may attend keys j with |i - j| <= size."""
    arguments.nonnegative_int(m, "m")
    arguments.nonnegative_int(n, "n")
    arguments.nonnegative_int(size, "size")
    i = torch.arange(m, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return (i - j).abs() <= size


def combine(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of masks (None entries are ignored); broadcasting as usual."""
    out: Tensor | None = None
    for i, mask in enumerate(masks):
        if mask is None:
            continue
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            what = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise TypeError(f"combine: mask {i} must be a boolean tensor or None, got {what}")
        if out is not None:
            try:
                torch.broadcast_shapes(out.shape, mask.shape)
            except RuntimeError:
                raise ValueError(
                    f"combine: mask {i} of shape {tuple(mask.shape)} does not broadcast with "
                    f"the masks before it, of shape {tuple(out.shape)}"
                ) from None
        out = mask if out is None else out & mask
    return out


def not_a_tensor(given: object, name: str) -> TypeError:
    """The error for a mask or bias ``given`` that is not a tensor; a function (a sparse pattern,
    ``mask_mod(b, h, q_idx, kv_idx)``) is told how to pass it."""
    hint = ""
    if callable(given) and name == "mask":
        hint = (
            "; a pattern (a mask function) becomes a mask by attnkit.patterns.dense(pattern, "
            "M, N), a block mask by attnkit.patterns.block_mask(pattern, M, N), or is given to "
            "a layer when it is built (pattern=)"
        )
    return TypeError(f"{name} must be a torch.Tensor, got {type(given).__name__}{hint}")


def check(mask: Tensor | None, scores_shape: torch.Size, *, name: str = "mask") -> None:
    """Raise if ``mask`` is not a boolean tensor broadcastable to ``scores_shape`` (B, …, M, N).

    A mask may have fewer dimensions than the scores (leading dims broadcast) but never more, and
    each of its dimensions must be 1 or equal to the matching score dimension; a shorter mask
    that could be lined up two ways is refused (:func:`check_unambiguous`).
    """
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise not_a_tensor(mask, name)
    if mask.dtype != torch.bool:
        raise TypeError(
            f"{name} must be boolean (True = may attend), got dtype {mask.dtype}; "
            f"pass additive float biases as bias=, or convert a 0/1 mask with {name}.bool()"
        )
    expected = tuple(scores_shape)
    ok = mask.dim() <= len(expected) and all(
        m in (1, s) for m, s in zip(reversed(mask.shape), reversed(expected), strict=False)
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
            f"{expected} (B, …, M, N)"
        )
    check_unambiguous(mask, scores_shape, name=name)


def check_unambiguous(x: Tensor, scores_shape: torch.Size, *, name: str = "mask") -> None:
    """Raise if ``x`` (a mask or bias with fewer dims than the scores) could be read two ways.

    Broadcasting lines a short tensor up from the right, so a (B, 1, N) key padding mask given
    for (B, H, M, N) scores puts its batch on the heads; when B = H nothing fails and every item
    gets another item's padding. Such a tensor, whose leading dims are not all 1 and would
    broadcast as well read batch first, is refused: give every dim (``mask[:, None]``).
    """
    lead, expected = tuple(x.shape[:-2]), tuple(scores_shape[:-2])
    if not lead or len(lead) >= len(expected) or all(s == 1 for s in lead):
        return
    if all(m in (1, s) for m, s in zip(lead, expected, strict=False)):
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} has {x.dim()} dims for scores of shape "
            f"{tuple(scores_shape)}: broadcasting would line its dim 0 up with dim "
            f"{len(expected) - len(lead)} of the scores, not with the batch, and both readings "
            f"fit; give every dim (e.g. {name.rsplit(' ', 1)[-1]}[:, None] for a (B, 1, N) key "
            "padding mask over (B, H, M, N) scores)"
        )


def padding_only(x: Tensor, d: int, mask: Tensor | None, who: str) -> tuple[Tensor, Tensor]:
    """Check a sequence x (B, N, d) and a padding mask (B, 1, N) for a part whose other masks are
    its own (directional parts such as DiSAN and Bi-BloSA): returns x with padded positions set
    to 0 (their content reaches nothing) and the kept positions (B, N). Any other mask shape,
    e.g. a per-query (B, N, N) mask, is refused naming ``who``.
    """
    if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != d:
        raise ValueError(f"{who} needs x (B, N, {d}), got {getattr(x, 'shape', type(x).__name__)}")
    b, n, _ = x.shape
    if mask is None:
        return x, torch.ones(b, n, dtype=torch.bool, device=x.device)
    if isinstance(mask, Tensor) and mask.dim() >= 2 and mask.shape[-2] != 1:
        raise ValueError(
            f"{who} takes a padding mask (B, 1, N) (its directions are its own masks), "
            f"got a mask of shape {tuple(mask.shape)}"
        )
    check(mask, torch.Size((b, 1, n)))
    keep = mask.broadcast_to(b, 1, n).reshape(b, n)
    return torch.where(keep[..., None], x, 0.0), keep
