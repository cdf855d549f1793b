"""Which kernel evaluates a call, on which of its paths, and why every other registered kernel
and every skipped path does not.

:func:`explain` runs the selection :func:`attnkit.attention` runs (:func:`attnkit.kernels.select`,
then the kernel's :meth:`attnkit.kernels.Kernel.choose_path`) without evaluating anything, and
asks every registered kernel for its reasons. Its answer prints as a table::

    >>> print(ak.kernels.explain(q, k, v, align="sparsemax"))
    kernel 'dense' evaluates this call (automatic selection, by priority)
      sdpa     (priority 30)   not supported: the Sparsemax alignment is not softmax with ...
      chunked  (priority 20)   supported, but taken automatically only for a block mask, ...
      dense    (priority 0)    chosen
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from attnkit.alignments import Alignment
from attnkit.kernels.base import Call, available, forced_kernel, get
from attnkit.kernels.block_mask import BlockMask, ScoreMod
from attnkit.kernels.prepare import prepare_call
from attnkit.scores import Score

__all__ = ["Explanation", "Verdict", "explain"]


@dataclass(frozen=True)
class Verdict:
    """One kernel's answer to a call.

    Attributes:
        kernel: its registered name.
        priority: its priority (higher is tried first).
        reasons: why it cannot evaluate the call; empty when it can.
        prefers: for a supported call, whether automatic selection would take it (None when
            it cannot evaluate the call).
        not_preferred: for a supported call it does not prefer, why it passes (else "").
        path: for a supported call, the path of the kernel that would evaluate it (None for a
            kernel with one way, or when it cannot evaluate the call).
        skipped_paths: the kernel's paths tried before ``path``, each with why it does not
            serve the call.
    """

    kernel: str
    priority: int
    reasons: tuple[str, ...]
    prefers: bool | None
    not_preferred: str = ""
    path: str | None = None
    skipped_paths: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def supported(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Explanation:
    """The kernel a call gets and every registered kernel's verdict, highest priority first.

    Attributes:
        chosen: the kernel that evaluates the call; None when none can (then
            :func:`attnkit.attention` raises).
        forced: the kernel the caller forced (``kernel=``, or ``"chunked"`` for ``chunk_size=``);
            None for automatic selection.
        verdicts: one :class:`Verdict` per registered kernel, highest priority first.
    """

    chosen: str | None
    forced: str | None
    verdicts: tuple[Verdict, ...]

    @property
    def path(self) -> str | None:
        """The path of the chosen kernel that evaluates the call (None for a kernel with one
        way, or when no kernel can)."""
        return None if self.chosen is None else self.verdict(self.chosen).path

    def verdict(self, kernel: str) -> Verdict:
        """The verdict of the kernel registered as ``kernel``."""
        for v in self.verdicts:
            if v.kernel == kernel:
                return v
        names = ", ".join(v.kernel for v in self.verdicts)
        raise ValueError(f"kernel {kernel!r} is not among the explained kernels ({names})")

    def why_not(self, kernel: str) -> list[str]:
        """Why ``kernel`` does not evaluate the call: its reasons, or why a kernel that supports
        the call was passed over; empty for the chosen kernel."""
        v = self.verdict(kernel)
        if kernel == self.chosen:
            return []
        if v.reasons:
            return list(v.reasons)
        if self.forced is not None:
            return [f"supported, but kernel {self.forced!r} is forced"]
        if self.chosen is not None and self._rank(kernel) > self._rank(self.chosen):
            return [f"supported, but {self.chosen!r} comes first by priority"]
        return [v.not_preferred]

    def _rank(self, kernel: str) -> int:
        return [v.kernel for v in self.verdicts].index(kernel)

    @property
    def skipped(self) -> dict[str, list[str]]:
        """The kernels automatic selection passed over before the chosen one (all of them when
        none was chosen), with their reasons; empty when a kernel is forced."""
        if self.forced is not None:
            return {}
        out: dict[str, list[str]] = {}
        for v in self.verdicts:
            if v.kernel == self.chosen:
                break
            out[v.kernel] = self.why_not(v.kernel)
        return out

    def __str__(self) -> str:
        how = (
            f"forced: kernel={self.forced!r}"
            if self.forced is not None
            else "automatic selection, by priority"
        )
        if self.chosen is None:
            head = f"no kernel can evaluate this call ({how})"
        else:
            head = f"kernel {self.chosen!r} evaluates this call ({how})"
        width = max((len(v.kernel) for v in self.verdicts), default=0)
        lines = [head]
        for v in self.verdicts:
            rank = f"(priority {v.priority})"
            label = f"{v.kernel:<{width}}  {rank:<14}"
            if v.kernel == self.chosen:
                text = "chosen" + _path_text(v)
            elif v.reasons:
                text = "not supported: " + "; ".join(v.reasons)
            else:
                text = "; ".join(self.why_not(v.kernel))
            lines.append(f"  {label}  {text}")
        return "\n".join(lines)


def _path_text(v: Verdict) -> str:
    if v.path is None:
        return ""
    skipped = "; ".join(f"path {name!r} skipped: {'; '.join(why)}" for name, why in v.skipped_paths)
    return f", path {v.path!r}" + (f" ({skipped})" if skipped else "")


def explain(
    q: Tensor | Call | None,
    k: Tensor | None = None,
    v: Tensor | None = None,
    *,
    score: str | Score = "scaled_dot",
    align: str | Alignment = "softmax",
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    need_weights: bool = False,
    chunk_size: int | None = None,
    dropout: float = 0.0,
    kernel: str | None = None,
    block_mask: BlockMask | None = None,
    score_mod: ScoreMod | None = None,
) -> Explanation:
    """Which kernel :func:`attnkit.attention` would run for these arguments, and why each other
    registered kernel would not; nothing is evaluated.

    Args:
        q: the queries, as for :func:`attnkit.attention`; or a validated :class:`Call` (then
            give no other argument but ``kernel``).
        k: and every other argument (``v``, ``score``, ``align``, ``mask``, ``bias``,
            ``need_weights``, ``chunk_size``, ``dropout``, ``kernel``, ``block_mask``,
            ``score_mod``): as for :func:`attnkit.attention`, validated the same way.

    Returns:
        :class:`Explanation`; ``print`` it for a table of every kernel's verdict, with the
        path the chosen kernel takes and why it skips the paths before it.
    """
    if isinstance(q, Call):
        if k is not None or v is not None:
            raise TypeError("explain(call) takes no k or v: the call holds them")
        call = q
    else:
        if k is None:
            raise TypeError("explain needs the keys k (or a validated Call as first argument)")
        call = prepare_call(
            q,
            k,
            v,
            score=score,
            align=align,
            mask=mask,
            bias=bias,
            need_weights=need_weights,
            chunk_size=chunk_size,
            dropout=dropout,
            kernel=kernel,
            block_mask=block_mask,
            score_mod=score_mod,
        )
    forced = forced_kernel(call, kernel)
    if forced is not None:
        get(forced)  # an unknown name raises here, as it does in attention()
    verdicts = []
    chosen = None
    for name in available():
        candidate = get(name)
        reasons = tuple(candidate.reasons_not_supported(call))
        prefers = None if reasons else candidate.prefers(call)
        why = candidate.not_preferred_reason(call) if prefers is False else ""
        path, skipped = None, ()
        if not reasons:
            tried = candidate.path_verdicts(call)
            if tried and not tried[-1][1]:
                path = tried[-1][0]
                skipped = tuple((p, tuple(r)) for p, r in tried[:-1])
        verdicts.append(Verdict(name, candidate.priority, reasons, prefers, why, path, skipped))
        if not reasons and (forced == name or (forced is None and prefers and chosen is None)):
            chosen = name
    return Explanation(chosen, forced, tuple(verdicts))
