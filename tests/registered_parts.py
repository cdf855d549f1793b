"""Every registered score and alignment as the contract suites run them.

The instances come from each class's own ``examples()`` (:mod:`attnkit.sizing`), found by
walking the registries, so a part registered anywhere is covered with no list to update. An id
is the registered name, or ``name[variant]`` for a named variant of the class's ``examples()``
(``additive[query-free]``, ``softmax[learned-temperature]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import attnkit as ak
from attnkit import alignments as al
from attnkit import scores as sc
from attnkit.registry import Registry


@dataclass(frozen=True)
class Dims:
    """Test sizes: queries and keys of d_q = d_k features (a part's ``head_dim``), values of
    d_v, at most ``max_len`` keys."""

    d_q: int = 4
    d_k: int = 4
    d_v: int = 3
    max_len: int = 16

    def __post_init__(self) -> None:
        if self.d_q != self.d_k:
            raise ValueError(f"examples take d_q = d_k (head_dim), got {self.d_q} and {self.d_k}")

    def sizes(self) -> dict[str, int]:
        """The keyword arguments of a class's ``examples()``."""
        return {"head_dim": self.d_q, "value_dim": self.d_v, "max_len": self.max_len}


def registered(part_id: str) -> str:
    """The registered name of an id (the part before ``[``)."""
    return part_id.split("[")[0]


def _variant(part_id: str) -> str:
    """The ``examples()`` key of an id ("" for the plain example)."""
    return part_id.partition("[")[2].removesuffix("]")


def examples(registry: Registry[Any]) -> dict[str, Callable[[Dims], Any]]:
    """Id -> factory(dims) of every example of every class registered now in ``registry``."""
    out: dict[str, Callable[[Dims], Any]] = {}
    for name in registry.available():
        cls = registry.get(name)
        for label in cls.examples(**Dims().sizes()):
            part_id = name if label == "" else f"{name}[{label}]"
            out[part_id] = _factory(cls, label)
    return out


def _factory(cls: type, label: str) -> Callable[[Dims], Any]:
    return lambda dims: cls.examples(**dims.sizes())[label]


def score_examples() -> dict[str, Callable[[Dims], sc.Score]]:
    """Every registered score's examples, by id."""
    return examples(sc.REGISTRY)


def alignment_examples() -> dict[str, Callable[[Dims], al.Alignment]]:
    """Every registered alignment's examples, by id."""
    return examples(al.REGISTRY)


SCORES = score_examples()
ALIGNMENTS = alignment_examples()


def build_attention(
    score: str,
    align: str,
    dims: Dims = Dims(),
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> ak.Attention:
    """An Attention module with deterministic parameters, in eval mode, in ``dtype``, from the
    ids ``score`` and ``align`` (looked up in the registries as they are now)."""
    torch.manual_seed(seed)
    s = sc.REGISTRY.get(registered(score)).examples(**dims.sizes())[_variant(score)]
    a = al.REGISTRY.get(registered(align)).examples(**dims.sizes())[_variant(align)]
    return ak.Attention(s, a).to(dtype).eval()


def inputs(
    dims: Dims = Dims(),
    *,
    b: int = 2,
    m: int = 3,
    n: int = 5,
    dtype: torch.dtype = torch.float64,
    seed: int = 1,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, m, d_q), k (b, n, d_k), v (b, n, d_v), standard normal from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, dims.d_q, generator=g, dtype=dtype)
    k = torch.randn(b, n, dims.d_k, generator=g, dtype=dtype)
    v = torch.randn(b, n, dims.d_v, generator=g, dtype=dtype)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))  # type: ignore[return-value]
