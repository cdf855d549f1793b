"""Brauwers Table III as data: 17 rows of the eight taxonomy cells, one per rebuilt model."""

from attnkit import taxonomy as tx
from attnkit.models import table3
from attnkit.models.survey_table3 import SURVEY


def test_seventeen_rows_of_eight_cells_one_per_model():
    assert len(SURVEY) == 17 and list(SURVEY) == list(table3.MODELS)
    n_cells = len(tx.TaxonomyRow.__dataclass_fields__)
    assert all(len(cells) == n_cells == 8 for cells in SURVEY.values())
