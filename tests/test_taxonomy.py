"""describe(): tags from parts, defaults, combinations with + and variants with ","."""

import attnkit as ak
from attnkit import taxonomy as tx


def test_plain_attention():
    row = tx.describe(ak.Attention(ak.scores.Additive(4, 4, 4)))
    assert row.cells() == (
        "Singular",
        "Single-Level",
        "Single-Representational",
        "Additive",
        "Global",
        "Single-Dimensional",
        "-",
        "Singular",
    )


def test_combined_tags_use_plus_in_enum_order():
    class Model(ak.Attention):
        def taxonomy_tags(self):
            return [tx.QueryType.BASIC, tx.QueryMultiplicity.MULTI_HOP]

    m = Model(ak.scores.LearnedQuery(4))
    row = tx.describe(m)
    assert row.query_type == "Self-Attentive + Basic"
    assert row.query_multiplicity == "Multi-Hop"


def test_variants_join_differing_cells_with_commas():
    v = tx.Variants(a=ak.Attention("dot"), b=ak.Attention("scaled_dot", "sparsemax"))
    row = tx.describe(v)
    assert row.scoring == "Multiplicative, Scaled-Multiplicative"
    assert row.alignment == "Global, Sparse"
    assert row.dimensionality == "Single-Dimensional"


def test_final_dimensions_hide_children():
    class Renamed(ak.Attention):
        taxonomy_final = (tx.AlignmentKind,)

        def taxonomy_tags(self):
            return [tx.AlignmentKind.SOFT]

    assert tx.describe(Renamed()).alignment == "Soft"


def test_markdown():
    row = tx.describe(ak.Attention())
    md = row.to_markdown("x")
    assert md.splitlines()[2].startswith("| x | Singular |")
    table = tx.table_markdown({"x": row}, {"x": True})
    assert table.splitlines()[-1].endswith("| ✓ |")
