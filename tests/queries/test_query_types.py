"""Query-type tags (Brauwers 3.3.1) for describe."""

import pytest
import torch

from attnkit.queries import QueryTagged
from attnkit.taxonomy import QueryType


def test_query_tags():
    tagged = QueryTagged(torch.nn.Identity(), "basic")
    assert tagged.taxonomy_tags() == [QueryType.BASIC]
    assert tagged(3) == 3
    with pytest.raises(ValueError, match="query must be one of"):
        QueryTagged(torch.nn.Identity(), "sideways")
