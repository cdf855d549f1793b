"""The taxonomy of Brauwers & Frasincar (Fig. 3) as data, and ``describe(model)`` which rebuilds a
model's row of Table III from the attnkit parts it is made of.

Each part declares what it contributes through ``taxonomy_tags()`` (members of the enums below).
``describe`` collects the tags of every module of a model. A module may also declare
``taxonomy_final``: dimensions its own tags settle for its whole subtree (a task model saying that
its softmax is called "Soft", as the survey does for images). A :class:`Variants` container holds
the models a paper compared; its row joins their differing cells with ", " as Table III does.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, fields

from torch import nn

__all__ = [
    "AlignmentKind",
    "Dimensionality",
    "FeatureLevels",
    "FeatureMultiplicity",
    "FeatureRepresentations",
    "QueryMultiplicity",
    "QueryType",
    "Scoring",
    "TaxonomyRow",
    "Variants",
    "describe",
]


class FeatureMultiplicity(enum.Enum):
    SINGULAR = "Singular"
    PARALLEL_CO_ATTENTION = "Parallel Co-attention"
    ALTERNATING_CO_ATTENTION = "Alternating Co-attention"
    INTERACTIVE_CO_ATTENTION = "Interactive Co-attention"
    NESTED_CO_ATTENTION = "Attention-over-Attention"
    MULTI_GRAINED_CO_ATTENTION = "Multi-Grained Co-attention"
    ROTATORY = "Rotatory"


class FeatureLevels(enum.Enum):
    SINGLE_LEVEL = "Single-Level"
    ATTENTION_VIA_ATTENTION = "Attention-via-Attention"
    HIERARCHICAL = "Hierarchical"


class FeatureRepresentations(enum.Enum):
    SINGLE = "Single-Representational"
    MULTI = "Multi-Representational"


class Scoring(enum.Enum):
    ADDITIVE = "Additive"
    MULTIPLICATIVE = "Multiplicative"
    SCALED_MULTIPLICATIVE = "Scaled-Multiplicative"
    GENERAL = "General"
    BIASED_GENERAL = "Biased General"
    ACTIVATED_GENERAL = "Activated General"
    SIMILARITY = "Similarity"
    LOCATION = "Location"
    CONVOLUTIONAL = "Convolution-Based"


class AlignmentKind(enum.Enum):
    GLOBAL = "Global"
    SOFT = "Soft"
    HARD = "Hard"
    LOCAL = "Local"
    REINFORCED = "Reinforced"
    SPARSE = "Sparse"
    SIGMOID = "Sigmoid"


class Dimensionality(enum.Enum):
    SINGLE = "Single-Dimensional"
    MULTI = "Multi-Dimensional"


class QueryType(enum.Enum):
    SELF_ATTENTIVE = "Self-Attentive"
    BASIC = "Basic"
    SPECIALIZED = "Specialized"


class QueryMultiplicity(enum.Enum):
    SINGULAR = "Singular"
    MULTI_HEAD = "Multi-Head"
    MULTI_HOP = "Multi-Hop"
    CAPSULE_BASED = "Capsule-Based"


# The eight columns of Table III, in order, with the value used when no part says otherwise.
DIMENSIONS: tuple[tuple[str, type[enum.Enum], enum.Enum | None], ...] = (
    ("feature_multiplicity", FeatureMultiplicity, FeatureMultiplicity.SINGULAR),
    ("feature_levels", FeatureLevels, FeatureLevels.SINGLE_LEVEL),
    ("feature_representations", FeatureRepresentations, FeatureRepresentations.SINGLE),
    ("scoring", Scoring, None),
    ("alignment", AlignmentKind, None),
    ("dimensionality", Dimensionality, Dimensionality.SINGLE),
    ("query_type", QueryType, None),
    ("query_multiplicity", QueryMultiplicity, QueryMultiplicity.SINGULAR),
)
_HEADERS = (
    "Feature multiplicity",
    "Feature levels",
    "Feature representations",
    "Scoring",
    "Alignment",
    "Dimensionality",
    "Query type",
    "Query multiplicity",
)


@dataclass(frozen=True)
class TaxonomyRow:
    """One row of Brauwers Table III, each cell as the survey writes it."""

    feature_multiplicity: str
    feature_levels: str
    feature_representations: str
    scoring: str
    alignment: str
    dimensionality: str
    query_type: str
    query_multiplicity: str

    def cells(self) -> tuple[str, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))

    def to_markdown(self, name: str = "model") -> str:
        head = "| | " + " | ".join(_HEADERS) + " |"
        rule = "|---" * (len(_HEADERS) + 1) + "|"
        return "\n".join([head, rule, f"| {name} | " + " | ".join(self.cells()) + " |"])


class Variants(nn.Module):
    """Models a paper compared (Table III's ","): ``describe`` joins their differing cells."""

    def __init__(self, **variants: nn.Module) -> None:
        super().__init__()
        if not variants:
            raise ValueError("Variants needs at least one model")
        self.variants = nn.ModuleDict(variants)

    def forward(self, *args, **kwargs):
        raise TypeError("Variants is a container of models; call one of .variants[name]")


def _collect(module: nn.Module) -> dict[type[enum.Enum], list[enum.Enum]]:
    tags: dict[type[enum.Enum], list[enum.Enum]] = {}
    own = list(module.taxonomy_tags()) if hasattr(module, "taxonomy_tags") else []
    for tag in own:
        tags.setdefault(type(tag), []).append(tag)
    final = set(getattr(module, "taxonomy_final", ()))
    for child in module.children():
        for dim, values in _collect(child).items():
            if dim not in final:
                tags.setdefault(dim, []).extend(values)
    return tags


def _cell(dim: type[enum.Enum], default: enum.Enum | None, values: Iterable[enum.Enum]) -> str:
    present = set(values)
    if default is not None and len(present) > 1:
        present.discard(default)
    if not present:
        if default is None:
            return "-"
        present = {default}
    return " + ".join(member.value for member in dim if member in present)


def describe(model: nn.Module) -> TaxonomyRow:
    """The model's row of Table III (Brauwers Sec. 4), from the parts it is built of."""
    if isinstance(model, Variants):
        rows = [describe(m).cells() for m in model.variants.values()]
        joined = []
        for column in zip(*rows, strict=True):
            seen: list[str] = []
            for cell in column:
                if cell not in seen:
                    seen.append(cell)
            joined.append(", ".join(seen))
        return TaxonomyRow(*joined)
    tags = _collect(model)
    return TaxonomyRow(*(_cell(dim, default, tags.get(dim, ())) for _, dim, default in DIMENSIONS))


def table_markdown(rows: dict[str, TaxonomyRow], marks: dict[str, bool] | None = None) -> str:
    """Several rows as one markdown table; ``marks`` adds a column of check marks."""
    extra = " | matches survey" if marks is not None else ""
    lines = [
        "| model | " + " | ".join(_HEADERS) + extra + " |",
        "|---" * (len(_HEADERS) + 1 + (marks is not None)) + "|",
    ]
    for name, row in rows.items():
        mark = (" | " + ("✓" if marks[name] else "✗")) if marks is not None else ""
        lines.append(f"| {name} | " + " | ".join(row.cells()) + mark + " |")
    return "\n".join(lines)
