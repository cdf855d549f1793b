"""What the ranks agree on before a ring turn: that every rank accepted its part of the call,
and that every rank holds its part of the *same* call.

A check that fails on one rank only (an odd part under the zigzag layout, no queries, a padding
mask that is not boolean, a mask of the wrong form) must not raise there alone: the other ranks
would wait in the ring for it until the group's timeout and then report a stopped rank. So each
rank puts its verdict (accepted, or its error) and the identity of its call (shapes, dtype,
options, the score's and the alignment's identity) into one ``all_gather`` of int64 rows. When
every rank accepted the same call, that is all; otherwise the texts are gathered as well
(``all_gather_object``, on the error path only) and every rank raises the same ValueError, listing
what each rank passed and, for a rank that refused, why.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnkit.distributed.transport import Ring

__all__ = ["Call", "agree", "identity"]

_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_DIMS = 8  # dims of a tensor's shape in a row (more are cut: the text still says them)


@dataclass
class Call:
    """One rank's description of its call: named columns of int64 (compared across ranks) with
    the words each stands for, and facts that are gathered but not compared."""

    columns: dict[str, list[int]] = field(default_factory=dict)
    words: dict[str, str] = field(default_factory=dict)
    facts: dict[str, bool] = field(default_factory=dict)

    def tensor(self, name: str, x: object) -> None:
        """A tensor argument by its shape (None, or a non-tensor, by its type)."""
        if isinstance(x, Tensor):
            shape = tuple(x.shape)
            self.columns[name] = [len(shape), *shape[:_DIMS], *([-2] * (_DIMS - len(shape)))]
            self.words[name] = str(shape)
        else:
            code = -1 if x is None else -3 - zlib.crc32(type(x).__name__.encode()) % 1000
            self.columns[name] = [code] + [-2] * _DIMS
            self.words[name] = "None" if x is None else type(x).__name__

    def dtype(self, x: object) -> None:
        dtype = x.dtype if isinstance(x, Tensor) else None
        code = _DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES)
        self.columns["dtype"] = [code]
        self.words["dtype"] = str(dtype).removeprefix("torch.")

    def value(self, name: str, code: int, word: object) -> None:
        self.columns[name] = [int(code)]
        self.words[name] = str(word)

    def part(self, name: str, part: object) -> None:
        """A score or an alignment by its identity: its class and hyperparameters, its
        sub-modules' likewise (:func:`identity`)."""
        text = identity(part)
        self.columns[name] = [zlib.crc32(text.encode()) & 0x7FFFFFFF]
        self.words[name] = text if len(text) <= 100 else text[:97] + "..."

    def describe(self) -> str:
        return ", ".join(f"{name} {word}" for name, word in self.words.items())


def identity(part: object) -> str:
    """A module's class and hyperparameters — its plain attributes (numbers, strings, flags;
    functions by name) — and its sub-modules' likewise, the same text on every process (no
    addresses); the parameters' values are not read. Anything else: its repr."""
    if not isinstance(part, nn.Module):
        return repr(part)
    plain = []
    for key, value in sorted(vars(part).items()):
        if key.startswith("_") or key == "training":
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            plain.append(f"{key}={value!r}")
        elif callable(value) and not isinstance(value, nn.Module):
            plain.append(f"{key}={getattr(value, '__qualname__', type(value).__name__)}")
    inner = [*plain, *(f"{n}: {identity(c)}" for n, c in part.named_children())]
    return f"{type(part).__name__}({', '.join(inner)})"


def agree(
    ring: Ring,
    call: Call,
    refusal: Exception | None,
    device: torch.device,
    what: str = "ring attention",
) -> dict:
    """Gather every rank's verdict and call; return the facts AND-ed over the ranks when every
    rank accepted the same call, else raise on every rank the same ValueError.

    ``refusal`` is this rank's error (None when it accepted its part); with a ring of one the
    error itself is raised. ``device``: where the row is made (the backend's device); ``what``
    names the call in the message."""
    if refusal is not None and ring.size == 1:
        raise refusal
    names = list(call.columns)
    row = [v for name in names for v in call.columns[name]]
    row += [int(refusal is not None), *(int(f) for f in call.facts.values())]
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    table = ring.all_gather(mine, "agreeing that every rank holds its part of the same call")
    n = len(row) - 1 - len(call.facts)
    refused = table[:, n].tolist()
    if not any(refused) and bool((table[:, :n] == mine[:n]).all()):
        facts = table[:, n + 1 :].all(dim=0).tolist()
        return dict(zip(call.facts, (bool(f) for f in facts), strict=True))
    differ = _differing(table[:, :n], names, call.columns)
    texts: list = [None] * ring.size
    verdict = None if refusal is None else f"{type(refusal).__name__}: {refusal}"
    with ring.guard("gathering what every rank passed"):
        dist.all_gather_object(texts, (verdict, call.describe()), group=ring.group)
    lines = "; ".join(
        f"rank {r}: {'accepted' if v is None else 'refused (' + v + ')'}, passed {d}"
        for r, (v, d) in enumerate(texts)
    )
    heads = []
    if any(refused):
        who = ", ".join(str(r) for r, flag in enumerate(refused) if flag)
        heads.append(f"{what} was refused on rank {who} of {ring.size}")
    if differ:
        heads.append(
            "the ranks of the group were given different calls (each must pass its part of the "
            f"same sequence, the same group, layout and options; they differ in "
            f"{', '.join(differ)})"
        )
    raise ValueError(f"{'; '.join(heads)} — every rank raises this error: {lines}")


def _differing(table: Tensor, names: list[str], columns: Mapping[str, list[int]]) -> list[str]:
    out, i = [], 0
    for name in names:
        width = len(columns[name])
        if not bool((table[:, i : i + width] == table[0, i : i + width]).all()):
            out.append(name)
        i += width
    return out
